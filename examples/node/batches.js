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
// the topic, the records; PullResponse.batches holds runs of batches back to back, the first and
// last cut by the server to the records answered (docs/formats/commitlog.md, "Cut batches").
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
const U32_MAX = 0xffffffff;
const SEQUENCE_MAX = 0x7fffffff;
const U64_MAX = 0xffffffffffffffffn;

function checkInteger(v, low, high, what) {
  const ok = typeof v === 'bigint' ? v >= BigInt(low) && v <= BigInt(high) : Number.isSafeInteger(v) && v >= low && v <= high;
  if (!ok) throw new RangeError(`${what} must be an integer from ${low} to ${high}, got ${v}`);
}

// What the server would refuse (or read otherwise), refused here with the reason: a batch's
// numbers in range, at least one message, each a Buffer body with string properties.
function checkBatch(b) {
  if (typeof b.topic !== 'string' || !b.topic) throw new TypeError('a batch needs its topic');
  checkInteger(b.queue_id, 0, U32_MAX, 'queue_id');
  checkInteger(b.producer_id === undefined ? 0 : b.producer_id, 0, U64_MAX, 'producer_id');
  checkInteger(b.base_sequence === undefined ? -1 : b.base_sequence, -1, SEQUENCE_MAX, 'base_sequence');
  if (!Array.isArray(b.messages) || b.messages.length === 0) throw new RangeError('a batch needs at least one message');
  for (const m of b.messages) {
    if (!Buffer.isBuffer(m.body)) throw new TypeError('a message body must be a Buffer');
    if (m.key !== undefined && m.key !== null && typeof m.key !== 'string') throw new TypeError('a key must be a string');
    const props = m.properties;
    if (props === undefined || props === null) continue;
    if (Object.getPrototypeOf(props) !== Object.prototype) throw new TypeError('properties must be a plain object');
    for (const value of Object.values(props)) {
      if (typeof value !== 'string') throw new TypeError('a property value must be a string');
    }
  }
}

// A whole SendRequest on the wire, written in one Buffer with each batch's records encoded in
// place (no copy of them through protobufjs): hand it to gRPC with an identity serializer
// (bench.js's sendWire). batches: [{ topic, queue_id, producer_id (BigInt or Number; 0 or absent:
// not idempotent), base_sequence (-1 or absent: not idempotent), messages }] with messages as
// encodeRecords takes them; ack: 'ACK_FLUSH' and so on. `into`: a Buffer to write in when it is
// large enough (the answer is then a view of it), else a new one is made. Anything the server
// would refuse (a number out of range, an empty batch, a body that is not a Buffer) throws here.
function encodeSendRequest(batchesOfQueues, ack = 'ACK_REPLICA', timeoutMs = 0, into = null) {
  if (!Object.hasOwn(ACKS, ack)) throw new RangeError(`ack must be one of ${Object.keys(ACKS).join(', ')}`);
  checkInteger(timeoutMs, 0, U32_MAX, 'timeoutMs');
  batchesOfQueues.forEach(checkBatch);
  const plans = batchesOfQueues.map((b) => {
    const { sizes, total } = measure(b.messages);
    const topicBytes = utf8(b.topic);
    const base = b.base_sequence === undefined ? -1 : b.base_sequence;
    const sequence = base < 0 ? U64_MAX : BigInt(base); // int64 -1: ten bytes
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
// A key with a lone surrogate is stored as U+FFFD (Buffer's UTF-8): hashed as those bytes.
const LONE_SURROGATE = /[\uD800-\uDFFF]/;
function queueFor(key, queues) {
  const crc = LONE_SURROGATE.test(key) && !key.isWellFormed() ? crc32c(Buffer.from(key, 'utf8')) : CRC32C.str(key);
  return (crc >>> 0) % queues;
}

function u64(buf, at) {
  return buf.readUInt32LE(at) + buf.readUInt32LE(at + 4) * 0x100000000; // exact below 2^53
}

function cut(what) {
  return new RangeError(`pulled batches truncated or bent: ${what}`);
}

// Calls visit(buf, recordAt, keyBytes, propsBytes, bodyEnd, batchAt, index) for `count` records
// after the first `skip` of the first batch, in one pass over the runs of batches. Throws on
// framing that does not hold (a batch or record running past its bytes, a run not ending on a
// batch), as the Python client's walk does.
function walk(runs, skip, count, visit) {
  let remaining = count;
  for (const buf of runs) {
    let at = 0;
    while (at < buf.length && remaining > 0) {
      if (at + BATCH_HEADER_BYTES > buf.length) throw cut(`a batch header at ${at} of ${buf.length} bytes`);
      const batchBytes = buf.readUInt32LE(at);
      const end = at + batchBytes;
      let pos = at + BATCH_HEADER_BYTES + buf[at + 58];
      if (pos > end || end > buf.length) throw cut(`a batch of ${batchBytes} bytes at ${at} of ${buf.length}`);
      for (let i = 0; pos < end && remaining > 0; i++) {
        if (pos + RECORD_HEAD_BYTES > end) throw cut(`a record head at ${pos} past its batch's end ${end}`);
        const size = buf.readUInt32LE(pos);
        const kl = buf.readUInt16LE(pos + 4);
        const pl = buf.readUInt16LE(pos + 6);
        if (pos + 4 + size > end || 4 + kl + pl > size) throw cut(`a record of ${size} bytes at ${pos}`);
        if (i >= skip) {
          visit(buf, pos, kl, pl, pos + 4 + size, at, i);
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

// A fired timer message's fields: read into their own fields, the four left out of properties
// (docs/formats/timer-records.md), as the server's decode does.
const TIMER_PROPERTIES = ['__deliver_at_ms', '__timer_offset', '__topic', '__queue'];

// A timer field's number: 1-19 ASCII digits, else 0 (absent), as every reader takes it.
function fieldNumber(text) {
  return text !== undefined && /^[0-9]{1,19}$/.test(text) ? Number(text) : 0;
}

// One object per record, as PulledMessage has them (offsets as Numbers: exact below 2^53).
function decode(runs, skip, count) {
  const out = [];
  walk(runs, skip, count, (buf, pos, kl, pl, end, batchAt, i) => {
    const keyAt = pos + RECORD_HEAD_BYTES;
    const props = pl ? properties(buf, keyAt + kl, keyAt + kl + pl) : {};
    const deliverAt = fieldNumber(props.__deliver_at_ms);
    const timerOffset = fieldNumber(props.__timer_offset);
    for (const name of TIMER_PROPERTIES) delete props[name];
    out.push({
      queue_offset: u64(buf, batchAt + 24) + i,
      commit_offset: u64(buf, batchAt + 16) + (pos - batchAt),
      store_time_ms: u64(buf, batchAt + 32),
      key: kl ? buf.toString('utf8', keyAt, keyAt + kl) : '',
      properties: props,
      body: buf.subarray(keyAt + kl + pl, end),
      deliver_at_ms: deliverAt,
      timer_offset: timerOffset,
    });
  });
  return out;
}

// Encodes the Sends of one caller in one Buffer, kept from call to call: a large Buffer made per
// call costs more in V8's garbage collection than its encoding (a send of 1 MiB: 2.4 ms of
// collection per call with a new Buffer, 0.8 ms with this). grpc-js copies a request into its
// frame only later, on a microtask (or once its channel is ready), so the bytes of an encode are
// the call's until the call is answered: `done(wire)` says so, and only then does an encode write
// in the same Buffer again. An encode before that (two calls in flight) gets a Buffer of its own:
// forgetting `done` costs the reuse, never a request's bytes.
class SendEncoder {
  constructor() {
    this.buffer = Buffer.alloc(0);
    this.lent = null; // the bytes of the encoder's Buffer a call still holds
  }

  encode(batchesOfQueues, ack = 'ACK_REPLICA', timeoutMs = 0) {
    if (this.lent !== null) return encodeSendRequest(batchesOfQueues, ack, timeoutMs);
    const wire = encodeSendRequest(batchesOfQueues, ack, timeoutMs, this.buffer);
    if (wire.length > this.buffer.length) this.buffer = wire; // too small, so a new one was made: kept
    this.lent = wire;
    return wire;
  }

  // The call that sent `wire` was answered (or failed): its bytes may be written over.
  done(wire) {
    if (wire === this.lent) this.lent = null;
  }
}

module.exports = { encodeRecords, encodeSendRequest, SendEncoder, queueFor, bodies, decode };
