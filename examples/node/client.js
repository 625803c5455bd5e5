// A Tidemark client in Node.js, written from proto/tidemark.proto alone: no record format, no
// CRC, no Tidemark library. It creates a topic, sends a plain and a delayed message, pulls them
// back decoded, commits an offset, reads it back, pops them for a second group and acks them
// (pop mode), drains 250 jobs with a consumer loop of bulk pops and acks, runs two transactions on queue 1 (one committed with a consumer offset, one aborted)
// and one in a single call on queue 0, reads queue 1 read_committed, and prints the node's typed status.
//
//   npm ci && node client.js 127.0.0.1:7600 [topic]
//   TIDEMARK_TOKEN=... node client.js ...      # a daemon with auth.tokens_file
//
// Every step prints one JSON line ({"step": ..., ...}) so a script (tests/test_node_client.py)
// can check what happened.
'use strict';

const crypto = require('crypto');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO = process.env.TIDEMARK_PROTO || path.join(__dirname, '..', '..', 'proto', 'tidemark.proto');
const address = process.argv[2] || '127.0.0.1:7600';
const topic = process.argv[3] || 'node-example';
const group = 'node-example';

const definition = protoLoader.loadSync(PROTO, {
  keepCase: true, // field names as in the .proto (queue_id, not queueId)
  longs: String, // uint64 offsets do not fit a JS number: strings
  enums: String,
  defaults: true,
  oneofs: true,
});
const tidemark = grpc.loadPackageDefinition(definition).tidemark.v1;
const broker = new tidemark.Broker(address, grpc.credentials.createInsecure());

// A transaction's BeginTransactionRequest.begin_id: random, nonzero, a uint64 as a decimal string.
function newBeginId() {
  return (crypto.randomBytes(8).readBigUInt64BE() | 1n).toString();
}

function metadata() {
  const md = new grpc.Metadata();
  if (process.env.TIDEMARK_TOKEN) md.set('authorization', `Bearer ${process.env.TIDEMARK_TOKEN}`);
  return md;
}

// One unary call as a promise; gRPC errors keep their status code (err.code, err.details).
function call(method, request, timeoutMs = 10000) {
  return new Promise((resolve, reject) => {
    broker[method](request, metadata(), { deadline: Date.now() + timeoutMs }, (err, response) => {
      if (err) reject(err);
      else resolve(response);
    });
  });
}

function print(step, fields) {
  console.log(JSON.stringify({ step, ...fields }));
}

async function main() {
  try {
    const created = await call('CreateTopic', { name: topic, queues: 2 });
    print('create_topic', { topic: created.topic.name, queues: created.topic.queues });
  } catch (err) {
    if (err.code !== grpc.status.ALREADY_EXISTS) throw err;
    print('create_topic', { topic, existed: true });
  }

  // Plain messages: the server encodes them (one batch per topic and queue of the call).
  const deliverAt = Date.now() + 1500;
  const sent = await call('Send', {
    ack: 'ACK_REPLICA',
    messages: [
      { topic, queue_id: 0, key: 'order-1', body: Buffer.from('hello from node'), properties: { lang: 'node' } },
      { topic, queue_id: 0, body: Buffer.from('delayed from node'), deliver_at_ms: String(deliverAt) },
    ],
  });
  print('send', { receipts: sent.message_receipts });

  // Pull decoded messages from queue 0 until both arrived (the delayed one after ~1.5 s).
  let offset = '0';
  const bodies = [];
  const deadline = Date.now() + 15000;
  while (bodies.length < 2 && Date.now() < deadline) {
    const pulled = await call('Pull', {
      topic, queue_id: 0, offset, max_messages: 100, max_wait_ms: 1000, decode: true,
    });
    for (const m of pulled.messages) {
      bodies.push(m.body.toString());
      print('message', {
        queue_offset: m.queue_offset, key: m.key, body: m.body.toString(), properties: m.properties,
        deliver_at_ms: m.deliver_at_ms, timer_offset: m.timer_offset,
      });
    }
    offset = pulled.next_offset;
  }
  print('pull', { bodies, next_offset: offset });

  await call('CommitOffset', { offsets: [{ group, topic, queue_id: 0, offset }] });
  const committed = await call('GetOffset', { group, topic, queue_id: 0 });
  print('commit', { found: committed.found, offset: committed.offset });

  // Pop mode: lease the same messages for another group, decoded, and ack them by receipt handle.
  const popped = await call('Pop', {
    group: `${group}-pop`, topic, max_messages: 10, invisible_ms: 30000, start_earliest: true, decode: true,
  });
  const handles = popped.messages.map((m) => m.receipt_handle);
  const acked = await call('Ack', { group: `${group}-pop`, receipt_handles: handles });
  print('pop', {
    bodies: popped.messages.map((m) => m.body.toString()),
    delivery_counts: popped.messages.map((m) => m.delivery_count),
    not_acked: acked.results.length,
  });

  // A consumer loop in pop mode, in bulk: each Pop long-polls for up to 100 messages (decoded, from
  // every queue) and carries the acks of the batch before (ack_receipt_handles: one call, not a Pop
  // and an Ack); consumers' pops and acks that reach the master together share one record. The
  // loop ends when a Pop finds nothing within its wait (that Pop acked the last batch).
  const jobsTopic = `${topic}-jobs`;
  try {
    await call('CreateTopic', { name: jobsTopic, queues: 4 });
  } catch (err) {
    if (err.code !== grpc.status.ALREADY_EXISTS) throw err;
  }
  const jobs = [];
  for (let i = 0; i < 250; i++) jobs.push({ topic: jobsTopic, key: `job-${i}`, body: Buffer.from(`job ${i}`) });
  await call('Send', { ack: 'ACK_FLUSH', messages: jobs });
  const workers = `${group}-workers`;
  const done = new Set();
  let consumed = 0;
  let pops = 0;
  let refused = 0;
  let finished = [];
  for (;;) {
    const batch = await call('Pop', {
      group: workers, topic: jobsTopic, max_messages: 100, invisible_ms: 30000, max_wait_ms: 300, start_earliest: true,
      decode: true, ack_receipt_handles: finished,
    });
    refused += batch.ack_results.length; // handles of `finished` not acked (their leases had ended)
    if (batch.messages.length === 0) break;
    pops += 1;
    for (const m of batch.messages) {
      consumed += 1; // the work of a message goes here
      done.add(m.body.toString());
    }
    finished = batch.messages.map((m) => m.receipt_handle);
  }
  print('consume_loop', { consumed, distinct: done.size, pops, refused });

  // Transactions: the first Send begins one (SendRequest.begin; BeginTransaction does it alone),
  // later sends name it (SendRequest.transaction), EndTransaction ends it. A read_committed pull
  // (the default) sees the committed one only; the aborted one's offsets stay as a gap. Counted
  // (count_messages): the sends are answered at ACK_LEADER and the commit gives how many messages
  // they carried; a commit whose count the master's log does not hold aborts ("incomplete").
  for (const [name, commit] of [['node-tx-ok', true], ['node-tx-no', false]]) {
    // a counted transaction's messages are idempotent: a queue_id and a sequence each
    const [first, second] = [0, 1].map((i) => ({ topic, queue_id: 1, sequence: String(i), body: Buffer.from(`${name} ${i + 1}`) }));
    const { begun } = await call('Send', {
      ack: 'ACK_LEADER', messages: [first],
      transaction: '9223372036854775808', // 1<<63 with begin: a node without SendRequest.begin refuses the send
      // begin_id: random, the same on every retry of this call (a retry joins what it began)
      begin: { transactional_id: name, timeout_ms: 30000, count_messages: true, begin_id: newBeginId() },
    });
    await call('Send', { ack: 'ACK_LEADER', transaction: begun.producer_id, messages: [second] });
    const ended = await call('EndTransaction', {
      transactional_id: name, producer_id: begun.producer_id, commit, messages_sent: '2',
      offsets: commit ? [{ group: `${group}-tx`, topic, queue_id: 0, offset: '2' }] : [],
    });
    print('transaction', { transactional_id: name, epoch: begun.epoch, counted: begun.counted, outcome: ended.outcome });
  }
  // A transaction in one call: the Send begins it and carries its commit (SendRequest.commit;
  // producer_id 0 with begin, messages_sent counting this call's): begin, messages and decision
  // appended in one step, answered once the decision is replicated, with `ended`.
  const one = await call('Send', {
    ack: 'ACK_LEADER', transaction: '9223372036854775808',
    messages: [{ topic, queue_id: 0, sequence: '0', body: Buffer.from('node-tx-one') }],
    begin: { transactional_id: 'node-tx-one', count_messages: true, begin_id: newBeginId() },
    commit: { transactional_id: 'node-tx-one', commit: true, messages_sent: '1' },
  });
  print('transaction_one', { outcome: one.ended.outcome, began: one.begun.producer_id !== '0', receipts: one.message_receipts.length });
  const txRead = await call('Pull', { topic, queue_id: 1, offset: '0', max_messages: 100, decode: true });
  const txRaw = await call('Pull', {
    topic, queue_id: 1, offset: '0', max_messages: 100, decode: true, isolation: 'ISOLATION_READ_UNCOMMITTED',
  });
  print('read_committed', {
    bodies: txRead.messages.map((m) => m.body.toString()),
    offsets: txRead.messages.map((m) => m.queue_offset),
    next_offset: txRead.next_offset,
    uncommitted: txRaw.messages.length,
  });

  const { status } = await call('Status', {});
  print('status', {
    role: status.role, epoch: status.epoch, max_offset: status.max_offset,
    confirm_offset: status.confirm_offset, timer_pending: status.timer_pending,
    replicas: status.replicas.length, node_id: status.node_id,
    transactions: {
      committed: status.transactions.committed, aborted: status.transactions.aborted, open: status.transactions.open,
    },
  });
}

main().then(
  () => broker.close(),
  (err) => {
    console.error(`tidemark example: ${err.code !== undefined ? `${grpc.status[err.code]}: ` : ''}${err.details || err.message}`);
    broker.close();
    process.exit(1);
  },
);
