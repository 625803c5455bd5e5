"""Records of the ``__timer`` system topic and timer deliveries (docs/formats/timer-records.md).

Every timer fact is a record in the commit log, told apart by the *first* property's name:

- scheduled (sent by a client): ``__deliver_at_ms``, ``__topic``, ``__queue``, then the user's
  properties; key and body are the user's. A batch of them holds one target (topic, queue).
- event (written by the master): ``__event`` = ``fired`` | ``cancelled`` | ``dropped``, then
  ``__timer_offset``, ``__deliver_at_ms``, ``__topic``, ``__queue``; no key, no body.
- delivery (in the real topic; its batch header has ``FLAG_TIMER_DELIVERY``): ``__timer_offset``
  first, then the scheduled record's properties, key and body unchanged. It is the authoritative
  fire marker.

``timer_offset`` is the commit offset of the scheduled record itself (batch offset + record
position), so it names one timer uniquely and is known to the client from its receipt.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Mapping

from broker.logformat import batch as bf

TIMER_TOPIC = "__timer"
DELIVER_AT = "__deliver_at_ms"
TARGET_TOPIC = "__topic"
TARGET_QUEUE = "__queue"
EVENT = "__event"
TIMER_OFFSET = "__timer_offset"
FIRED = "fired"
CANCELLED = "cancelled"
DROPPED = "dropped"  # its topic was deleted before it fired: nothing was delivered
FORWARDED = "forwarded"  # its queue had moved to another shard: delivered there (docs/shards.md)
TIMER_PROPERTIES = (DELIVER_AT, TARGET_TOPIC, TARGET_QUEUE, TIMER_OFFSET)  # reserved in a timer message
SCHEDULED_LEADING_PROPS = 3  # a scheduled record's timer fields, before the user's properties

_U16 = struct.Struct("<H")
_DELIVER_AT_NAME = _U16.pack(len(DELIVER_AT)) + DELIVER_AT.encode()
_EVENT_NAME = _U16.pack(len(EVENT)) + EVENT.encode()
_OFFSET_NAME = _U16.pack(len(TIMER_OFFSET)) + TIMER_OFFSET.encode()
_TOPIC_NAME = _U16.pack(len(TARGET_TOPIC)) + TARGET_TOPIC.encode()
_QUEUE_NAME = _U16.pack(len(TARGET_QUEUE)) + TARGET_QUEUE.encode()
_DIGITS_MAX = 19


def field_number(value: str | None) -> int | None:
    """A timer field read back (``__deliver_at_ms``, ``__timer_offset``): its number, or None when
    absent or not 1-19 ASCII digits. Readers never fail on what a log holds (a record stored before
    the send path reserved ``__`` names could carry anything there)."""
    if value is None or not 1 <= len(value) <= _DIGITS_MAX or not value.isascii() or not value.isdigit():
        return None
    return int(value)


class TimerRecordError(ValueError):
    """A record of a delayed batch is not a valid scheduled record; the message says which."""


def scheduled_props(deliver_at_ms: int, topic: str, queue_id: int, user: Mapping[str, str] | None,
                    target: bytes | None = None) -> bytes:
    """Properties of a scheduled record: the timer fields first, then the user's (the bytes
    ``encode_props`` would make). ``target``: ``target_props(topic, queue_id)``, if the caller
    encodes many records for one queue."""
    if user:
        for name in user:
            if name in TIMER_PROPERTIES or name == EVENT:
                raise TimerRecordError(f"property {name[:200]!r} is reserved for timer messages")
    a = b"%d" % deliver_at_ms
    tail = bf.encode_props(user) if user else b""
    return b"".join((_DELIVER_AT_NAME, _U16.pack(len(a)), a, target or target_props(topic, queue_id), tail))


def _leading_value(buf: bytes | memoryview, at: int, name: bytes) -> tuple[bytes, int] | None:
    """The value of the property at ``at`` if it is named ``name``, and where the next one starts."""
    if bytes(buf[at : at + len(name)]) != name:
        return None
    vat = at + len(name)
    (vlen,) = _U16.unpack_from(buf, vat)
    return bytes(buf[vat + 2 : vat + 2 + vlen]), vat + 2 + vlen


def check_scheduled_batch(records: bytes | memoryview, record_count: int, topic: str, queue_id: int,
                          now_ms: int, max_delay_ms: int) -> None:
    """``check_scheduled`` for a batch whose framing is already checked: in C when built
    (``_framing.scheduled_ok``), which accepts only what ``check_scheduled`` accepts; anything
    else runs ``check_scheduled`` itself for its verdict and message."""
    latest = now_ms + max_delay_ms
    if (bf.native is not None and 0 <= latest < 1 << 63
            and bf.native.scheduled_ok(records, _DELIVER_AT_NAME, target_props(topic, queue_id), latest)):
        return
    check_scheduled(records, bf.record_positions(records, record_count), topic, queue_id, now_ms, max_delay_ms)


def check_scheduled(records: bytes | memoryview, positions: list[int], topic: str, queue_id: int,
                    now_ms: int, max_delay_ms: int) -> None:
    """Every record of a delayed batch is a scheduled record naming the batch's target.

    Raises TimerRecordError naming the record at fault. Times already due are allowed (they fire
    at once: the client sends what it knows to be due straight to the topic).
    """
    buf = bytes(records)
    unpack = bf.RECORD_HEAD.unpack_from
    target = bf.encode_props({TARGET_TOPIC: topic, TARGET_QUEUE: str(queue_id)})  # must follow __deliver_at_ms
    name = _DELIVER_AT_NAME
    name_len = len(name)
    latest = now_ms + max_delay_ms
    for i, pos in enumerate(positions):
        _, key_len, props_len = unpack(buf, pos)
        p0 = pos + bf.RECORD_HEAD_BYTES + key_len
        end = p0 + props_len
        if props_len < name_len + 2 or buf[p0 : p0 + name_len] != name:
            raise TimerRecordError(f"record {i}: the first property must be {DELIVER_AT}")
        vat = p0 + name_len
        (vlen,) = _U16.unpack_from(buf, vat)
        raw = buf[vat + 2 : vat + 2 + vlen]
        if not raw.isdigit() or len(raw) > _DIGITS_MAX or vat + 2 + vlen > end:
            raise TimerRecordError(f"record {i}: {DELIVER_AT} {raw!r} is not a non-negative integer")
        tat = vat + 2 + vlen
        if buf[tat : tat + len(target)] != target or tat + len(target) > end:
            raise TimerRecordError(f"record {i}: {TARGET_TOPIC}/{TARGET_QUEUE} must follow {DELIVER_AT} and name "
                                   f"the batch's target {topic}/{queue_id}")
        at = int(raw)
        if at > latest:
            raise TimerRecordError(f"record {i}: deliver_at_ms {at} is more than timer.max_delay_ms "
                                   f"({max_delay_ms}) ahead of the broker's clock ({now_ms})")


def deliver_times(batch: memoryview, header: bf.BatchHeader) -> tuple[list[int], list[int]]:
    """(record positions relative to the batch, deliver times) of a batch of scheduled records."""
    return _leading_ints(batch, header, _DELIVER_AT_NAME, skip=0)


def _leading_ints(batch: memoryview, header: bf.BatchHeader, name: bytes, skip: int) -> tuple[list[int], list[int]]:
    """(record positions, integer value) of property ``name`` found after ``skip`` properties in
    every record of a batch, parsed inline: this runs for every timer scheduled and fired. In C
    when built (``_framing.leading_ints``); it defers here for anything the log's writers do not make."""
    if bf.native is not None:
        found = bf.native.leading_ints(batch, header.records_at, header.batch_bytes, name, skip, header.record_count)
        if found is not None:
            return found
    buf = bytes(batch)
    unpack = bf.RECORD_HEAD.unpack_from
    u16 = _U16.unpack_from
    n = len(name)
    positions: list[int] = []
    values: list[int] = []
    pos = header.records_at
    end = header.batch_bytes
    while pos < end:
        size, key_len, _ = unpack(buf, pos)
        p = pos + bf.RECORD_HEAD_BYTES + key_len
        for _ in range(skip):  # a property: u16 name length, name, u16 value length, value
            p += 2 + u16(buf, p)[0]
            p += 2 + u16(buf, p)[0]
        if buf[p : p + n] != name:
            raise ValueError(f"timer record at {header.base_offset + pos} lacks {name[2:].decode()} where expected")
        (vlen,) = u16(buf, p + n)
        positions.append(pos)
        values.append(int(buf[p + n + 2 : p + n + 2 + vlen]))
        pos += 4 + size
    return positions, values


def is_event_batch(batch: memoryview, header: bf.BatchHeader) -> bool:
    """Whether a ``__timer`` batch holds events (the master's) rather than scheduled records."""
    first = next(bf.iter_records(batch, header))
    return bytes(first[2][: len(_EVENT_NAME)]) == _EVENT_NAME


def _prop(name: str, value: str) -> bytes:
    n = name.encode()
    v = value.encode()
    return _U16.pack(len(n)) + n + _U16.pack(len(v)) + v


_EVENT_PREFIX = {kind: _prop(EVENT, kind) for kind in (FIRED, CANCELLED, DROPPED, FORWARDED)}


def forwarded_timer_producer(source_shard: str, timer_offset: int) -> int:
    """The producer id a forwarded timer is stored with on its queue's new shard (sequence 0): one
    per timer, from the shard whose log holds it and its offset there, so a retried forward is a
    duplicate (the producer table remembers it; docs/shards.md "Moving a queue")."""
    digest = hashlib.blake2b(f"{source_shard}/{timer_offset}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") & ((1 << 63) - 1)) or 1


def target_props(topic: str, queue_id: int) -> bytes:
    """The ``__topic``, ``__queue`` properties that end every event of one target."""
    return _prop(TARGET_TOPIC, topic) + _prop(TARGET_QUEUE, str(queue_id))


def event_props(event: str, timer_offset: int, deliver_at_ms: int, target: bytes) -> bytes:
    """An event's properties: ``__event``, ``__timer_offset``, ``__deliver_at_ms``, then ``target``
    (``target_props``); the bytes ``encode_props`` would make, built without a dict."""
    o = b"%d" % timer_offset
    a = b"%d" % deliver_at_ms
    return b"".join((_EVENT_PREFIX[event], _OFFSET_NAME, _U16.pack(len(o)), o, _DELIVER_AT_NAME, _U16.pack(len(a)), a, target))


def iter_events(batch: memoryview, header: bf.BatchHeader) -> Iterator[dict[str, str]]:
    for _, _, props, _ in bf.iter_records(batch, header):
        yield bf.decode_props(props)


def leading_offsets(batch: memoryview, header: bf.BatchHeader, skip_first: bool) -> list[int]:
    """The ``__timer_offset`` of every record of a delivery batch (its first property) or, with
    ``skip_first``, of a ``fired`` event batch (its second)."""
    return _leading_ints(batch, header, _OFFSET_NAME, skip=1 if skip_first else 0)[1]


def event_refs(batch: memoryview, header: bf.BatchHeader) -> list[tuple[str, int, str]]:
    """(event, timer_offset, target topic) of every record of an event batch, parsed in order
    without decoding whole property maps (events are written only by the master, in this order)."""
    out: list[tuple[str, int, str]] = []
    for _, _, props, _ in bf.iter_records(batch, header):
        kind, at = _leading_value(props, 0, _EVENT_NAME) or (b"", 0)
        off, at = _leading_value(props, at, _OFFSET_NAME) or (b"", 0)
        _, at = _leading_value(props, at, _DELIVER_AT_NAME) or (b"", 0)
        topic, _ = _leading_value(props, at, _TOPIC_NAME) or (b"", 0)
        if not kind or not off:
            raise ValueError(f"malformed timer event in the batch at {header.base_offset}")
        out.append((kind.decode(), int(off), topic.decode()))
    return out


def delivery_props(timer_offset: int, scheduled: bytes | memoryview) -> bytes:
    """A delivery's properties: ``__timer_offset`` first, then the scheduled record's, unchanged."""
    o = b"%d" % timer_offset
    return b"".join((_OFFSET_NAME, _U16.pack(len(o)), o, scheduled))


def target_of_scheduled(props: bytes) -> bytes:
    """The bytes after a scheduled record's ``__deliver_at_ms`` (its target, then the user's
    properties): a cheap cache key for the target."""
    n = len(_DELIVER_AT_NAME)
    (vlen,) = _U16.unpack_from(props, n)
    return props[n + 2 + vlen :]


def scheduled_target(props: bytes | memoryview) -> tuple[int, str, int]:
    """(deliver_at_ms, topic, queue) from a scheduled record's properties (its first three)."""
    at, nxt = _leading_value(props, 0, _DELIVER_AT_NAME) or (b"", 0)
    topic, nxt = _leading_value(props, nxt, _TOPIC_NAME) or (b"", 0)
    queue, _ = _leading_value(props, nxt, _QUEUE_NAME) or (b"", 0)
    if not at or not queue:
        raise ValueError("not a scheduled record's properties")
    return int(at), topic.decode(), int(queue)
