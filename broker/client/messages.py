"""What the client hands out and takes in: messages, receipts, pulled messages (decoded lazily),
and the encoding of messages into records (broker/logformat, spec docs/formats/commitlog.md)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, overload

from broker.client.local_reads import LocalPullResponse
from broker.client.pull_wire import PullResponseView
from broker.groups import receipts
from broker.logformat import batch as bf
from broker.logformat.scan import Mode, scan_bytes
from broker.logformat.timer_props import DELIVER_AT, TIMER_OFFSET, TIMER_PROPERTIES, field_number, scheduled_props, target_props
from proto import tidemark_pb2 as pb

_RECORD_HEAD = bf.RECORD_HEAD


@dataclass(slots=True)
class Message:
    """A message to send: ``body``, an optional ``key`` (it picks the queue: same key, same queue,
    in order), ``properties``, and ``deliver_at_ms`` for a timer message (delivered at that time)."""

    body: bytes
    key: str | None = None
    properties: dict[str, str] | None = None
    deliver_at_ms: int | None = None

    def __repr__(self) -> str:
        extra = "".join(f", {name}={value!r}" for name, value in (("key", self.key), ("properties", self.properties),
                                                                  ("deliver_at_ms", self.deliver_at_ms)) if value)
        return f"Message({preview(self.body)}{extra})"


PREVIEW_BYTES = 32
SHOWN_ITEMS = 3


def preview(body: bytes | memoryview) -> str:
    """A body as a repr shows it: the first ``PREVIEW_BYTES`` and the size."""
    head = bytes(body[:PREVIEW_BYTES])
    return f"{head!r}{'...' if len(body) > PREVIEW_BYTES else ''} ({len(body)} B)"


class Receipt(NamedTuple):
    """Where a sent message landed (a delayed one also names its timer record)."""

    topic: str
    queue_id: int
    queue_offset: int
    commit_offset: int
    duplicate: bool = False
    timer_offset: int | None = None
    deliver_at_ms: int | None = None
    shard: str | None = None  # a timer message in a cluster of shards: the shard whose log holds its timer


class PulledMessage:
    """One pulled record; fields decode from the batch bytes when first read."""

    __slots__ = ("_batch", "_key", "_pos", "_props", "commit_offset", "queue_id", "queue_offset",
                 "store_time_ms", "topic")

    def __init__(self, batch: bytes, pos: int, topic: str, queue_id: int, queue_offset: int,
                 commit_offset: int, store_time_ms: int) -> None:
        self._batch = batch
        self._pos = pos
        self.topic = topic
        self.queue_id = queue_id
        self.queue_offset = queue_offset
        self.commit_offset = commit_offset
        self.store_time_ms = store_time_ms

    @property
    def body(self) -> bytes:
        """The message's body (a copy of its bytes)."""
        size, kl, pl = _RECORD_HEAD.unpack_from(self._batch, self._pos)
        return bytes(self._batch[self._pos + 8 + kl + pl : self._pos + 4 + size])

    @property
    def key(self) -> str | None:
        """The key it was sent with, or None."""
        _, kl, _ = _RECORD_HEAD.unpack_from(self._batch, self._pos)
        return bytes(self._batch[self._pos + 8 : self._pos + 8 + kl]).decode(errors="replace") if kl else None

    def _all_properties(self) -> dict[str, str]:
        _, kl, pl = _RECORD_HEAD.unpack_from(self._batch, self._pos)
        start = self._pos + 8 + kl
        return bf.decode_props_lenient(self._batch[start : start + pl]) if pl else {}

    @property
    def properties(self) -> dict[str, str]:
        """The sender's properties (a timer delivery's own fields are read through their attributes)."""
        props = self._all_properties()
        for name in TIMER_PROPERTIES:
            props.pop(name, None)
        return props

    @property
    def deliver_at_ms(self) -> int | None:
        """When a timer message was due (None for an ordinary message)."""
        return field_number(self._all_properties().get(DELIVER_AT))

    @property
    def timer_offset(self) -> int | None:
        """A delivered timer message's origin: the commit offset of its scheduled record."""
        return field_number(self._all_properties().get(TIMER_OFFSET))

    def __repr__(self) -> str:
        key = f", key={self.key!r}" if self.key is not None else ""
        return f"PulledMessage({self.topic}/{self.queue_id}@{self.queue_offset}{key}, body={preview(self.body)})"


class PoppedMessage(PulledMessage):
    """A message leased by ``pop``: ack, nack or change_invisible it by its ``receipt_handle``."""

    __slots__ = ("delivery_count", "receipt_handle")

    def __init__(self, batch: bytes, pos: int, topic: str, queue_id: int, queue_offset: int, commit_offset: int,
                 store_time_ms: int, receipt_handle: str, delivery_count: int) -> None:
        super().__init__(batch, pos, topic, queue_id, queue_offset, commit_offset, store_time_ms)
        self.receipt_handle = receipt_handle
        self.delivery_count = delivery_count

    def __repr__(self) -> str:
        return (f"PoppedMessage({self.topic}/{self.queue_id}@{self.queue_offset}, delivery {self.delivery_count}, "
                f"body={preview(self.body)})")


class PullResult(Sequence[PulledMessage]):
    """The messages of one pull, decoded lazily; ``next_offset`` is where to continue.

    The response holds runs of log batches (the first and last cut to the records answered,
    docs/formats/commitlog.md); ``skip_first`` records of the first batch are before the requested
    offset (0 once cut) and ``count`` records are returned in all.
    """

    def __init__(self, response: pb.PullResponse | PullResponseView | LocalPullResponse) -> None:
        self.next_offset = response.next_offset
        self.min_offset = response.min_offset
        self.max_offset = response.max_offset
        self._count = response.count
        self._response = response
        self._index: list[tuple[bytes, int, bf.BatchHeader, int, int]] | None = None

    def _build(self) -> list[tuple[bytes, int, bf.BatchHeader, int, int]]:
        """One entry per returned record: (blob, record position, header, index in batch, batch start)."""
        self._index = self._walk(bodies=False)
        return self._index

    def _walk(self, *, bodies: bool) -> list[Any]:
        return _walk(self._response.batches, self._response.skip_first, self._count, bodies=bodies)

    def __repr__(self) -> str:
        shown = [f"{m.topic}/{m.queue_id}@{m.queue_offset}" for m in self[:SHOWN_ITEMS]]
        more = ", ..." if self._count > SHOWN_ITEMS else ""
        return (f"PullResult({self._count} messages [{', '.join(shown)}{more}], next_offset={self.next_offset}, "
                f"min_offset={self.min_offset}, max_offset={self.max_offset})")

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> PulledMessage: ...
    @overload
    def __getitem__(self, i: slice) -> list[PulledMessage]: ...
    def __getitem__(self, i: int | slice) -> PulledMessage | list[PulledMessage]:
        index = self._index if self._index is not None else self._build()
        if isinstance(i, slice):
            return [self._make(t) for t in index[i]]
        return self._make(index[i])

    def __iter__(self) -> Iterator[PulledMessage]:
        index = self._index if self._index is not None else self._build()
        make = self._make
        for t in index:
            yield make(t)

    @staticmethod
    def _make(t: tuple[bytes, int, bf.BatchHeader, int, int]) -> PulledMessage:
        mv, pos, h, i, start = t
        return PulledMessage(mv, pos, h.topic, h.queue_id, h.base_queue_offset + i, h.base_offset + pos - start,
                             h.store_time_ms)

    def raw_batches(self) -> tuple[list[bytes] | list[memoryview], int]:
        """The pulled log bytes (runs of batches, the first and last cut to the records answered:
        docs/formats/commitlog.md) and how many records of the first batch lie before the requested
        offset; ``len(self)`` records follow.
        For columnar readers (the Spark connector) that decode without per-record objects: views
        of the received response when ``pull_wire`` read it, else ``bytes``."""
        response = self._response
        if isinstance(response, PullResponseView):
            return response.batch_views(), response.skip_first
        return list(response.batches), response.skip_first

    def bodies(self) -> list[bytes]:
        """All bodies at once, in one pass over the batches, without per-message objects."""
        return self._walk(bodies=True)


@dataclass(frozen=True, slots=True)
class PoppedRun:
    """Adjacent messages of one queue leased by one pop: ``count`` from ``first_offset``."""

    queue_id: int
    first_offset: int
    count: int
    delivery_count: int
    receipt_handle: str  # the whole run's: ack or nack it at once


class PopResult(Sequence[PoppedMessage]):
    """The messages of one pop, decoded lazily from runs of log batches (one handle per run).

    ``ack(group, result)`` ends every lease of it with one handle a run; single messages have
    their own ``receipt_handle``; ``bodies()`` reads every body without per-message objects.
    """

    def __init__(self, topic: str, response: pb.PopResponse) -> None:
        self.topic = topic
        self._runs = list(response.runs)
        self.ack_results = list(response.ack_results)  # for the acks the pop carried (``pop(ack=...)``)
        self.ack_failures: dict[str, str] = {}  # those not acked, with why (as ``ack`` returns them)
        self._count = sum(r.count for r in self._runs)
        self._messages: list[PoppedMessage] | None = None

    @property
    def runs(self) -> list[PoppedRun]:
        """The runs of adjacent messages leased together, one receipt handle each."""
        return [PoppedRun(r.queue_id, r.first_offset, r.count, r.delivery_count, r.receipt_handle) for r in self._runs]

    def receipt_handles(self) -> list[str]:
        """One handle per run: what ``ack``/``nack`` of the whole result sends."""
        return [r.receipt_handle for r in self._runs]

    def bodies(self) -> list[bytes]:
        """All bodies, in one pass over the batches, without per-message objects."""
        out: list[bytes] = []
        for r in self._runs:
            out += _walk(r.batches, r.skip_first, r.count, bodies=True)
        return out

    def _build(self) -> list[PoppedMessage]:
        out: list[PoppedMessage] = []
        for r in self._runs:
            lease = receipts.lease_of(r.receipt_handle)
            topic = self.topic
            offset = r.first_offset
            for mv, pos, h, _, start in _walk(r.batches, r.skip_first, r.count, bodies=False):
                out.append(PoppedMessage(mv, pos, topic, r.queue_id, offset, h.base_offset + pos - start, h.store_time_ms,
                                         receipts.run_handle(lease, offset, 1, topic), r.delivery_count))
                offset += 1
        self._messages = out
        return out

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> PoppedMessage: ...
    @overload
    def __getitem__(self, i: slice) -> list[PoppedMessage]: ...
    def __getitem__(self, i: int | slice) -> PoppedMessage | list[PoppedMessage]:
        messages = self._messages if self._messages is not None else self._build()
        return messages[i]

    def __iter__(self) -> Iterator[PoppedMessage]:
        return iter(self._messages if self._messages is not None else self._build())

    def __repr__(self) -> str:
        runs = ", ".join(f"{r.queue_id}@{r.first_offset}+{r.count}" for r in self._runs[:4])
        more = ", ..." if len(self._runs) > 4 else ""
        return f"PopResult({self.topic}: {self._count} messages in {len(self._runs)} runs [{runs}{more}])"


def _batches(blobs: Iterable[bytes]) -> Iterator[tuple[bytes, int, bf.BatchHeader]]:
    """(blob, batch start, header) for every batch, header CRC checked (paired with the write)."""
    for raw in blobs:
        pos = 0
        for header, _ in scan_bytes(raw, mode=Mode.STRICT, check_offsets=False, path="pulled batches"):
            yield raw, pos, header
            pos += header.batch_bytes


def _walk(blobs: Iterable[bytes], skip: int, count: int, *, bodies: bool) -> list[Any]:
    """One pass over ``count`` records after the first ``skip``: each one's body (``bodies``) or
    its index entry (blob, record position, header, index in batch, batch start)."""
    out: list[Any] = []
    append = out.append
    unpack = _RECORD_HEAD.unpack_from
    remaining = count
    for mv, start, h in _batches(blobs):
        if remaining <= 0:
            break
        pos = start + h.records_at
        end = start + h.batch_bytes
        i = 0
        while pos < end and remaining > 0:
            size, kl, pl = unpack(mv, pos)
            if i >= skip:  # slicing bytes: one copy, no view
                append(mv[pos + 8 + kl + pl : pos + 4 + size] if bodies else (mv, pos, h, i, start))
                remaining -= 1
            pos += 4 + size
            i += 1
        skip = 0
    return out


@dataclass(slots=True)
class SendGroup:
    """The messages of one send that went to one queue (one batch)."""

    queue_id: int
    idxs: list[int]
    positions: list[int]
    base_sequence: int
    deliver: list[int] | None = None  # delayed messages: their deliver times (the batch went to __timer)
    records_at: int = 0
    base_queue_offset: int = 0
    duplicate: bool = False
    shard: str | None = None  # the shard that stored it (a cluster of shards)


class Receipts(Sequence[Receipt]):
    """The receipts of one send, in message order, each built when first read."""

    def __init__(self, topic: str, count: int, groups: list[SendGroup]) -> None:
        self._topic = topic
        self._groups = groups
        self._where: list[tuple[SendGroup, int]] | None = None  # message -> (group, index in it), made when first read
        self._single = groups[0] if len(groups) == 1 else None
        self._count = count

    def _placed(self) -> list[tuple[SendGroup, int]]:
        where: list[tuple[SendGroup, int]] = [None] * self._count  # type: ignore[list-item]
        for g in self._groups:
            for j, i in enumerate(g.idxs):
                where[i] = (g, j)
        self._where = where
        return where

    def __repr__(self) -> str:
        shown = [f"{r.queue_id}@{r.queue_offset}" if r.timer_offset is None else f"timer@{r.timer_offset}"
                 for r in self[:SHOWN_ITEMS]]
        more = ", ..." if self._count > SHOWN_ITEMS else ""
        dups = sum(1 for r in self if r.duplicate)
        return (f"Receipts({self._topic}: {self._count} messages [{', '.join(shown)}{more}]"
                f"{f', {dups} duplicates' if dups else ''})")

    def __len__(self) -> int:
        return self._count

    def _receipt(self, i: int) -> Receipt:
        if self._single is not None:
            g, j = self._single, i
        else:
            g, j = (self._where or self._placed())[i]
        if g.deliver is not None:  # stored in __timer until it fires: no queue offset in its topic yet
            offset = g.records_at + g.positions[j]
            return Receipt(self._topic, g.queue_id, -1, offset, g.duplicate, offset, g.deliver[j], g.shard)
        return Receipt(self._topic, g.queue_id, g.base_queue_offset + j, g.records_at + g.positions[j], g.duplicate)

    @overload
    def __getitem__(self, i: int) -> Receipt: ...
    @overload
    def __getitem__(self, i: slice) -> list[Receipt]: ...
    def __getitem__(self, i: int | slice) -> Receipt | list[Receipt]:
        if isinstance(i, slice):
            return [self._receipt(k) for k in range(*i.indices(self._count))]
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(i)
        return self._receipt(i)

    def __iter__(self) -> Iterator[Receipt]:
        for i in range(self._count):
            yield self._receipt(i)


def encode_messages(messages: Sequence[Message], idxs: list[int],
                    timer_target: tuple[str, int] | None = None) -> tuple[bytes, list[int]]:
    """Records of ``messages[i] for i in idxs`` and their positions (``bf.encode_records``). With
    ``timer_target`` they are scheduled records (broker/logformat/timer_props.py) for that queue."""
    if timer_target is not None:
        topic, queue_id = timer_target
        target = target_props(topic, queue_id)
        return bf.encode_records([
            (m.body, m.key.encode() if m.key else b"", scheduled_props(m.deliver_at_ms or 0, topic, queue_id, m.properties, target))
            for m in map(messages.__getitem__, idxs)
        ])
    encode_props = bf.encode_props
    return bf.encode_records([
        (m.body, m.key.encode() if m.key else b"", encode_props(m.properties) if m.properties else b"")
        for m in map(messages.__getitem__, idxs)
    ])
