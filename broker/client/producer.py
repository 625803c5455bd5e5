"""A producer that merges many sends into few requests: ``BrokerClient.producer()`` (docs/guide.md).

``send()`` encodes the call's messages (one run of records per queue, as ``BrokerClient.send``
does: a bad message fails there, in the caller's thread) and returns with a future. Each
destination (a shard's master, or the pair's) has a *lane*: one thread with one request in
flight. What callers send while a lane's request is in flight waits in the lane and goes in its
next request: the runs of every waiting call for one queue in one batch, every queue of the lane
in one request, up to ``request_bytes`` (and ``TIMER_BATCHES_MAX`` batches of delayed messages).
A lane with nothing in flight waits up to ``linger_ms`` for more (Kafka's ``linger.ms``). So a
call whose keys span shards costs what it costs on one pair: each shard's share of many calls
rides one request, where ``BrokerClient.send()`` makes one request per shard per call, and
gRPC's per-call cost is most of a request's (bench/README.md, "Shards").

The guarantees are ``send()``'s, per lane:

- **Idempotent**: a producer id per lane and a sequence per queue; a request is retried as
  ``send()`` retries it (one call within the client's ``timeout_s``), so a retry lands once.
  After any failed request the lane takes a new producer id, as ``send()`` does.
- **Order**: the calls of one thread reach each queue in the order they were made. A queue keeps
  the lane that holds its unsent messages until that lane has none, so a refusal naming another
  shard (the queue moved) cannot let a later call overtake: the lane sends the refused batches, as
  they were (producer id, sequences), to the new owner, and its later batches of that queue after
  them; only then do new calls go to the new owner's lane.
- **Outcome**: a call's future fails with the first error of its parts (the other parts may be
  stored: no atomicity across shards without a transaction). A request of several calls refused
  for one call's topic or messages (``NOT_FOUND``, ``INVALID_ARGUMENT``: nothing stored) is sent
  again call by call, in the order they were made, so only the calls that cause it fail.
- **Bounded**: ``buffer_bytes`` of encoded records may wait; ``send()`` blocks while the buffer
  is full, for at most ``max_block_ms``, then raises ``ResourceExhausted`` (nothing of it queued).

A future cannot be cancelled (it is under way from the start). Its callbacks run on a lane's
thread: they may ``send()`` (waiting up to ``max_block_ms`` for room), but ``flush()`` and
``close()`` there are refused. No thread dies silently: a lane that meets an unexpected exception
fails the calls it held with it and goes on. ``flush()`` waits for every call made before it;
``close()`` (or leaving a ``with`` block) flushes, then stops the lanes. The producer does not
send in transactions.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import crc32c
import grpc

from broker.client.core import ACKS, ROUTE_HOPS_MAX, SEND_RETRYABLE, SEQUENCE_MAX, ClientCore, _Producer
from broker.client.data_api import _grouped
from broker.client.errors import BrokerError, DeadlineExceeded, Unavailable, error_for
from broker.client.messages import Message, Receipts, SendGroup, encode_messages
from broker.client.routes import RouteTable
from broker.logformat import batch as bf
from broker.logformat.timer_props import TIMER_TOPIC
from proto import tidemark_pb2 as pb

log = logging.getLogger(__name__)

LINGER_MS = 5
REQUEST_BYTES = 1 << 20  # a lane's request carries this many bytes of records at most (one call's may be more)
BUFFER_BYTES = 64 << 20
# __timer batches (delayed messages, one per target queue) in one request at most: they share one
# sequence, and a node remembers a producer's last 5 batches of a queue (views/producer_state.py),
# so a retry of more would be refused out of order. (One call with more goes as send() sends it.)
TIMER_BATCHES_MAX = 5
# refusals of a whole request caused by one call's topic or messages, before anything is stored:
# its calls are sent again one by one (any other failure fails every call of the request)
CALL_ALONE = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)

QueueKey = tuple[str, int, bool]  # topic, queue, delayed (its batch goes to the shard's __timer)


class Client(Protocol):
    """What a producer uses of ``BrokerClient``."""

    timeout_s: float

    @property
    def _round_robin(self) -> Iterator[int]: ...
    @property
    def _routes(self) -> RouteTable: ...
    @property
    def sharded(self) -> bool: ...
    def _queue_count(self, topic: str) -> int: ...
    def _sticky_queue(self, topic: str, queues: int) -> int: ...
    def _shard_of(self, topic: str, queue: int, offset: int | None = None) -> str | None: ...
    def _shard_core(self, shard: str | None) -> ClientCore: ...
    def _learn_routes(self, topics: list[str]) -> None: ...
    def within(self, timeout_s: float | None = None) -> AbstractContextManager[float]: ...


class _Call:
    """One ``send()``: done when each of its parts is."""

    __slots__ = ("error", "future", "groups", "messages", "parts_left", "topic")

    def __init__(self, topic: str, messages: Sequence[Message]) -> None:
        self.future: Future[Receipts] = Future()
        self.future.set_running_or_notify_cancel()  # queued is under way: cancel() says no
        self.topic = topic
        self.messages = messages
        self.parts_left = 0
        self.groups: list[SendGroup] = []
        self.error: BrokerError | None = None


@dataclass(slots=True)
class _Run:
    """A call's messages for one queue, encoded: ``records`` (positions relative to its start)."""

    idxs: list[int]
    records: bytes
    positions: list[int]
    crc: int
    deliver: list[int] | None  # delayed messages: their deliver times (the run goes to __timer)


@dataclass(slots=True)
class _Part:
    """A call's runs for one lane, per queue key."""

    call: _Call
    queues: dict[QueueKey, _Run]
    nbytes: int = 0
    at: float = 0.0  # when it was queued (monotonic)
    seq: int = 0  # the order parts were queued in (calls sent again one by one keep it)
    done: bool = False


@dataclass(slots=True)
class _Batch:
    """One batch of a request: a queue's messages of one or more parts, encoded, with the
    producer and sequence it was sent with (kept when it is sent again elsewhere)."""

    key: QueueKey
    producer: _Producer
    base_sequence: int
    records: bytes
    count: int
    crc: int
    members: list[tuple[_Part, SendGroup, int, int]]  # part, its group, its first record's index and byte in the batch


@dataclass(eq=False)
class _Lane:
    shard: str | None
    parts: collections.deque[_Part] = field(default_factory=collections.deque)
    nbytes: int = 0
    producer: _Producer = field(default_factory=_Producer)
    elsewhere: dict[QueueKey, str | None] = field(default_factory=dict)  # queues it now sends to another shard
    thread: threading.Thread | None = None
    wake: threading.Condition | None = None


class _Delivery:
    """One request's worth of parts on its way: what each part got."""

    def __init__(self) -> None:
        self.groups: dict[int, list[SendGroup]] = {}  # id(part) -> its groups answered
        self.errors: dict[int, BrokerError] = {}  # id(part) -> its first error
        self.spent = False  # an error, or __timer batches numbered again: the lane's producer id ends

    def failed(self, batches: list[_Batch], error: BrokerError) -> None:
        for b in batches:
            for part, *_ in b.members:
                self.errors.setdefault(id(part), error)


class Producer:
    """See the module's docstring. Made by ``BrokerClient.producer()``; thread-safe."""

    def __init__(self, client: Client, *, ack: str = "replica", linger_ms: int = LINGER_MS,
                 request_bytes: int = REQUEST_BYTES, buffer_bytes: int = BUFFER_BYTES,
                 max_block_ms: int | None = None, timeout_ms: int | None = None) -> None:
        if ack not in ACKS:
            raise ValueError(f"ack must be one of {', '.join(ACKS)}")
        if linger_ms < 0 or request_bytes <= 0 or buffer_bytes <= 0:
            raise ValueError("linger_ms must be >= 0, request_bytes and buffer_bytes > 0")
        self._client = client
        self._ack = ack
        self._linger_s = linger_ms / 1000.0
        self._request_bytes = request_bytes
        self._buffer_bytes = buffer_bytes
        self._max_block_s = client.timeout_s if max_block_ms is None else max_block_ms / 1000.0
        self._timeout_ms = timeout_ms or 0  # each request's ack wait on the server (0: the server's)
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._lanes: dict[str | None, _Lane] = {}
        self._holders: dict[QueueKey, tuple[_Lane, int]] = {}  # a queue's lane while it holds parts of it, how many
        self._buffered = 0
        self._pending: set[Future[Receipts]] = set()
        self._flushing = 0
        self._closed = False
        self._queued = 0  # parts queued so far (their order)

    # -- the caller's side ------------------------------------------------------------------------
    def send(self, topic: str, messages: Sequence[Message]) -> Future[Receipts]:
        """Queue ``messages`` for ``topic``; the future's result is their receipts, in order (as
        ``BrokerClient.send``'s). Keys pick queues as there; a call's keyless messages share one queue."""
        call = _Call(topic, messages)
        if not messages:
            call.future.set_result(Receipts(topic, 0, []))
            return call.future
        client = self._client
        queues = client._queue_count(topic)
        sharded = client.sharded
        sticky = client._sticky_queue(topic, queues) if sharded else next(client._round_robin) % queues
        by_queue, delayed = _grouped(messages, queues, sticky)
        runs = {(topic, q, False): _run(messages, idxs, None) for q, idxs in by_queue.items()}
        runs.update(((topic, q, True), _run(messages, idxs, (topic, q))) for q, idxs in delayed.items())
        nbytes = sum(len(r.records) for r in runs.values())
        owners = {k: client._shard_of(topic, k[1]) if sharded else None for k in runs}  # routes before the lock
        with self._lock:
            if self._closed:
                raise error_for(grpc.StatusCode.FAILED_PRECONDITION, "this producer is closed")
            self._wait_for_space(nbytes)
            # a queue goes to the lane that holds its unsent parts (there may be one of another
            # shard, which learnt the queue moved), else to its shard's
            lanes = {k: held[0] if (held := self._holders.get(k)) is not None else self._lane(owners[k]) for k in runs}
            parts: dict[str | None, _Part] = {}
            now = time.monotonic()
            for k, lane in lanes.items():
                part = parts.get(lane.shard)
                if part is None:
                    self._queued += 1
                    part = parts[lane.shard] = _Part(call, {}, at=now, seq=self._queued)
                run = part.queues[k] = runs[k]
                part.nbytes += len(run.records)
                held = self._holders.get(k)
                self._holders[k] = (lane, (held[1] if held is not None else 0) + 1)
            call.parts_left = len(parts)
            for shard, part in parts.items():
                lane = self._lanes[shard]
                lane.parts.append(part)
                lane.nbytes += part.nbytes
                self._buffered += part.nbytes
                assert lane.wake is not None
                lane.wake.notify()
            self._pending.add(call.future)
        return call.future

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every call made before this one is done (lanes stop lingering meanwhile).
        Raises ``DeadlineExceeded`` if they are not done within ``timeout_s`` (default: none).
        Futures' callbacks run on a lane's thread: ``flush()`` and ``close()`` there would wait
        for themselves, and are refused (RuntimeError)."""
        self._not_on_a_lane("flush")
        with self._lock:
            waiting = list(self._pending)
            self._flushing += 1
            for lane in self._lanes.values():
                assert lane.wake is not None
                lane.wake.notify()
        try:
            _, not_done = wait_futures(waiting, timeout=timeout_s)
        finally:
            with self._lock:
                self._flushing -= 1
        if not_done:
            raise error_for(grpc.StatusCode.DEADLINE_EXCEEDED, f"{len(not_done)} sends not done within {timeout_s} s")

    def close(self, timeout_s: float | None = None) -> None:
        """Flush, then stop the lanes. ``send()`` is refused after."""
        self._not_on_a_lane("close")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.flush(timeout_s)
        finally:
            with self._lock:
                lanes = list(self._lanes.values())
                for lane in lanes:
                    assert lane.wake is not None
                    lane.wake.notify()
            for lane in lanes:
                if lane.thread is not None and lane.thread is not threading.current_thread():
                    lane.thread.join(timeout_s)

    def _not_on_a_lane(self, what: str) -> None:
        if any(lane.thread is threading.current_thread() for lane in list(self._lanes.values())):
            raise RuntimeError(f"{what}() from a future's callback (a producer lane's thread) would wait for itself")

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_for_space(self, nbytes: int) -> None:
        """Under the lock: until ``nbytes`` fit in the buffer (a call larger than all of it: until
        the buffer is empty), for at most ``max_block_ms``."""
        deadline = time.monotonic() + self._max_block_s
        while self._buffered and self._buffered + nbytes > self._buffer_bytes:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                raise error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the producer's buffer ({self._buffer_bytes} "
                                f"bytes) stayed full for {self._max_block_s:.1f} s: nothing of this send was queued")
            self._space.wait(left)

    def _lane(self, shard: str | None) -> _Lane:
        lane = self._lanes.get(shard)
        if lane is None:
            lane = self._lanes[shard] = _Lane(shard, wake=threading.Condition(self._lock))
            lane.thread = threading.Thread(target=self._run, args=(lane,), daemon=True,
                                           name=f"tidemark-producer-{shard or 'pair'}")
            lane.thread.start()
        return lane

    # -- a lane's thread --------------------------------------------------------------------------
    def _run(self, lane: _Lane) -> None:
        while True:
            parts = self._take(lane)
            if parts is None:
                return
            try:
                self._deliver(lane, parts)
            except BaseException as exc:  # a bug: these calls fail with it, the lane goes on
                log.exception("the producer's lane for %s failed", lane.shard or "the pair")
                lane.producer = _Producer()
                error = error_for(grpc.StatusCode.INTERNAL, f"the producer's lane for {lane.shard or 'the pair'} "
                                  f"failed: {exc!r}")
                for part in parts:
                    try:
                        self._part_done(part, [], error)
                    except BaseException:
                        log.exception("a call of the producer's lane for %s could not be ended", lane.shard or "the pair")

    def _take(self, lane: _Lane) -> list[_Part] | None:
        """The next request's parts: once ``request_bytes`` wait, or the oldest waited ``linger_ms``
        (at once when flushing or closing). None: closed and nothing left."""
        assert lane.wake is not None
        with self._lock:
            while True:
                if lane.parts:
                    if lane.nbytes >= self._request_bytes or self._flushing or self._closed:
                        break
                    left = lane.parts[0].at + self._linger_s - time.monotonic()
                    if left <= 0:
                        break
                    lane.wake.wait(left)
                elif self._closed:
                    return None
                else:
                    lane.wake.wait()
            taken = [lane.parts.popleft()]
            size = taken[0].nbytes
            timers = {k for k in taken[0].queues if k[2]}
            while lane.parts and size + lane.parts[0].nbytes <= self._request_bytes:
                more = timers | {k for k in lane.parts[0].queues if k[2]}
                if len(more) > TIMER_BATCHES_MAX:  # a node remembers so many of a producer's __timer batches
                    break
                timers = more
                size += lane.parts[0].nbytes
                taken.append(lane.parts.popleft())
            lane.nbytes -= size
            return taken

    def _deliver(self, lane: _Lane, parts: list[_Part]) -> None:
        """Send ``parts`` in one request per destination (the lane's shard; queues it learnt moved:
        their new owner), following refusals that name another owner, within the client's timeout."""
        client = self._client
        if any(v > SEQUENCE_MAX for v in lane.producer.sequences.values()):
            lane.producer = _Producer()
        batches = self._encode(lane, parts)
        d = _Delivery()
        with client.within():
            for hop in range(ROUTE_HOPS_MAX + 1):
                refused: list[_Batch] = []
                last: BrokerError | None = None
                for dest, group in _by_dest(batches, lambda b: lane.elsewhere.get(b.key, lane.shard)).items():
                    error = self._request(lane, dest, group, d)
                    if error is not None:
                        refused += group
                        last = error
                if last is None:
                    break
                if hop == ROUTE_HOPS_MAX:
                    d.failed(refused, last)
                    break
                try:
                    client._learn_routes(sorted({b.key[0] for b in refused}))
                    dests = {b.key: client._shard_of(b.key[0], b.key[1]) for b in refused}
                except BrokerError as exc:
                    d.failed(refused, exc)
                    break
                self._route_again(lane, refused, dests, d)
                batches = refused
        if d.spent:
            lane.producer = _Producer()  # never reuse sequences a node may hold otherwise than we think
        for part in parts:
            error = d.errors.get(id(part))
            self._part_done(part, [] if error is not None else d.groups.get(id(part), []), error)

    @staticmethod
    def _route_again(lane: _Lane, refused: list[_Batch], dests: dict[QueueKey, str | None], d: _Delivery) -> None:
        """Refused batches go where the routes now say, as they were: a queue's batch keeps its
        producer and sequence (a queue that moved carries its producers' last batches, so a retry
        of one stored before the move is a duplicate there). ``__timer`` batches share one
        sequence per shard, which a batch leaving for another shard would break: they go with a
        new producer (numbered from its start per shard), and the lane takes a new one after."""
        timers = _Producer()
        numbered: dict[str | None, int] = {}  # per shard, the next __timer sequence of ``timers``
        for b in refused:
            dest = dests[b.key]
            if dest == lane.shard:
                lane.elsewhere.pop(b.key, None)
            else:
                lane.elsewhere[b.key] = dest
            if b.key[2]:
                b.producer = timers
                b.base_sequence = numbered.get(dest, 0)
                numbered[dest] = b.base_sequence + b.count
                for _, g, j, _ in b.members:
                    g.base_sequence = b.base_sequence + j
                d.spent = True

    def _request(self, lane: _Lane, dest: str | None, batches: list[_Batch], d: _Delivery) -> BrokerError | None:
        """One Send of ``batches`` to ``dest``. Returns a refusal naming another owner (nothing
        stored: the caller follows it); any other outcome goes to ``d`` (answered: groups filled,
        sequences advanced). A request of several calls refused for one call's topic or message
        (``NOT_FOUND``, ``INVALID_ARGUMENT``: nothing stored): each call again on its own."""
        client = self._client
        request = pb.SendRequest(ack=ACKS[self._ack], timeout_ms=self._timeout_ms)
        for b in batches:
            topic, queue_id, delayed = b.key
            request.batches.add(topic=topic, queue_id=queue_id, producer_id=b.producer.producer_id,
                                base_sequence=b.base_sequence, record_count=b.count, records_crc=b.crc,
                                records=b.records, delayed=delayed)
        try:
            resp = client._shard_core(dest)._call("Send", request, retryable=SEND_RETRYABLE)
        except BrokerError as exc:
            if dest is not None and isinstance(exc, (Unavailable, DeadlineExceeded)):
                client._routes.doubt(dest)
            if exc.owner is not None:
                return exc
            d.spent = True  # as send() does: whatever failed, these sequences are not used again
            parts = sorted(_unique(p for b in batches for p, *_ in b.members), key=lambda p: p.seq)
            calls = list({id(p.call): p.call for p in parts}.values())
            if exc.code not in CALL_ALONE or len(calls) == 1:
                d.failed(batches, exc)
                return None
            keys = {b.key for b in batches}
            for call in calls:  # in the order they were made: only the ones that cause it fail
                lane.producer = _Producer()  # the call before may have failed in any way
                alone = self._encode(lane, [p for p in parts if p.call is call], keys, dest_of=lambda _: dest)
                refusal = self._request(lane, dest, alone, d)
                if refusal is not None:
                    d.failed(alone, refusal)
            return None
        for b, r in zip(batches, resp.receipts, strict=True):
            topic, queue_id, delayed = b.key
            if delayed:
                b.producer.sequences[_timer_key(dest)] = b.base_sequence + b.count
                at = r.commit_offset + bf.HEADER_BYTES + len(TIMER_TOPIC)
            else:
                b.producer.sequences[(topic, queue_id)] = b.base_sequence + b.count
                at = r.commit_offset + bf.HEADER_BYTES + len(topic.encode())
            for part, g, j, start in b.members:
                g.records_at = at + start
                g.base_queue_offset = r.base_queue_offset + j
                g.duplicate = r.duplicate
                g.shard = dest
                d.groups.setdefault(id(part), []).append(g)
        return None

    def _encode(self, lane: _Lane, parts: Iterable[_Part], only: set[QueueKey] | None = None,
                dest_of: Callable[[QueueKey], str | None] | None = None) -> list[_Batch]:
        """One batch per queue key of ``parts`` (``only``: of those keys): their runs one after the
        other, with the lane's producer and next sequences (a __timer batch: those of the shard it
        goes to: ``dest_of`` it, or the lane's)."""
        by_key: dict[QueueKey, list[tuple[_Part, _Run]]] = {}
        for part in parts:
            for k, run in part.queues.items():
                if only is None or k in only:
                    by_key.setdefault(k, []).append((part, run))
        producer = lane.producer
        batches: list[_Batch] = []
        timer_next: dict[str | None, int] = {}
        for k, members in by_key.items():
            topic, queue_id, delayed = k
            if len(members) == 1:
                records, crc = members[0][1].records, members[0][1].crc
            else:
                records = b"".join(run.records for _, run in members)
                crc = crc32c.crc32c(records)
            if delayed:  # one sequence for a shard's __timer: its batches follow each other
                dest = dest_of(k) if dest_of is not None else lane.elsewhere.get(k, lane.shard)
                seq = timer_next.get(dest, _timer_sequence(producer, dest))
            else:
                seq = producer.sequences.get((topic, queue_id), 0)
            groups: list[tuple[_Part, SendGroup, int, int]] = []
            j = at = 0
            for part, run in members:
                groups.append((part, SendGroup(queue_id, run.idxs, run.positions, seq + j, run.deliver), j, at))
                j += len(run.idxs)
                at += len(run.records)
            if delayed:
                timer_next[dest] = seq + j
            batches.append(_Batch(k, producer, seq, records, j, crc, groups))
        return batches

    def _part_done(self, part: _Part, groups: list[SendGroup], error: BrokerError | None) -> None:
        call = part.call
        with self._lock:
            if part.done:  # a lane's unexpected failure after some of its parts were done
                return
            part.done = True
            for k in part.queues:
                held = self._holders.get(k)
                if held is None:
                    continue
                if held[1] <= 1:  # its lane holds nothing more of it: new calls go where the routes say
                    del self._holders[k]
                    held[0].elsewhere.pop(k, None)
                else:
                    self._holders[k] = (held[0], held[1] - 1)
            self._buffered -= part.nbytes
            self._space.notify_all()
            if error is not None and call.error is None:
                call.error = error
            call.groups += groups
            call.parts_left -= 1
            finished = call.parts_left == 0
        if not finished:
            return
        try:  # done before it leaves _pending: a flush() never misses it
            if call.error is not None:
                call.future.set_exception(call.error)
            else:
                call.future.set_result(Receipts(call.topic, len(call.messages), call.groups))
        finally:
            with self._lock:
                self._pending.discard(call.future)


def _timer_key(dest: str | None) -> tuple[str, int]:
    """Where a producer keeps the sequence of ``dest``'s ``__timer``."""
    return (f"{TIMER_TOPIC}@{dest or ''}", 0)


def _timer_sequence(producer: _Producer, dest: str | None) -> int:
    return producer.sequences.get(_timer_key(dest), 0)


def _by_dest(batches: list[_Batch], dest_of: Callable[[_Batch], str | None]) -> dict[str | None, list[_Batch]]:
    out: dict[str | None, list[_Batch]] = {}
    for b in batches:
        out.setdefault(dest_of(b), []).append(b)
    return out


def _unique(parts: Iterable[_Part]) -> list[_Part]:
    """``parts`` in order, each once."""
    return list({id(p): p for p in parts}.values())


def _run(messages: Sequence[Message], idxs: list[int], timer_target: tuple[str, int] | None) -> _Run:
    """``messages[i] for i in idxs`` encoded (``timer_target``: as scheduled records for that queue)."""
    records, positions = encode_messages(messages, idxs, timer_target=timer_target)
    deliver = [messages[i].deliver_at_ms or 0 for i in idxs] if timer_target is not None else None
    return _Run(idxs, records, positions, crc32c.crc32c(records), deliver)
