"""Python client: ``from broker.client import BrokerClient, Message``.

Sends are batched per queue and encoded once; each batch carries this client's random producer
id and a per-queue sequence, so a retried request (transient failure) lands exactly once.
Pulled batches decode lazily: ``pull()`` returns a sequence whose items are built on access.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

import crc32c
import grpc

from broker import alloc
from broker.logformat import batch as bf
from broker.logformat.scan import Mode, scan_bytes
from broker.logformat.timer_props import DELIVER_AT, TIMER_OFFSET, TIMER_PROPERTIES, TIMER_TOPIC, scheduled_props, target_props
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

ACKS = {"replica": pb.ACK_REPLICA, "leader": pb.ACK_LEADER, "flush": pb.ACK_FLUSH}
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# For Send the request is idempotent (producer id + sequences), so an unknown outcome is retried too.
SEND_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
SEQUENCE_MAX = 0x7FFFFFFF - (1 << 24)  # a new producer id before the 31-bit sequence runs out
RETRIES_MAX = 5
REQUEST_BYTES_TARGET = 8 << 20
MESSAGE_BYTES_MAX = 256 << 20
_RECORD_HEAD = bf.RECORD_HEAD


@dataclass(slots=True)
class Message:
    body: bytes
    key: str | None = None
    properties: dict[str, str] | None = None
    deliver_at_ms: int | None = None


class Receipt(NamedTuple):
    """Where a sent message landed (a delayed one also names its timer record)."""

    topic: str
    queue_id: int
    queue_offset: int
    commit_offset: int
    duplicate: bool = False
    timer_offset: int | None = None
    deliver_at_ms: int | None = None


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
        size, kl, pl = _RECORD_HEAD.unpack_from(self._batch, self._pos)
        return bytes(self._batch[self._pos + 8 + kl + pl : self._pos + 4 + size])

    @property
    def key(self) -> str | None:
        _, kl, _ = _RECORD_HEAD.unpack_from(self._batch, self._pos)
        return bytes(self._batch[self._pos + 8 : self._pos + 8 + kl]).decode() if kl else None

    def _all_properties(self) -> dict[str, str]:
        _, kl, pl = _RECORD_HEAD.unpack_from(self._batch, self._pos)
        start = self._pos + 8 + kl
        return bf.decode_props(self._batch[start : start + pl]) if pl else {}

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
        value = self._all_properties().get(DELIVER_AT)
        return int(value) if value is not None else None

    @property
    def timer_offset(self) -> int | None:
        """A delivered timer message's origin: the commit offset of its scheduled record."""
        value = self._all_properties().get(TIMER_OFFSET)
        return int(value) if value is not None else None

    def __repr__(self) -> str:
        return f"PulledMessage({self.topic}/{self.queue_id}@{self.queue_offset})"


class PullResult(Sequence[PulledMessage]):
    """The messages of one pull, decoded lazily; ``next_offset`` is where to continue.

    The response holds runs of whole log batches; ``skip_first`` records of the first batch are
    before the requested offset and ``count`` records are returned in all.
    """

    def __init__(self, response: pb.PullResponse) -> None:
        self.next_offset = response.next_offset
        self.min_offset = response.min_offset
        self.max_offset = response.max_offset
        self._count = response.count
        self._response = response
        self._index: list[tuple[bytes, int, bf.BatchHeader, int, int]] | None = None

    def _batches(self) -> Iterator[tuple[bytes, int, bf.BatchHeader]]:
        """(blob, batch start, header) for every batch, header CRC checked (paired with the write)."""
        for raw in self._response.batches:
            pos = 0
            for header, _ in scan_bytes(raw, mode=Mode.STRICT, check_offsets=False, path="pulled batches"):
                yield raw, pos, header
                pos += header.batch_bytes

    def _build(self) -> list[tuple[bytes, int, bf.BatchHeader, int, int]]:
        """One entry per returned record: (blob, record position, header, index in batch, batch start)."""
        index: list[tuple[bytes, int, bf.BatchHeader, int, int]] = []
        append = index.append
        unpack = _RECORD_HEAD.unpack_from
        skip = self._response.skip_first
        remaining = self._count
        for mv, start, h in self._batches():
            if remaining <= 0:
                break
            pos = start + h.records_at
            end = start + h.batch_bytes
            i = 0
            while pos < end and remaining > 0:
                if i >= skip:
                    append((mv, pos, h, i, start))
                    remaining -= 1
                pos += 4 + unpack(mv, pos)[0]
                i += 1
            skip = 0
        self._index = index
        return index

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

    def raw_batches(self) -> tuple[list[bytes], int]:
        """The pulled log bytes (runs of whole batches, docs/formats/commitlog.md) and how many
        records of the first batch lie before the requested offset; ``len(self)`` records follow.
        For columnar readers (the Spark connector) that decode without per-record objects."""
        return list(self._response.batches), self._response.skip_first

    def bodies(self) -> list[bytes]:
        """All bodies at once, in one pass over the batches, without per-message objects."""
        out: list[bytes] = []
        append = out.append
        unpack = _RECORD_HEAD.unpack_from
        skip = self._response.skip_first
        remaining = self._count
        for mv, start, h in self._batches():
            if remaining <= 0:
                break
            pos = start + h.records_at
            end = start + h.batch_bytes
            i = 0
            while pos < end and remaining > 0:
                size, kl, pl = unpack(mv, pos)
                if i >= skip:
                    append(mv[pos + 8 + kl + pl : pos + 4 + size])  # slicing bytes: one copy, no view
                    remaining -= 1
                pos += 4 + size
                i += 1
            skip = 0
        return out


@dataclass
class _Producer:
    producer_id: int = field(default_factory=lambda: random.getrandbits(63) or 1)
    sequences: dict[tuple[str, int], int] = field(default_factory=dict)


class _Group:
    """The messages of one send that went to one queue (one batch)."""

    __slots__ = ("base_queue_offset", "base_sequence", "deliver", "duplicate", "idxs", "positions", "queue_id",
                 "records_at")

    def __init__(self, queue_id: int, idxs: list[int], positions: list[int], base_sequence: int,
                 deliver: list[int] | None = None) -> None:
        self.queue_id = queue_id
        self.deliver = deliver  # delayed messages: their deliver times (the batch went to __timer)
        self.idxs = idxs
        self.positions = positions
        self.base_sequence = base_sequence
        self.records_at = 0
        self.base_queue_offset = 0
        self.duplicate = False


class Receipts(Sequence[Receipt]):
    """The receipts of one send, in message order, each built when first read."""

    def __init__(self, topic: str, count: int, groups: list[_Group]) -> None:
        self._topic = topic
        self._where: list[tuple[_Group, int]] = [] if len(groups) == 1 else [None] * count  # type: ignore[list-item]
        self._single = groups[0] if len(groups) == 1 else None
        self._count = count
        if self._single is None:
            for g in groups:
                for j, i in enumerate(g.idxs):
                    self._where[i] = (g, j)

    def __len__(self) -> int:
        return self._count

    def _receipt(self, i: int) -> Receipt:
        if self._single is not None:
            g, j = self._single, i
        else:
            g, j = self._where[i]
        if g.deliver is not None:  # stored in __timer until it fires: no queue offset in its topic yet
            offset = g.records_at + g.positions[j]
            return Receipt(self._topic, g.queue_id, -1, offset, g.duplicate, offset, g.deliver[j])
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


def _redirect(exc: grpc.RpcError) -> str:
    """The master's address a slave put in the trailing metadata of a refused write, if any."""
    try:
        trailing = exc.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # not every RpcError carries metadata
        return ""
    for key, value in trailing:
        if key == "tidemark-master" and value:
            return str(value)
    return ""


def _encode(messages: Sequence[Message], idxs: list[int],
            timer_target: tuple[str, int] | None = None) -> tuple[bytes, list[int]]:
    """Records of ``messages[i] for i in idxs`` (format in broker.batch_format) and their positions.
    With ``timer_target`` they are scheduled records (broker.timers.records) for that queue."""
    parts: list[bytes] = []
    positions: list[int] = []
    add = parts.append
    pack = _RECORD_HEAD.pack
    pos = 0
    target = target_props(*timer_target) if timer_target is not None else b""
    for i in idxs:
        m = messages[i]
        body = m.body
        key = m.key.encode() if m.key else b""
        if timer_target is not None:
            props = scheduled_props(m.deliver_at_ms or 0, timer_target[0], timer_target[1], m.properties, target)
        else:
            props = bf.encode_props(m.properties) if m.properties else b""
        size = len(key) + len(props) + len(body)
        add(pack(4 + size, len(key), len(props)))
        if key:
            add(key)
        if props:
            add(props)
        add(body)
        positions.append(pos)
        pos += 8 + size
    return b"".join(parts), positions


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _channel_credentials(root_certificates: bytes | None, ca_file: str | None, cert_file: str | None,
                         key_file: str | None) -> grpc.ChannelCredentials | None:
    if ca_file:
        root_certificates = _read(ca_file)
    if root_certificates is None and not cert_file:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates,
                                        private_key=_read(key_file) if key_file else None,
                                        certificate_chain=_read(cert_file) if cert_file else None)


class BrokerError(Exception):
    """A call failed; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message


class BrokerClient:
    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        timeout_s: float = 30.0,
        root_certificates: bytes | None = None,
        token: str | None = None,
        tls_ca_file: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
    ) -> None:
        """TLS when ``tls_ca_file`` (or ``root_certificates``, the CA's PEM bytes) is given; a client
        certificate with ``tls_cert_file`` + ``tls_key_file``; ``token`` is sent as a bearer token."""
        self.addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        if not self.addresses:
            raise ValueError("at least one broker address is needed")
        if bool(tls_cert_file) != bool(tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        self.timeout_s = timeout_s
        self._credentials = _channel_credentials(root_certificates, tls_ca_file, tls_cert_file, tls_key_file)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._current = 0
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.BrokerStub | None = None
        self._lock = threading.Lock()
        self._producer = _Producer()
        self._queues: dict[str, int] = {}
        self._round_robin = itertools.count()
        alloc.tune()  # see broker.alloc: multi-MB request buffers stay in the heap
        self._connect(0)

    # -- connection ----------------------------------------------------------------------------
    def _connect(self, index: int) -> None:
        if self._channel is not None:
            self._channel.close()
        self._current = index % len(self.addresses)
        address = self.addresses[self._current]
        options = [("grpc.max_receive_message_length", MESSAGE_BYTES_MAX), ("grpc.max_send_message_length", MESSAGE_BYTES_MAX)]
        if self._credentials is not None:
            self._channel = grpc.secure_channel(address, self._credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.BrokerStub(self._channel)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, *, retry: bool = True, timeout_s: float | None = None,
              retryable: tuple[grpc.StatusCode, ...] = RETRYABLE) -> Any:
        attempts = RETRIES_MAX if retry else 1
        delay = 0.05
        for attempt in range(attempts):
            assert self._stub is not None
            try:
                return getattr(self._stub, method)(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                master = _redirect(exc) if code == grpc.StatusCode.FAILED_PRECONDITION else ""
                if master and attempt + 1 < attempts:  # a slave names its master: follow it
                    if master not in self.addresses:
                        self.addresses.append(master)
                    self._connect(self.addresses.index(master))
                    continue
                if code in retryable and attempt + 1 < attempts:
                    if len(self.addresses) > 1:
                        self._connect(self._current + 1)
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                raise BrokerError(code, exc.details() or "") from None  # type: ignore[attr-defined]
        raise AssertionError("unreachable")

    # -- topics --------------------------------------------------------------------------------
    def create_topic(self, name: str, queues: int = 1) -> None:
        self._call("CreateTopic", pb.CreateTopicRequest(name=name, queues=queues), retry=False)
        self._queues[name] = queues

    def delete_topic(self, name: str) -> None:
        self._call("DeleteTopic", pb.DeleteTopicRequest(name=name), retry=False)
        self._queues.pop(name, None)

    def list_topics(self, include_system: bool = False) -> dict[str, dict[str, Any]]:
        resp = self._call("ListTopics", pb.ListTopicsRequest(include_system=include_system))
        return {t.name: {"queues": t.queues, "max_offsets": list(t.queue_max_offsets)} for t in resp.topics}

    def _queue_count(self, topic: str) -> int:
        if topic not in self._queues:
            topics = self.list_topics(include_system=True)
            if topic not in topics:
                raise BrokerError(grpc.StatusCode.NOT_FOUND, f"unknown topic {topic!r}")
            self._queues[topic] = topics[topic]["queues"]
        return self._queues[topic]

    # -- send ----------------------------------------------------------------------------------
    def pick_queue(self, topic: str, key: str | None) -> int:
        """A key always maps to ``crc32c(key) % queues``; keyless sends rotate over the queues."""
        queues = self._queue_count(topic)
        if key is None:
            return next(self._round_robin) % queues
        return crc32c.crc32c(key.encode()) % queues

    def send(self, topic: str, messages: Sequence[Message], ack: str = "replica",
             timeout_ms: int | None = None) -> Sequence[Receipt]:
        """Send in one request: one batch per queue. Keyless messages of one call share a queue
        (the next in round-robin order), so a call makes one batch, not one per message."""
        if ack not in ACKS:
            raise ValueError(f"ack must be one of {', '.join(ACKS)}")
        if not messages:
            return Receipts(topic, 0, [])
        queues = self._queue_count(topic)
        sticky = next(self._round_robin) % queues
        by_queue: dict[int, list[int]] = {}
        delayed: dict[int, list[int]] = {}  # timer messages not yet due, by target queue
        crc = crc32c.crc32c
        now_ms = int(time.time() * 1000)
        for i, m in enumerate(messages):
            q = sticky if m.key is None else crc(m.key.encode()) % queues
            target = by_queue if m.deliver_at_ms is None or m.deliver_at_ms <= now_ms else delayed
            group = target.get(q)
            if group is None:
                target[q] = [i]
            else:
                group.append(i)
        topic_bytes = len(topic.encode())
        with self._lock:
            if any(v > SEQUENCE_MAX for v in self._producer.sequences.values()):
                self._producer = _Producer()
            # filled in place: constructing sub-messages separately would copy every payload twice
            request = pb.SendRequest(ack=ACKS[ack], timeout_ms=timeout_ms or 0)
            groups: list[_Group] = []
            for queue_id, idxs in by_queue.items():
                records, positions = _encode(messages, idxs)
                seq = self._producer.sequences.get((topic, queue_id), 0)
                request.batches.add(topic=topic, queue_id=queue_id, producer_id=self._producer.producer_id,
                                    base_sequence=seq, record_count=len(idxs), records_crc=crc(records),
                                    records=records)
                groups.append(_Group(queue_id, idxs, positions, seq))
            timer_seq = self._producer.sequences.get((TIMER_TOPIC, 0), 0)
            for queue_id, idxs in delayed.items():  # one sequence for __timer: batches follow each other
                records, positions = _encode(messages, idxs, timer_target=(topic, queue_id))
                request.batches.add(topic=topic, queue_id=queue_id, producer_id=self._producer.producer_id,
                                    base_sequence=timer_seq, record_count=len(idxs), records_crc=crc(records),
                                    records=records, delayed=True)
                groups.append(_Group(queue_id, idxs, positions, timer_seq, [messages[i].deliver_at_ms or 0 for i in idxs]))
                timer_seq += len(idxs)
            try:
                resp = self._call("Send", request, retryable=SEND_RETRYABLE)
            except BrokerError:
                self._producer = _Producer()  # outcome unknown after every retry: never reuse these sequences
                raise
            for g, r in zip(groups, resp.receipts, strict=True):
                if g.deliver is not None:
                    self._producer.sequences[(TIMER_TOPIC, 0)] = g.base_sequence + len(g.idxs)
                    g.records_at = r.commit_offset + bf.HEADER_BYTES + len(TIMER_TOPIC)
                else:
                    self._producer.sequences[(topic, g.queue_id)] = g.base_sequence + len(g.idxs)
                    g.records_at = r.commit_offset + bf.HEADER_BYTES + topic_bytes
                g.base_queue_offset = r.base_queue_offset
                g.duplicate = r.duplicate
        return Receipts(topic, len(messages), groups)

    # -- pull ----------------------------------------------------------------------------------
    def pull(self, topic: str, queue_id: int, offset: int, max_messages: int = 1000,
             max_wait_ms: int = 0, max_bytes: int = 0) -> PullResult:
        req = pb.PullRequest(topic=topic, queue_id=queue_id, offset=offset, max_messages=max_messages,
                             max_wait_ms=max_wait_ms, max_bytes=max_bytes)
        return PullResult(self._call("Pull", req, timeout_s=self.timeout_s + max_wait_ms / 1000.0))

    def iter_pull(self, topic: str, queue_id: int, offset: int, max_messages: int = 5000,
                  max_wait_ms: int = 0, max_bytes: int = 0, *, stop_at_end: bool = True) -> Iterator[PullResult]:
        """Pull continuously from ``offset``, keeping the next request in flight while the caller
        works on the current result (fetch pipelining). Stops at the queue's end unless told not to."""
        timeout = self.timeout_s + max_wait_ms / 1000.0

        def request(at: int) -> Any:
            req = pb.PullRequest(topic=topic, queue_id=queue_id, offset=at, max_messages=max_messages,
                                 max_wait_ms=max_wait_ms, max_bytes=max_bytes)
            assert self._stub is not None
            return self._stub.Pull.future(req, timeout=timeout, metadata=self._metadata)

        pending = request(offset)
        while True:
            try:
                result = PullResult(pending.result())
            except grpc.RpcError as exc:
                raise BrokerError(exc.code(), exc.details() or "") from None  # type: ignore[attr-defined]
            if not len(result) and stop_at_end:
                return
            pending = request(result.next_offset)
            yield result

    def offset_for_time(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        return int(self._call("OffsetForTime", pb.OffsetForTimeRequest(
            topic=topic, queue_id=queue_id, timestamp_ms=timestamp_ms)).offset)

    # -- consumer offsets ----------------------------------------------------------------------
    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        self.commit_offsets(group, {(topic, queue_id): offset})

    def commit_offsets(self, group: str, offsets: Mapping[tuple[str, int], int]) -> None:
        req = pb.CommitOffsetRequest(offsets=[pb.CommittedOffset(group=group, topic=t, queue_id=q, offset=o)
                                              for (t, q), o in offsets.items()])
        self._call("CommitOffset", req)

    def committed_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        resp = self._call("GetOffset", pb.GetOffsetRequest(group=group, topic=topic, queue_id=queue_id))
        return int(resp.offset) if resp.found else None

    # -- timers --------------------------------------------------------------------------------
    def cancel_timer(self, receipt: Receipt | int) -> dict[str, Any]:
        """Cancel a scheduled message (its receipt, or its ``timer_offset``) before it fires.
        A fired, cancelled or firing timer: FAILED_PRECONDITION; an unknown one: NOT_FOUND."""
        offset = receipt if isinstance(receipt, int) else receipt.timer_offset
        if offset is None:
            raise ValueError("this receipt is not a timer message's (it has no timer_offset)")
        resp = self._call("CancelTimer", pb.CancelTimerRequest(timer_offset=offset), retry=False)
        return {"timer_offset": offset, "deliver_at_ms": resp.deliver_at_ms, "topic": resp.topic,
                "queue_id": resp.queue_id}

    # -- admin ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return dict(json.loads(self._call("Status", pb.StatusRequest()).json))

    def promote(self, unclean: bool = False) -> int:
        """Make the connected node (a slave) the master; returns its new epoch."""
        return int(self._call("Promote", pb.PromoteRequest(unclean=unclean), retry=False).epoch)

    def demote(self, master: str) -> None:
        """Make the connected node (a master) a slave of ``master``."""
        self._call("Demote", pb.DemoteRequest(master=master), retry=False)


