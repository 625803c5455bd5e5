// Send and pull throughput of a Node.js client, for bench/plain_api.py, which runs it beside our
// Python client against the same daemon in the same run. Two ways:
// - written from proto/tidemark.proto alone: plain messages in (`send`), decoded messages out
//   (`pull`, decode = true);
// - with the record format in JS (./batches.js), as our Python client does it: records and their
//   CRC32C encoded here, one batch per queue (`send-batch`), pulled batches read here (`pull-batch`).
//
//   node bench.js ADDRESS send|send-batch TOPIC MESSAGES PER_CALL BODY_BYTES START_AT_MS
//   node bench.js ADDRESS pull|pull-batch TOPIC QUEUE END_OFFSET PER_CALL START_AT_MS
//
// One call at a time, as each Python process of the bench does; a send is ack=flush, each message
// keyed, a new request every call (`send-batch`: idempotent, one random producer id, sequences per
// queue, as the Python client sends). It waits until START_AT_MS (epoch ms) so that every process
// starts at once, and prints one JSON line: {"messages": n, "seconds": s}.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const crypto = require('crypto');
const batches = require('./batches');

const PROTO = process.env.TIDEMARK_PROTO || path.join(__dirname, '..', '..', 'proto', 'tidemark.proto');
const [address, mode, topic, ...rest] = process.argv.slice(2);

const definition = protoLoader.loadSync(PROTO, { keepCase: true, longs: String, enums: String, defaults: true });
const tidemark = grpc.loadPackageDefinition(definition).tidemark.v1;
const limits = { 'grpc.max_receive_message_length': 64 << 20, 'grpc.max_send_message_length': 64 << 20 };
const broker = new tidemark.Broker(address, grpc.credentials.createInsecure(), limits);

function call(method, request) {
  return new Promise((resolve, reject) => {
    broker[method](request, { deadline: Date.now() + 60000 }, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

// A Send whose request is already on the wire (batches.encodeSendRequest): gRPC sends the bytes.
const sendMethod = tidemark.Broker.service.Send;
function sendWire(wire) {
  return new Promise((resolve, reject) => {
    broker.makeUnaryRequest(sendMethod.path, (bytes) => bytes, sendMethod.responseDeserialize, wire,
      { deadline: Date.now() + 60000 }, (err, response) => (err ? reject(err) : resolve(response)));
  });
}

async function startAt(ms) {
  const wait = Number(ms) - Date.now();
  if (wait > 0) await new Promise((resolve) => setTimeout(resolve, wait));
}

async function send(count, perCall, bodyBytes, start) {
  const body = Buffer.alloc(Number(bodyBytes), 'x');
  const calls = Math.floor(Number(count) / Number(perCall));
  await call('Status', {}); // connected before the clock starts
  await startAt(start);
  const t0 = process.hrtime.bigint();
  for (let c = 0; c < calls; c++) {
    const messages = [];
    for (let i = 0; i < Number(perCall); i++) messages.push({ topic, key: String(i), body });
    await call('Send', { ack: 'ACK_FLUSH', messages });
  }
  return { messages: calls * Number(perCall), seconds: Number(process.hrtime.bigint() - t0) / 1e9 };
}

// Keyed messages encoded into one batch per queue (crc32c(key) % queues), each call a new request
// from the same messages, as the Python processes send one list again and again.
async function sendBatches(count, perCall, bodyBytes, start) {
  const body = Buffer.alloc(Number(bodyBytes), 'x');
  const calls = Math.floor(Number(count) / Number(perCall));
  const topicInfo = await call('DescribeTopic', { name: topic }); // connected, and the queue count
  const queues = topicInfo.queues.length;
  const producerId = crypto.randomBytes(8).readBigUInt64BE() >> 1n | 1n;
  const sequences = new Array(queues).fill(0);
  const messages = [];
  for (let i = 0; i < Number(perCall); i++) messages.push({ key: String(i), body });
  const encoder = new batches.SendEncoder();
  await startAt(start);
  const t0 = process.hrtime.bigint();
  for (let c = 0; c < calls; c++) {
    const byQueue = new Map(); // grouped every call, as the Python client's send groups its list
    for (const m of messages) {
      const q = batches.queueFor(m.key, queues);
      if (!byQueue.has(q)) byQueue.set(q, []);
      byQueue.get(q).push(m);
    }
    const request = [...byQueue].map(([q, group]) => ({ topic, queue_id: q, producer_id: producerId,
      base_sequence: sequences[q], messages: group }));
    const response = await sendWire(encoder.encode(request, 'ACK_FLUSH'));
    request.forEach((b, i) => { sequences[b.queue_id] += response.receipts[i].record_count; });
  }
  return { messages: calls * Number(perCall), seconds: Number(process.hrtime.bigint() - t0) / 1e9 };
}

// Reads a queue to END_OFFSET: decoded by the server (`pull`), or batches read here (`pull-batch`:
// every body, no per-message object, as the Python client's bodies()).
async function pull(queue, end, perCall, start, decode) {
  await call('Status', {});
  await startAt(start);
  const t0 = process.hrtime.bigint();
  let offset = 0n;
  let n = 0;
  while (offset < BigInt(end)) {
    const r = await call('Pull', { topic, queue_id: Number(queue), offset: offset.toString(), max_messages: Number(perCall),
      decode });
    const bodies = decode ? r.messages.map((m) => m.body) : batches.bodies(r.batches, r.skip_first, r.count);
    for (const body of bodies) if (body.length) n++;
    offset = BigInt(r.next_offset);
  }
  return { messages: n, seconds: Number(process.hrtime.bigint() - t0) / 1e9 };
}

const MODES = {
  send,
  'send-batch': sendBatches,
  pull: (...args) => pull(...args, true),
  'pull-batch': (...args) => pull(...args, false),
};

async function main() {
  if (!MODES[mode]) throw new Error(`mode must be one of ${Object.keys(MODES).join(', ')}`);
  const result = await MODES[mode](...rest);
  console.log(JSON.stringify(result));
  broker.close();
}

main().catch((err) => {
  console.error(`tidemark node bench: ${err.code !== undefined ? grpc.status[err.code] : ''} ${err.details || err.message}`);
  process.exit(1);
});
