// Drives examples/node/batches.js for tests/test_node_batches.py. Reads one JSON object on stdin
// ({"messages": [{key, properties, body (base64)}]}), prints one JSON line.
//
//   node batches_check.js encode                     the wire of encodeSendRequest and protobufjs's
//                                                    encoding of the same request (hex), the queues
//   node batches_check.js send ADDRESS TOPIC         one Send of the messages (one idempotent batch
//                                                    per queue), then the same bytes again
//   node batches_check.js pull ADDRESS TOPIC QUEUES  every queue pulled to its end, decoded here
'use strict';

const path = require('path');
const crypto = require('crypto');
const EXAMPLE = path.join(__dirname, '..', '..', 'examples', 'node');
const grpc = require(path.join(EXAMPLE, 'node_modules', '@grpc', 'grpc-js'));
const protoLoader = require(path.join(EXAMPLE, 'node_modules', '@grpc', 'proto-loader'));
const batches = require(path.join(EXAMPLE, 'batches.js'));

const definition = protoLoader.loadSync(path.join(__dirname, '..', '..', 'proto', 'tidemark.proto'),
  { keepCase: true, longs: String, enums: String, defaults: true });
const tidemark = grpc.loadPackageDefinition(definition).tidemark.v1;
const [mode, address, topic, queues] = process.argv.slice(2);
const input = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const messages = input.messages.map((m) => ({ key: m.key, properties: m.properties, body: Buffer.from(m.body, 'base64') }));

function byQueue(count) {
  const out = new Map();
  for (const m of messages) {
    const q = m.key ? batches.queueFor(m.key, count) : 0;
    if (!out.has(q)) out.set(q, []);
    out.get(q).push(m);
  }
  return [...out].map(([q, group]) => ({ topic: topic || 't', queue_id: q, messages: group }));
}

function unary(broker, method, request, serialize) {
  const m = tidemark.Broker.service[method];
  return new Promise((resolve, reject) => {
    broker.makeUnaryRequest(m.path, serialize || m.requestSerialize, m.responseDeserialize, request,
      { deadline: Date.now() + 30000 }, (err, r) => (err ? reject(err) : resolve(r)));
  });
}

async function main() {
  if (mode === 'encode') {
    const request = byQueue(4).map((b, i) => ({ ...b, producer_id: i ? 0n : (1n << 62n) + 5n, base_sequence: i ? -1 : 300 }));
    const wire = batches.encodeSendRequest(request, 'ACK_FLUSH', 2500);
    const viaProtobufjs = tidemark.Broker.service.Send.requestSerialize({
      ack: 'ACK_FLUSH', timeout_ms: 2500, batches: request.map((b) => {
        const { records, count, crc } = batches.encodeRecords(b.messages);
        return { topic: b.topic, queue_id: b.queue_id, producer_id: b.producer_id.toString(), base_sequence: b.base_sequence,
          record_count: count, records_crc: crc, records };
      }),
    });
    // the encoder's Buffer written again: the whole request, then a smaller one in the same bytes
    const reused = new batches.SendEncoder();
    const first = reused.encode(request, 'ACK_FLUSH', 2500);
    const whole = first.toString('hex');
    reused.done(first);
    const smaller = reused.encode(request.slice(1), 'ACK_FLUSH', 2500);
    console.log(JSON.stringify({ wire: wire.toString('hex'), protobufjs: viaProtobufjs.toString('hex'), encoder: whole,
      smaller: smaller.toString('hex'), smaller_fresh: batches.encodeSendRequest(request.slice(1), 'ACK_FLUSH', 2500).toString('hex'),
      same_buffer: smaller.buffer === first.buffer, queues: request.map((b) => b.queue_id) }));
    return;
  }
  const broker = new tidemark.Broker(address, grpc.credentials.createInsecure());
  if (mode === 'send') {
    const producerId = crypto.randomBytes(8).readBigUInt64BE() >> 1n | 1n;
    const request = byQueue(Number(queues)).map((b) => ({ ...b, producer_id: producerId, base_sequence: 0 }));
    const wire = batches.encodeSendRequest(request, 'ACK_FLUSH');
    const first = await unary(broker, 'Send', wire, (x) => x);
    const retried = await unary(broker, 'Send', wire, (x) => x);
    console.log(JSON.stringify({ queues: request.map((b) => b.queue_id), first: first.receipts, retried: retried.receipts }));
  } else {
    const out = { cut_refused: [] };
    for (let q = 0; q < Number(queues); q++) {
      out[q] = [];
      for (let offset = 0; ;) {
        const r = await unary(broker, 'Pull', { topic, queue_id: q, offset: String(offset), max_messages: 7 });
        const decoded = batches.decode(r.batches, r.skip_first, r.count);
        if (offset === 0 && r.count) { // the same answer cut short by a byte: refused, never read short
          const last = r.batches.length - 1;
          const bent = [...r.batches.slice(0, last), r.batches[last].subarray(0, r.batches[last].length - 1)];
          try {
            batches.bodies(bent, r.skip_first, r.count + 1000);
            out.cut_refused.push(false);
          } catch (err) {
            out.cut_refused.push(err instanceof RangeError);
          }
        }
        const bodies = batches.bodies(r.batches, r.skip_first, r.count);
        decoded.forEach((m, i) => out[q].push({ ...m, body: m.body.toString('base64'), same_body: bodies[i].equals(m.body) }));
        if (Number(r.next_offset) === offset || Number(r.next_offset) >= Number(r.max_offset)) break;
        offset = Number(r.next_offset);
      }
    }
    console.log(JSON.stringify(out));
  }
  broker.close();
}

main().catch((err) => {
  console.error(`batches_check: ${err.code !== undefined ? grpc.status[err.code] : ''} ${err.details || err.message}`);
  process.exit(1);
});
