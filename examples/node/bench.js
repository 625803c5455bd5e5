// Send and pull throughput of a Node.js client, for bench/plain_api.py, which runs it beside our
// Python client against the same daemon in the same run. Two ways:
// - written from proto/tidemark.proto alone: plain messages in (`send`), decoded messages out
//   (`pull`, decode = true);
// - with the record format in JS (./batches.js), as our Python client does it: records and their
//   CRC32C encoded here, one batch per queue (`send-batch`), pulled batches read here (`pull-batch`).
//
//   node bench.js ADDRESS send|send-batch TOPIC CALLERS MESSAGES PER_CALL BODY_BYTES START_AT_MS
//   node bench.js ADDRESS pull|pull-batch TOPIC QUEUE:END_OFFSET[,QUEUE:END_OFFSET...] PER_CALL START_AT_MS
//
// Each caller is a loop of one call at a time, as each Python process of the bench is; the
// callers of one process run side by side on its event loop (one channel), as a Node service
// serves many requests in one process. A sender sends MESSAGES (ack=flush, each keyed, a new
// request every call; `send-batch`: idempotent, a random producer id of its own, sequences per
// queue, as the Python client sends); a puller reads its queue to END_OFFSET. It waits until
// START_AT_MS (epoch ms) so that every process starts at once, and prints one JSON line:
// {"messages": n, "seconds": s}.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const crypto = require('crypto');
let batches; // ./batches (the record format: CRC32C libraries) only for the modes that use it

const PROTO = process.env.TIDEMARK_PROTO || path.join(__dirname, '..', '..', 'proto', 'tidemark.proto');
const [address, mode, topic, ...rest] = process.argv.slice(2);

const definition = protoLoader.loadSync(PROTO, { keepCase: true, longs: String, enums: String, defaults: true });
const tidemark = grpc.loadPackageDefinition(definition).tidemark.v1;
// grpc-js's HTTP/2 window is 64 KiB unless set: a 1 MiB answer would wait on 16 window updates
const limits = { 'grpc.max_receive_message_length': 64 << 20, 'grpc.max_send_message_length': 64 << 20,
  'grpc-node.flow_control_window': 16 << 20 };
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

// Runs every caller from START_AT_MS on; all of their messages over the time the last one took.
async function timed(start, callers) {
  await call('Status', {}); // connected before the clock starts
  await startAt(start);
  const t0 = process.hrtime.bigint();
  const counts = await Promise.all(callers.map((caller) => caller()));
  return { messages: counts.reduce((a, b) => a + b, 0), seconds: Number(process.hrtime.bigint() - t0) / 1e9 };
}

// Plain messages: the server encodes them (and picks each keyed message's queue).
function plainSender(calls, perCall, body) {
  return async () => {
    for (let c = 0; c < calls; c++) {
      const messages = [];
      for (let i = 0; i < perCall; i++) messages.push({ topic, key: String(i), body });
      await call('Send', { ack: 'ACK_FLUSH', messages });
    }
    return calls * perCall;
  };
}

// Keyed messages encoded into one batch per queue (crc32c(key) % queues), each call a new request
// from the same messages, as the Python processes send one list again and again.
function batchSender(calls, perCall, body, queues) {
  return async () => {
    const producerId = crypto.randomBytes(8).readBigUInt64BE() >> 1n | 1n;
    const sequences = new Array(queues).fill(0);
    const messages = [];
    for (let i = 0; i < perCall; i++) messages.push({ key: String(i), body });
    const encoder = new batches.SendEncoder();
    for (let c = 0; c < calls; c++) {
      const byQueue = new Map(); // grouped every call, as the Python client's send groups its list
      for (const m of messages) {
        const q = batches.queueFor(m.key, queues);
        if (!byQueue.has(q)) byQueue.set(q, []);
        byQueue.get(q).push(m);
      }
      const request = [...byQueue].map(([q, group]) => ({ topic, queue_id: q, producer_id: producerId,
        base_sequence: sequences[q], messages: group }));
      const wire = encoder.encode(request, 'ACK_FLUSH');
      const response = await sendWire(wire);
      encoder.done(wire);
      request.forEach((b, i) => { sequences[b.queue_id] += response.receipts[i].record_count; });
    }
    return calls * perCall;
  };
}

async function send(batched, callers, count, perCall, bodyBytes, start) {
  const body = Buffer.alloc(Number(bodyBytes), 'x');
  const calls = Math.floor(Number(count) / Number(perCall));
  const queues = (await call('DescribeTopic', { name: topic })).queues.length;
  const make = () => (batched ? batchSender(calls, Number(perCall), body, queues) : plainSender(calls, Number(perCall), body));
  return timed(start, Array.from({ length: Number(callers) }, make));
}

// Reads a queue to `end`: decoded by the server (`decode`), or batches read here (every body, no
// per-message object, as the Python client's bodies()).
function puller(queue, end, perCall, decode) {
  return async () => {
    let offset = 0n;
    let n = 0;
    while (offset < end) {
      const r = await call('Pull', { topic, queue_id: queue, offset: offset.toString(), max_messages: perCall, decode });
      const bodies = decode ? r.messages.map((m) => m.body) : batches.bodies(r.batches, r.skip_first, r.count);
      for (const body of bodies) if (body.length) n++;
      offset = BigInt(r.next_offset);
    }
    return n;
  };
}

function pull(decode, queues, perCall, start) {
  return timed(start, queues.split(',').map((spec) => {
    const [queue, end] = spec.split(':');
    return puller(Number(queue), BigInt(end), Number(perCall), decode);
  }));
}

const MODES = {
  send: (...args) => send(false, ...args),
  'send-batch': (...args) => send(true, ...args),
  pull: (...args) => pull(true, ...args),
  'pull-batch': (...args) => pull(false, ...args),
};

async function main() {
  if (!Object.hasOwn(MODES, mode)) throw new Error(`mode must be one of ${Object.keys(MODES).join(', ')}`);
  if (mode.endsWith('-batch')) batches = require('./batches');
  const result = await MODES[mode](...rest);
  console.log(JSON.stringify(result));
  broker.close();
}

main().catch((err) => {
  console.error(`tidemark node bench: ${err.code !== undefined ? grpc.status[err.code] : ''} ${err.details || err.message}`);
  process.exit(1);
});
