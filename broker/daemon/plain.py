"""Plain messages (DESIGN §13): what a client that knows only the proto sends and reads.

``encode()`` turns ``SendRequest.messages`` into the batches our own client would have sent: one
per topic and queue (timer messages: one more per queue, for ``__timer``), records encoded with
``broker/logformat/batch.py`` and their CRC32C, so the appender checks and stores them like any
other batch. Queue choice matches the Python client: ``queue_id`` if set, else
``crc32c(key) % queues``, else one queue per call, rotating. ``receipts()`` maps the appender's
batch receipts back to one ``MessageReceipt`` per message, and ``decode()`` turns pulled batches
into ``PulledMessage``s (``PullRequest.decode``).

Each has a twin in C (``broker/logformat/_plainwire.c``) that reads the request's wire bytes and
writes the answer's, with no Python object per message: ``encode(..., wire=)``, ``receipts_wire``
and ``decode_wire``. They take the common case and leave the rest (timer messages, anything this
module would refuse) to the Python path here, which stays the reference.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import crc32c

from broker.errors import BrokerError, UnknownTopic, invalid, shown
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.logformat.timer_props import (
    DELIVER_AT,
    TARGET_QUEUE,
    TARGET_TOPIC,
    TIMER_OFFSET,
    TIMER_PROPERTIES,
    TimerRecordError,
    field_number,
    scheduled_props,
)
from broker.ports import NO_SEQUENCE, BatchReceipt, IncomingBatch
from proto import tidemark_pb2 as pb

try:
    from broker.logformat import _plainwire as native
except ImportError:  # pragma: no cover - a build without a C compiler
    native = None  # type: ignore[assignment]

_rotation = itertools.count()
# A long encode or decode in a pool thread (one at a time: rpc.common.Rpcs._heavy, which marks the
# thread with ``yielding``) gives the interpreter lock away every this many messages (~1.5 ms of
# work), so that a call on the event loop and the flusher's fsync wait behind it for that long, not
# for a 5 ms switch interval each time they run. On the event loop itself it never yields.
YIELD_EVERY = 500
_thread = threading.local()
NATIVE_YIELD_EVERY = 5000  # the C path's (~1.5 ms of its work)


@contextlib.contextmanager
def yielding() -> Iterator[None]:
    """The encodes and decodes of this block (a pool thread's heavy job) give the lock away now and then."""
    _thread.yielding = True
    try:
        yield
    finally:
        _thread.yielding = False


def _maybe_yield(done: int) -> None:
    if done % YIELD_EVERY == YIELD_EVERY - 1 and getattr(_thread, "yielding", False):
        time.sleep(0)  # let the event loop and the flusher in


@dataclass(slots=True)
class _Group:
    """The plain messages of one call that become one batch."""

    topic: str
    queue_id: int
    delayed: bool
    idxs: list[int] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Encoded:
    batches: list[IncomingBatch]
    groups: list[_Group]  # the Python path's
    positions: list[list[int]]  # per batch: each record's start within its records (the Python path's)
    layout: bytes | None = None  # the C path's: each message's batch, rank and position (receipts_wire)


def encode_native(wire: bytes, producer_id: int, queues_of: Callable[[str], int | None]) -> Encoded | None:
    """What ``encode`` makes of the plain messages of the SendRequest in ``wire``, by the C path
    (~0.4 us a message of 1 KiB against ~6 us); None when it leaves them to ``encode``."""
    if native is None:
        return None
    yield_every = NATIVE_YIELD_EVERY if getattr(_thread, "yielding", False) else 0
    done = native.encode_plain(wire, queues_of, next(_rotation), producer_id, yield_every)
    if done is None:
        return None
    groups, layout = done
    batches = [IncomingBatch(topic, queue_id, records, count, crc32c.crc32c(records), producer_id, base_sequence)
               for topic, queue_id, records, count, base_sequence in groups]
    return Encoded(batches, [], [], layout)


def encode(messages: Sequence[pb.PlainMessage], producer_id: int, queues_of: Callable[[str], int | None]) -> Encoded:
    """Batches for ``messages``; INVALID_ARGUMENT / NOT_FOUND before anything is stored."""
    groups: dict[tuple[str, int, bool], _Group] = {}
    keyless_queue: dict[str, int] = {}
    for i, m in enumerate(messages):
        _maybe_yield(i)
        if m.topic.startswith(system_records.SYSTEM_PREFIX):
            raise invalid(f"message {i}: system topic {shown(m.topic)} does not take messages")
        queues = queues_of(m.topic)
        if queues is None:
            raise UnknownTopic(m.topic, f"message {i}: unknown topic {shown(m.topic)}")
        if m.HasField("queue_id"):
            q = m.queue_id
            if q >= queues:
                raise invalid(f"message {i}: queue {q} out of range for topic {shown(m.topic)} ({queues} queues)")
        elif m.key:
            q = crc32c.crc32c(m.key.encode()) % queues
        else:
            q = keyless_queue.setdefault(m.topic, next(_rotation) % queues)
        if m.deliver_at_ms < 0:
            raise invalid(f"message {i}: deliver_at_ms {m.deliver_at_ms} is negative")
        _check_sizes(i, m)
        if producer_id and (not m.HasField("queue_id") or not m.HasField("sequence") or m.sequence < 0):
            raise invalid(f"message {i}: an idempotent send (producer_id set) names each message's queue_id "
                          "and a sequence >= 0")
        g = groups.setdefault((m.topic, q, m.deliver_at_ms > 0), _Group(m.topic, q, m.deliver_at_ms > 0))
        if producer_id:
            if g.sequences and m.sequence != g.sequences[-1] + 1:
                raise invalid(f"message {i}: sequence {m.sequence} does not follow {g.sequences[-1]} on "
                              f"{shown(m.topic)}/{q}")
            g.sequences.append(m.sequence)
        g.idxs.append(i)
    out = Encoded([], [], [])
    for g in groups.values():
        try:
            records, positions = bf.encode_records(_items(messages, g))
        except TimerRecordError as exc:
            raise invalid(str(exc)) from None
        base = g.sequences[0] if producer_id else NO_SEQUENCE
        pid = producer_id if producer_id else 0
        crc = crc32c.crc32c(records)
        if g.delayed:
            batch = IncomingBatch(system_records.TIMER_TOPIC, 0, records, len(g.idxs), crc, pid, base,
                                  timer_target=(g.topic, g.queue_id))
        else:
            batch = IncomingBatch(g.topic, g.queue_id, records, len(g.idxs), crc, pid, base)
        out.batches.append(batch)
        out.groups.append(g)
        out.positions.append(positions)
    return out


# The scheduled fields a delayed message's properties carry before the user's (timer_props):
# three names, a 19-digit time, a 255-byte topic and a queue number, with their lengths.
_SCHEDULED_PROPS_BYTES_MAX = 3 * 4 + len(DELIVER_AT) + 19 + len(TARGET_TOPIC) + bf.TOPIC_BYTES_MAX + len(TARGET_QUEUE) + 5


def _check_sizes(i: int, m: pb.PlainMessage) -> None:
    """What the record format cannot hold, or the broker reserves, as INVALID_ARGUMENT naming the
    message, before anything of the request is encoded or stored. The appender's ``check_records``
    then checks the encoded records as it checks a client's pre-encoded ones."""
    key_bytes = len(m.key.encode())
    if key_bytes > bf.KEY_BYTES_MAX:
        raise invalid(f"message {i}: its key takes {key_bytes} bytes, more than {bf.KEY_BYTES_MAX}")
    props_bytes = _SCHEDULED_PROPS_BYTES_MAX if m.deliver_at_ms > 0 else 0
    for name, value in m.properties.items():
        if name.startswith(bf.RESERVED_PREFIX):
            raise invalid(f"message {i}: property {shown(name)} has a reserved name (names starting with "
                          f"{bf.RESERVED_PREFIX} belong to the broker)")
        props_bytes += 4 + len(name.encode()) + len(value.encode())
    if props_bytes > bf.PROPS_BYTES_MAX:
        raise invalid(f"message {i}: its properties take {props_bytes} bytes encoded, more than {bf.PROPS_BYTES_MAX}")


def _items(messages: Sequence[pb.PlainMessage], g: _Group) -> Iterable[tuple[bytes, bytes, bytes]]:
    for i in g.idxs:
        m = messages[i]
        user = dict(m.properties)
        if g.delayed:
            props = scheduled_props(m.deliver_at_ms, g.topic, g.queue_id, user)
        else:
            props = bf.encode_props(user) if user else b""
        yield m.body, m.key.encode(), props


def receipts(encoded: Encoded, batch_receipts: Sequence[BatchReceipt],
             messages: Sequence[pb.PlainMessage]) -> list[pb.MessageReceipt]:
    """One receipt per plain message, in request order (``batch_receipts``: the encoded batches')."""
    out: list[pb.MessageReceipt | None] = [None] * len(messages)
    for g, positions, batch, r in zip(encoded.groups, encoded.positions, encoded.batches, batch_receipts, strict=True):
        records_at = r.commit_offset + bf.HEADER_BYTES + len(batch.topic.encode())
        for j, (i, pos) in enumerate(zip(g.idxs, positions, strict=True)):
            if g.delayed:
                offset = records_at + pos
                out[i] = pb.MessageReceipt(topic=g.topic, queue_id=g.queue_id, queue_offset=-1, commit_offset=offset,
                                           duplicate=r.duplicate, timer_offset=offset,
                                           deliver_at_ms=messages[i].deliver_at_ms)
            else:
                out[i] = pb.MessageReceipt(topic=g.topic, queue_id=g.queue_id, queue_offset=r.base_queue_offset + j,
                                           commit_offset=records_at + pos, duplicate=r.duplicate)
    return [r for r in out if r is not None]


def receipts_wire(encoded: Encoded, batch_receipts: Sequence[BatchReceipt]) -> bytes | None:
    """``SendResponse.message_receipts`` as wire bytes (the C path's ``receipts``), for a request
    the C path encoded; None for one the Python path did (``receipts``)."""
    if encoded.layout is None:
        return None
    groups = [(b.topic.encode(), b.queue_id, r.base_queue_offset,
               r.commit_offset + bf.HEADER_BYTES + len(b.topic.encode()), r.duplicate)
              for b, r in zip(encoded.batches, batch_receipts, strict=True)]
    return native.receipts(encoded.layout, groups)


def decode_wire(batches: list[bytes], skip_first: int, count: int, head: bytes = b"") -> bytes | None:
    """``head`` then ``PullResponse.messages`` as wire bytes for what ``decode`` would answer (the
    C path's ``decode_pulled``); None when that is left to ``decode``."""
    if native is None:
        return None
    return native.decode_pulled(batches, skip_first, count, head)


def decode(batches: Iterable[bytes], skip_first: int, count: int) -> list[pb.PulledMessage]:
    """The ``count`` records after the first ``skip_first`` of ``batches`` (runs of whole batches)."""
    out: list[pb.PulledMessage] = []
    skip = skip_first
    for blob in batches:
        mv = memoryview(blob)
        pos = 0
        while pos < len(mv) and len(out) < count:
            header = bf.decode_header(mv, pos, check_crc=False)
            batch = mv[pos : pos + header.batch_bytes]
            qoff = header.base_queue_offset
            for rpos, key, props_raw, body in bf.iter_records(batch, header):
                if len(out) == count:
                    break  # the rest of the batch is not asked for
                if skip > 0:
                    skip -= 1
                else:
                    _maybe_yield(len(out))
                    props = bf.decode_props_lenient(props_raw) if len(props_raw) else {}
                    deliver_at = field_number(props.get(DELIVER_AT))
                    timer_offset = field_number(props.get(TIMER_OFFSET))
                    for name in TIMER_PROPERTIES:
                        props.pop(name, None)
                    m = pb.PulledMessage(
                        queue_offset=qoff, commit_offset=header.base_offset + rpos, store_time_ms=header.store_time_ms,
                        key=bytes(key).decode(errors="replace"), body=bytes(body),
                        deliver_at_ms=deliver_at or 0, timer_offset=timer_offset or 0)
                    if props:  # a map field set from a dict is a Python loop even when it is empty
                        m.properties.update(props)
                    out.append(m)
                qoff += 1
            pos += header.batch_bytes
    return out


class _Run(Protocol):
    """What ``decode_popped`` reads of a leased run (``PoppedRun``, ``groups.pops.LeasedRun``)."""

    @property
    def batches(self) -> Sequence[bytes]: ...
    @property
    def skip_first(self) -> int: ...
    @property
    def count(self) -> int: ...


def decode_popped(runs: Sequence[_Run], messages: Sequence[pb.PoppedMessage]) -> list[pb.PoppedMessage]:
    """``messages`` (one per message of ``runs``, in order) with key, body, properties and timer
    fields in place of their encoded records (PopRequest.decode)."""
    out: list[pb.PoppedMessage] = []
    it = iter(messages)
    for run in runs:
        for d in decode(run.batches, run.skip_first, run.count):
            m = next(it)
            if m.queue_offset != d.queue_offset:
                raise BrokerError("INTERNAL", f"popped message {m.queue_offset} decoded as {d.queue_offset}")
            out.append(pb.PoppedMessage(
                queue_id=m.queue_id, queue_offset=m.queue_offset, commit_offset=m.commit_offset,
                store_time_ms=m.store_time_ms, receipt_handle=m.receipt_handle, delivery_count=m.delivery_count,
                key=d.key, body=d.body, properties=d.properties, deliver_at_ms=d.deliver_at_ms,
                timer_offset=d.timer_offset))
    return out
