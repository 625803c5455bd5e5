// The log's record format in JavaScript (docs/formats/commitlog.md): what lets a Node client take
// the fast path our Python client takes. It encodes a send's records and their CRC32C once, so the
// server checks and appends the bytes unchanged (SendRequest.batches), and it reads pulled batches
// itself (PullResponse.batches) instead of asking the server to decode them (PullRequest.decode).
//
//   const batches = require('./batches');
//   const { records, count, crc } = batches.encodeRecords([{ key: 'k', body: Buffer.from('x') }]);
//   batches.queueFor('k', 4);                       // the queue a keyed message goes to
//   batches.bodies(response.batches, response.skip_first, response.count);
//   batches.decode(response.batches, response.skip_first, response.count);   // one object each
//
// A record: u32 record_bytes (bytes after this field), u16 key_len, u16 props_len, key, props
// (repeated u16 name_len, name, u16 value_len, value; UTF-8), body. A batch: a 64-byte header,
// the topic, the records; PullResponse.batches holds runs of whole batches back to back.
'use strict';

const { crc32c } = require('@node-rs/crc32'); // native: 4-5 GB/s, ~0.4 us a call of fixed cost
const CRC32C = require('crc-32/crc32c'); // JavaScript: ~1 GB/s, ~40 ns for a short key's UTF-8

const RECORD_HEAD_BYTES = 8;
const BATCH_HEADER_BYTES = 64;
const U16_MAX = 0xffff;

function utf8(text) {
  return text === undefined || text === null || text === '' ? 0 : Buffer.byteLength(text, 'utf8');
}

function checkedLength(bytes, what) {
  if (bytes > U16_MAX) throw new RangeError(`${what} is ${bytes} bytes: at most ${U16_MAX}`);
  return bytes;
}

// The properties' bytes (u16 name_len, name, u16 value_len, value, ...): their length first.
function propsBytes(properties) {
  if (!properties) return 0;
  let n = 0;
  for (const name of Object.keys(properties)) {
    if (name.startsWith('__')) throw new RangeError(`property ${name}: names starting "__" are reserved`);
    n += 4 + checkedLength(utf8(name), 'a property name') + checkedLength(utf8(String(properties[name])), 'a property value');
  }
  return checkedLength(n, 'the properties');
}

// Each record's key and property bytes (key | props << 16), and all records' bytes.
function measure(messages) {
  const sizes = new Array(messages.length);
  let total = 0;
  for (let i = 0; i < messages.length; i++) {
    const m = messages[i];
    const keyBytes = checkedLength(utf8(m.key), 'a key');
    const props = propsBytes(m.properties);
    sizes[i] = keyBytes | (props << 16);
    total += RECORD_HEAD_BYTES + keyBytes + props + m.body.length;
  }
  return { sizes, total };
}

// Writes the records into `out` from `pos`; returns where they end.
function writeRecords(messages, sizes, out, pos) {
  for (let i = 0; i < messages.length; i++) {
    const m = messages[i];
    const keyBytes = sizes[i] & U16_MAX;
    const props = sizes[i] >>> 16;
    out.writeUInt32LE(4 + keyBytes + props + m.body.length, pos);
    out.writeUInt16LE(keyBytes, pos + 4);
    out.writeUInt16LE(props, pos + 6);
    pos += RECORD_HEAD_BYTES;
    if (keyBytes) pos += out.write(m.key, pos, 'utf8');
    if (props) {
      for (const name of Object.keys(m.properties)) {
        const value = String(m.properties[name]);
        out.writeUInt16LE(utf8(name), pos);
        pos += 2 + out.write(name, pos + 2, 'utf8');
        out.writeUInt16LE(utf8(value), pos);
        pos += 2 + out.write(value, pos + 2, 'utf8');
      }
    }
    pos += m.body.copy(out, pos);
  }
  return pos;
}

// messages: [{ key?: string, body: Buffer, properties?: {name: value} }] of one queue. Returns
// the records in one Buffer, how many, and their CRC32C: ProduceBatch's records, record_count
// and records_crc.
function encodeRecords(messages) {
  const { sizes, total } = measure(messages);
  const out = Buffer.allocUnsafe(total);
  writeRecords(messages, sizes, out, 0);
  return { records: out, count: messages.length, crc: crc32c(out) >>> 0 };
}

// protobuf's varint (non-negative Numbers below 2^53, or BigInts below 2^64).
function varintBytes(v) {
  let n = 1;
  if (typeof v === 'bigint') for (; v >= 0x80n; v >>= 7n) n++;
  else for (; v >= 0x80; v = Math.floor(v / 128)) n++;
  return n;
}

function writeVarint(out, pos, v) {
  if (typeof v === 'bigint') {
    for (; v >= 0x80n; v >>= 7n) out[pos++] = Number(v & 0x7fn) | 0x80;
    out[pos++] = Number(v);
    return pos;
  }
  for (; v >= 0x80; v = Math.floor(v / 128)) out[pos++] = (v % 128) | 0x80;
  out[pos++] = v;
  return pos;
}

const ACKS = { ACK_LEADER: 1, ACK_FLUSH: 2, ACK_REPLICA: 3 };

// A whole SendRequest on the wire, written in one Buffer with each batch's records encoded in
// place (no copy of them through protobufjs): hand it to gRPC with an identity serializer
// (bench.js's sendWire). batches: [{ topic, queue_id, producer_id (BigInt, 0n: not idempotent),
// base_sequence (-1: not idempotent), messages }]; ack: 'ACK_FLUSH' and so on. `into`: a Buffer to
// write in when it is large enough (the answer is then a view of it), else a new one is made.
function encodeSendRequest(batchesOfQueues, ack = 'ACK_REPLICA', timeoutMs = 0, into = null) {
  if (!ACKS[ack]) throw new RangeError(`ack must be one of ${Object.keys(ACKS).join(', ')}`);
  const plans = batchesOfQueues.map((b) => {
    const { sizes, total } = measure(b.messages);
    const topicBytes = utf8(b.topic);
    const sequence = b.base_sequence < 0 ? 0xffffffffffffffffn : BigInt(b.base_sequence); // int64 -1: ten bytes
    const fields = 1 + varintBytes(topicBytes) + topicBytes + 1 + varintBytes(b.queue_id)
      + (b.producer_id ? 1 + varintBytes(BigInt(b.producer_id)) : 0) + (sequence ? 1 + varintBytes(sequence) : 0)
      + 1 + varintBytes(b.messages.length) + 1 + 5 + 1 + varintBytes(total) + total;
    return { b, sizes, total, topicBytes, sequence, fields };
  });
  let size = 2 + (timeoutMs ? 1 + varintBytes(timeoutMs) : 0);
  for (const p of plans) size += 1 + varintBytes(p.fields) + p.fields;
  const out = into && into.length >= size ? into.subarray(0, size) : Buffer.allocUnsafe(size);
  let pos = 0;
  for (const { b, sizes, total, topicBytes, sequence, fields } of plans) {
    out[pos++] = 0x0a; // SendRequest.batches = 1
    pos = writeVarint(out, pos, fields);
    out[pos++] = 0x0a; // ProduceBatch.topic = 1
    pos = writeVarint(out, pos, topicBytes);
    pos += out.write(b.topic, pos, 'utf8');
    out[pos++] = 0x10; // queue_id = 2
    pos = writeVarint(out, pos, b.queue_id);
    if (b.producer_id) {
      out[pos++] = 0x18; // producer_id = 3
      pos = writeVarint(out, pos, BigInt(b.producer_id));
    }
    if (sequence) {
      out[pos++] = 0x20; // base_sequence = 4
      pos = writeVarint(out, pos, sequence);
    }
    out[pos++] = 0x28; // record_count = 5
    pos = writeVarint(out, pos, b.messages.length);
    const crcAt = pos; // records_crc = 6: written once the records are, as a fixed five-byte varint
    pos += 6;
    out[pos++] = 0x3a; // records = 7
    pos = writeVarint(out, pos, total);
    const end = writeRecords(b.messages, sizes, out, pos);
    const crc = crc32c(out.subarray(pos, end)) >>> 0;
    out[crcAt] = 0x30;
    for (let k = 0, v = crc; k < 5; k++, v = Math.floor(v / 128)) out[crcAt + 1 + k] = (v % 128) | (k < 4 ? 0x80 : 0);
    pos = end;
  }
  out[pos++] = 0x10; // SendRequest.ack = 2
  out[pos++] = ACKS[ack];
  if (timeoutMs) {
    out[pos++] = 0x18; // timeout_ms = 3
    pos = writeVarint(out, pos, timeoutMs);
  }
  return out;
}

// The queue a keyed message goes to: crc32c(key) % queues, as the server and the Python client
// pick it (a keyless message may go to any queue). A key is short: hashed in JavaScript, its
// string read as UTF-8 in place, which costs a tenth of a call into the native library.
function queueFor(key, queues) {
  return (CRC32C.str(key) >>> 0) % queues;
}

function u64(buf, at) {
  return buf.readUInt32LE(at) + buf.readUInt32LE(at + 4) * 0x100000000; // exact below 2^53
}

// Calls visit(buf, recordAt, keyBytes, propsBytes, bodyEnd, batchAt, index) for `count` records
// after the first `skip` of the first batch, in one pass over the runs of batches.
function walk(runs, skip, count, visit) {
  let remaining = count;
  for (const buf of runs) {
    let at = 0;
    while (at + BATCH_HEADER_BYTES <= buf.length && remaining > 0) {
      const batchBytes = buf.readUInt32LE(at);
      const end = at + batchBytes;
      let pos = at + BATCH_HEADER_BYTES + buf[at + 58];
      for (let i = 0; pos < end && remaining > 0; i++) {
        const size = buf.readUInt32LE(pos);
        if (i >= skip) {
          visit(buf, pos, buf.readUInt16LE(pos + 4), buf.readUInt16LE(pos + 6), pos + 4 + size, at, i);
          remaining--;
        }
        pos += 4 + size;
      }
      skip = 0;
      at = end;
    }
  }
}

// The bodies of `count` records after the first `skip` (PullResponse's skip_first and count):
// views of the response's bytes, no copies.
function bodies(runs, skip, count) {
  const out = [];
  walk(runs, skip, count, (buf, pos, kl, pl, end) => out.push(buf.subarray(pos + RECORD_HEAD_BYTES + kl + pl, end)));
  return out;
}

function properties(buf, from, to) {
  const props = {};
  let pos = from;
  while (pos + 2 <= to) {
    const nl = buf.readUInt16LE(pos);
    if (pos + 4 + nl > to) break; // a property cut short (an old log): left out, as every reader does
    const name = buf.toString('utf8', pos + 2, pos + 2 + nl);
    const vl = buf.readUInt16LE(pos + 2 + nl);
    if (pos + 4 + nl + vl > to) break;
    props[name] = buf.toString('utf8', pos + 4 + nl, pos + 4 + nl + vl);
    pos += 4 + nl + vl;
  }
  return props;
}

// One object per record, as PulledMessage has them (offsets as Numbers: exact below 2^53).
function decode(runs, skip, count) {
  const out = [];
  walk(runs, skip, count, (buf, pos, kl, pl, end, batchAt, i) => {
    const keyAt = pos + RECORD_HEAD_BYTES;
    out.push({
      queue_offset: u64(buf, batchAt + 24) + i,
      commit_offset: u64(buf, batchAt + 16) + (pos - batchAt),
      store_time_ms: u64(buf, batchAt + 32),
      key: kl ? buf.toString('utf8', keyAt, keyAt + kl) : '',
      properties: pl ? properties(buf, keyAt + kl, keyAt + kl + pl) : {},
      body: buf.subarray(keyAt + kl + pl, end),
    });
  });
  return out;
}

// Encodes every Send of one caller in one Buffer, grown when a request needs more: a large
// Buffer made per call costs more in V8's garbage collection than its encoding (a send of 1 MiB:
// 2.4 ms of collection per call with a new Buffer, 0.8 ms with this). The bytes of an encode are
// valid until the next: gRPC copies them into its frame before a call can be answered, so a caller
// that encodes its next request after the answer to the last never overwrites bytes in flight.
class SendEncoder {
  constructor() {
    this.buffer = Buffer.alloc(0);
  }

  encode(batchesOfQueues, ack = 'ACK_REPLICA', timeoutMs = 0) {
    const wire = encodeSendRequest(batchesOfQueues, ack, timeoutMs, this.buffer);
    if (wire.length > this.buffer.length) this.buffer = wire; // a new one was made: kept for the next
    return wire;
  }
}

module.exports = { encodeRecords, encodeSendRequest, SendEncoder, queueFor, bodies, decode };
