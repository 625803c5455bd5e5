// Send and pull throughput of a Node.js client written from proto/tidemark.proto alone (plain
// messages in, decoded messages out), for bench/plain_api.py, which runs it beside our Python
// client against the same daemon in the same run.
//
//   node bench.js ADDRESS send TOPIC MESSAGES PER_CALL BODY_BYTES START_AT_MS
//   node bench.js ADDRESS pull TOPIC QUEUE END_OFFSET PER_CALL START_AT_MS
//
// One call at a time, as each Python process of the bench does; a send is ack=flush, each message
// keyed (the server picks the queue), a new request object every call. It waits until
// START_AT_MS (epoch ms) so that every process starts at once, and prints one JSON line:
// {"messages": n, "seconds": s}.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

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

async function pull(queue, end, perCall, start) {
  await call('Status', {});
  await startAt(start);
  const t0 = process.hrtime.bigint();
  let offset = 0n;
  let n = 0;
  while (offset < BigInt(end)) {
    const r = await call('Pull', { topic, queue_id: Number(queue), offset: offset.toString(), max_messages: Number(perCall),
      decode: true });
    for (const m of r.messages) if (m.body.length) n++;
    offset = BigInt(r.next_offset);
  }
  return { messages: n, seconds: Number(process.hrtime.bigint() - t0) / 1e9 };
}

async function main() {
  const result = mode === 'send' ? await send(...rest) : await pull(...rest);
  console.log(JSON.stringify(result));
  broker.close();
}

main().catch((err) => {
  console.error(`tidemark node bench: ${err.code !== undefined ? grpc.status[err.code] : ''} ${err.details || err.message}`);
  process.exit(1);
});
