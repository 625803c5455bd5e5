"""The client's API, sends, pulls, seek by time and consumer offsets."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import crc32c
import grpc

from broker.client.core import (
    ACKS,
    CALL_DEADLINE,
    COLD_PULLS_REMOTE,
    RETRYABLE,
    ROUTE_HOPS_MAX,
    SEND_RETRYABLE,
    SEQUENCE_MAX,
    TURN_LEFT_MIN_S,
    ClientCore,
    _local_request,
    _Producer,
    _request,
)
from broker.client.errors import (
    BrokerError,
    DeadlineExceeded,
    NotFound,
    OutOfRange,
    Unavailable,
    error_for,
    from_rpc_error,
)
from broker.client.local_reads import LocalPullResponse, mark_not_local, not_local
from broker.client.messages import Message, PullResult, Receipt, Receipts, SendGroup, encode_messages
from broker.client.topics_api import TopicsAPI
from broker.logformat import batch as bf
from broker.logformat.timer_props import TIMER_TOPIC
from proto import tidemark_pb2 as pb

ISOLATIONS = {"read_committed": pb.ISOLATION_READ_COMMITTED, "read_uncommitted": pb.ISOLATION_READ_UNCOMMITTED}


def isolation_of(name: str) -> int:
    """The proto's ``Isolation`` for ``read_committed`` / ``read_uncommitted``."""
    level = ISOLATIONS.get(name)
    if level is None:
        raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}")
    return level


def _grouped(messages: Sequence[Message], queues: int, sticky: int) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Message indexes per queue (keyless ones to ``sticky``): due now, and delayed (timers)."""
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
    return by_queue, delayed


PartOf = tuple[dict[int, list[int]], dict[int, list[int]]]  # a shard's queues: due messages, delayed ones


def _by_shard(by_queue: dict[int, list[int]], delayed: dict[int, list[int]],
              shard_of: Callable[[int], str | None]) -> dict[str | None, PartOf]:
    """The queues still to send, grouped by the shard that writes them."""
    parts: dict[str | None, PartOf] = {}
    for which, grouped in ((0, by_queue), (1, delayed)):
        for q, idxs in grouped.items():
            parts.setdefault(shard_of(q), ({}, {}))[which][q] = idxs
    return parts


def _sent(by_queue: dict[int, list[int]], delayed: dict[int, list[int]], part: PartOf) -> None:
    """A shard's part stored: its queues are no longer to send."""
    for q in part[0]:
        by_queue.pop(q)
    for q in part[1]:
        delayed.pop(q)


@contextlib.contextmanager
def _held(lock: threading.Lock, shard: str | None) -> Iterator[None]:
    """A shard's send lock, waited for no later than the operation's deadline (``CALL_DEADLINE``):
    a send behind another one stuck on that shard gives up in its own time. Taken with less than
    ``TURN_LEFT_MIN_S`` left, it is given back: a request sent with no time to be answered would
    end with its outcome unknown (the producer id given up, the node doubted) for nothing."""
    deadline = CALL_DEADLINE.get()
    if not lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
        raise _not_sent(shard)
    try:
        if deadline is not None and deadline - time.monotonic() < TURN_LEFT_MIN_S:
            raise _not_sent(shard)
        yield
    finally:
        lock.release()


def _not_sent(shard: str | None) -> BrokerError:
    return error_for(grpc.StatusCode.DEADLINE_EXCEEDED, f"this send's part for shard {shard!r} was not sent: another "
                     "send to that shard held it up until the deadline (parts for other shards may be stored)")


def _outcome(fn: Callable[[str | None], list[SendGroup]], shard: str | None) -> list[SendGroup] | BrokerError:
    """``fn(shard)``'s groups, or the ``BrokerError`` it raised."""
    try:
        return fn(shard)
    except BrokerError as exc:
        return exc


def _receipts(topic: str, count: int, groups: list[SendGroup]) -> Receipts:
    """No groups: a committing send whose transaction had ended before (no receipts)."""
    return Receipts(topic, count, groups) if groups else Receipts(topic, 0, [])


class DataAPI(TopicsAPI):
    """Sends, pulls, seek by time and consumer offsets."""

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
        with self.within() as deadline:  # over shards: every call of the send within the client's timeout_s
            if self.sharded:  # a producer and a lock per shard: a shard failing over holds up only its own sends
                return self._send_sharded(topic, messages, ack, timeout_ms, deadline)
        with self._lock:
            if any(v > SEQUENCE_MAX for v in self._producer.sequences.values()):
                self._producer = _Producer()
            try:
                return self._send_as(self._producer, topic, messages, ack, timeout_ms)
            except BrokerError:
                self._producer = _Producer()  # outcome unknown after every retry: never reuse these sequences
                raise

    def _send_as(self, producer: _Producer, topic: str, messages: Sequence[Message], ack: str,
                 timeout_ms: int | None, transaction: int = 0, begin: pb.BeginTransactionRequest | None = None,
                 begun: Callable[[pb.BeginTransactionResponse], None] | None = None,
                 commit: pb.EndTransactionRequest | None = None,
                 ended: Callable[[pb.EndTransactionResponse], None] | None = None) -> Sequence[Receipt]:
        """``send`` with ``producer``'s id and sequences (advanced when it is answered); inside a
        transaction, ``transaction`` is its producer id (and ``producer``'s). ``begin``: the send
        begins a transaction (``producer`` and ``transaction`` 0); ``begun`` gets its answer.
        ``commit``: the send commits it; ``ended`` gets the outcome (no receipts if the
        transaction had ended before: a retry whose first attempt committed)."""
        if ack not in ACKS:
            raise ValueError(f"ack must be one of {', '.join(ACKS)}")
        if not messages:
            return Receipts(topic, 0, [])
        if self.sharded:  # a one-pair transaction's: over shards a ShardedTransaction routes its own sends
            raise error_for(grpc.StatusCode.FAILED_PRECONDITION, "a one-pair transaction's send in a cluster of shards")
        queues = self._queue_count(topic)
        by_queue, delayed = _grouped(messages, queues, next(self._round_robin) % queues)
        return _receipts(topic, len(messages), self._send_batches(
            producer, topic, messages, self, by_queue, delayed, ack=ack, timeout_ms=timeout_ms, transaction=transaction,
            begin=begin, begun=begun, commit=commit, ended=ended))

    def _send_sharded(self, topic: str, messages: Sequence[Message], ack: str, timeout_ms: int | None,
                      deadline: float) -> Sequence[Receipt]:
        """``send`` in a cluster of shards: one request per shard (side by side when a call spans
        several), each with that shard's producer under that shard's lock. A refusal naming another
        owner was not executed: the topic's routes are asked for again and those queues sent there.
        A call spanning shards can fail on one after another stored its part (no atomicity across
        shards without a transaction): the error is raised, the stored part stays. Every call of it
        is made within ``deadline`` (``within``): its parts, on the pool's threads too, wait for a
        shard's turn no later than that, and no hop starts after it."""
        if ack not in ACKS:
            raise ValueError(f"ack must be one of {', '.join(ACKS)}")
        if not messages:
            return Receipts(topic, 0, [])
        queues = self._queue_count(topic)
        by_queue, delayed = _grouped(messages, queues, self._sticky_queue(topic, queues))
        done: list[SendGroup] = []
        carried: dict[int, _Producer] = {}  # queues refused by a shard naming another: the producer sent with
        for hop in range(ROUTE_HOPS_MAX + 1):
            parts = _by_shard(by_queue, delayed, lambda q: self._shard_of(topic, q))
            to_shard = functools.partial(self._send_part, parts, topic, messages, ack, timeout_ms, carried)

            if len(parts) == 1:
                shard = next(iter(parts))
                outcomes: list[tuple[str | None, list[SendGroup] | BrokerError]] = [(shard, _outcome(to_shard, shard))]
            else:  # the others' parts on the pool, the first on this thread (one hand-off fewer)
                first, *others = parts
                futures = [(shard, self._submit(_outcome, to_shard, shard)) for shard in others]
                outcomes = [(first, _outcome(to_shard, first)), *((shard, f.result()) for shard, f in futures)]
            refused: BrokerError | None = None
            for shard, outcome in outcomes:
                if isinstance(outcome, BrokerError):
                    if outcome.owner is None:
                        raise outcome
                    refused = outcome
                    # sent again elsewhere with the same producer id and sequences: a queue that moved
                    # (docs/shards.md) carries its producers' last batches, so a retry of a send stored
                    # just before the move is answered as a duplicate there, not stored twice
                    used = self._shard_producers.get(shard or "")
                    if used is not None:
                        carried.update((q, carried.get(q, used)) for q in parts[shard][0])
                    continue
                done.extend(outcome)
                _sent(by_queue, delayed, parts[shard])
            if refused is None:
                return _receipts(topic, len(messages), done)
            if hop < ROUTE_HOPS_MAX and time.monotonic() < deadline:
                self._learn_routes([topic])
            else:
                break
        assert refused is not None
        raise refused

    def _send_part(self, parts: dict[str | None, PartOf], topic: str, messages: Sequence[Message], ack: str,
                   timeout_ms: int | None, carried: dict[int, _Producer], shard: str | None) -> list[SendGroup]:
        """One Send of ``parts[shard]`` to ``shard``'s master with its producer (a queue in
        ``carried``: with the producer a refused attempt used), under its lock."""
        by_queue, delayed = parts[shard]
        key = shard or ""
        with _held(self._shard_lock(key), shard):
            producer = self._shard_producers.get(key)
            if producer is None or any(v > SEQUENCE_MAX for v in producer.sequences.values()):
                producer = self._shard_producers[key] = _Producer()
            try:
                groups = self._send_batches(producer, topic, messages, self._shard_core(shard), by_queue, delayed,
                                            ack=ack, timeout_ms=timeout_ms, transaction=0, begin=None, begun=None,
                                            commit=None, ended=None, carried=carried)
                for g in groups:
                    g.shard = shard
                return groups
            except BrokerError as exc:
                if exc.owner is None:  # outcome unknown after every retry: never reuse these sequences
                    self._shard_producers[key] = _Producer()
                if shard is not None and isinstance(exc, (Unavailable, DeadlineExceeded)):
                    self._routes.doubt(shard)
                raise

    def _sticky_queue(self, topic: str, queues: int) -> int:
        """The queue a call's keyless messages go to in a cluster of shards: the next in round-robin
        order whose shard has a master and has not failed a call lately (any, if none has). A shard
        passed over for want of a master is asked about again now and then (``_ask_masters``)."""
        first = next(self._round_robin) % queues
        for k in range(queues):
            q = (first + k) % queues
            shard = self._routes.owner(topic, q)
            if shard is None or self._routes.trusted(shard):
                return q
            self._ask_masters(topic, [shard])
        return first

    def _send_batches(self, producer: _Producer, topic: str, messages: Sequence[Message], core: ClientCore,
                      by_queue: dict[int, list[int]], delayed: dict[int, list[int]], *, ack: str, timeout_ms: int | None,
                      transaction: int, begin: pb.BeginTransactionRequest | None,
                      begun: Callable[[pb.BeginTransactionResponse], None] | None,
                      commit: pb.EndTransactionRequest | None,
                      ended: Callable[[pb.EndTransactionResponse], None] | None,
                      timer_key: tuple[str, int] = (TIMER_TOPIC, 0),
                      carried: dict[int, _Producer] | None = None) -> list[SendGroup]:
        """One Send of the batches grouped per queue, on ``core``'s node; the producer's sequences
        advance once it is answered. ``timer_key``: where the sequence of this node's ``__timer``
        is kept (one per shard in a cluster of shards). ``carried``: queues sent with another
        producer (one a refused attempt used)."""
        crc = crc32c.crc32c
        topic_bytes = len(topic.encode())
        # filled in place: constructing sub-messages separately would copy every payload twice
        request = pb.SendRequest(ack=ACKS[ack], timeout_ms=timeout_ms or 0, transaction=transaction, begin=begin,
                                 commit=commit)
        groups: list[SendGroup] = []
        by_producer = carried or {}
        for queue_id, idxs in by_queue.items():
            records, positions = encode_messages(messages, idxs)
            sender = by_producer.get(queue_id, producer)
            seq = sender.sequences.get((topic, queue_id), 0)
            request.batches.add(topic=topic, queue_id=queue_id, producer_id=sender.producer_id,
                                base_sequence=seq, record_count=len(idxs), records_crc=crc(records),
                                records=records)
            groups.append(SendGroup(queue_id, idxs, positions, seq))
        timer_seq = producer.sequences.get(timer_key, 0)
        for queue_id, idxs in delayed.items():  # one sequence for __timer: batches follow each other
            records, positions = encode_messages(messages, idxs, timer_target=(topic, queue_id))
            request.batches.add(topic=topic, queue_id=queue_id, producer_id=producer.producer_id,
                                base_sequence=timer_seq, record_count=len(idxs), records_crc=crc(records),
                                records=records, delayed=True)
            groups.append(SendGroup(queue_id, idxs, positions, timer_seq, [messages[i].deliver_at_ms or 0 for i in idxs]))
            timer_seq += len(idxs)
        resp = core._call("Send", request, retryable=SEND_RETRYABLE)
        if begun is not None:
            begun(resp.begun)
        if ended is not None:
            ended(resp.ended)
            if not resp.receipts:
                return []
        for g, r in zip(groups, resp.receipts, strict=True):
            if g.deliver is not None:
                producer.sequences[timer_key] = g.base_sequence + len(g.idxs)
                g.records_at = r.commit_offset + bf.HEADER_BYTES + len(TIMER_TOPIC)
            else:
                by_producer.get(g.queue_id, producer).sequences[(topic, g.queue_id)] = g.base_sequence + len(g.idxs)
                g.records_at = r.commit_offset + bf.HEADER_BYTES + topic_bytes
            g.base_queue_offset = r.base_queue_offset
            g.duplicate = r.duplicate
        return groups

    def pull(self, topic: str, queue_id: int, offset: int, max_messages: int = 1000,
             max_wait_ms: int = 0, max_bytes: int = 0, *, local_reads: bool = False,
             isolation: str = "read_committed") -> PullResult:
        """Up to ``max_messages`` from ``offset`` of one queue (what is confirmed), decoded lazily;
        ``max_wait_ms``: wait that long for the first one; ``next_offset`` says where to go on.
        An offset removed by retention, or beyond the end, raises ``OutOfRange``.
        ``local_reads``: on the node's host, read the batches from its segment files when it can
        (``broker/client/local_reads.py``; the same answer, without moving the bytes through gRPC).
        ``isolation``: ``read_committed`` (transactions' messages once committed, never aborted
        ones: their offsets are gaps) or ``read_uncommitted`` (everything confirmed)."""
        req = _request(pb.PullRequest, topic=topic, queue_id=queue_id, offset=offset, max_messages=max_messages,
                       max_wait_ms=max_wait_ms, max_bytes=max_bytes, isolation=isolation_of(isolation))
        timeout_s = self.timeout_s + max_wait_ms / 1000.0
        return self._routed(topic, queue_id, lambda core: self._pull_on(core, req, timeout_s, local_reads), offset,
                            timeout_s)

    def _pull_on(self, core: ClientCore, req: pb.PullRequest, timeout_s: float, local_reads: bool) -> PullResult:
        if local_reads and not_local(core.current_address) is None:
            try:
                local = self._read_local(core, core._call("PullLocal", _local_request(req), timeout_s=timeout_s))
            except BrokerError as exc:
                self._local_refused(core, exc.code, exc)
                local = None
            if local is not None:
                return PullResult(local)
        return PullResult(core._call("Pull", req, timeout_s=timeout_s))

    def _read_local(self, core: ClientCore, response: pb.PullLocalResponse) -> LocalPullResponse | None:
        return self._segment_files.read(core.current_address, response)

    def _local_refused(self, core: ClientCore, code: grpc.StatusCode, exc: Exception) -> None:
        """A ``PullLocal`` refused: the pull goes over gRPC (UNIMPLEMENTED: an older node, never
        again from it; FAILED_PRECONDITION: a range in tiered storage), or the error stands."""
        if code == grpc.StatusCode.UNIMPLEMENTED:
            mark_not_local(core.current_address, "the node does not serve PullLocal")
        elif code != grpc.StatusCode.FAILED_PRECONDITION:
            raise exc from None

    def earliest_offset(self, topic: str, queue_id: int, probe_offset: int = 0) -> int:
        """The queue's earliest retained offset: what a pull at ``probe_offset`` (an offset the
        queue's writer holds, e.g. its end) reports, or for a queue that moved between shards, its
        oldest segment that still holds records (each probed at its last offset)."""
        if self.sharded:
            if self._routes.queues(topic) is None:
                self._learn_routes([topic])
            for _, start, end, _ in self._routes.segments(topic, queue_id):
                if end is None or end <= start:
                    continue
                try:
                    return self.pull(topic, queue_id, end - 1, max_messages=1).min_offset
                except (OutOfRange, NotFound):  # that segment is gone (retention): the next one
                    continue
        return self.pull(topic, queue_id, probe_offset, max_messages=1).min_offset

    def pull_future(self, topic: str, queue_id: int, offset: int, max_messages: int = 1000,
                    max_wait_ms: int = 0, isolation: str = "read_committed") -> grpc.Future:
        """A pull in flight on the current node (no retries, no redirects): ``result()`` is the raw
        response, ``cancel()`` ends it. For callers that wait on something else at the same time."""
        req = _request(pb.PullRequest, topic=topic, queue_id=queue_id, offset=offset, max_messages=max_messages,
                       max_wait_ms=max_wait_ms, isolation=isolation_of(isolation))
        core = self._shard_core(self._shard_of(topic, queue_id, offset))
        assert core._stub is not None
        return core._stub.Pull.future(req, timeout=self.timeout_s + max_wait_ms / 1000.0, metadata=self._metadata)

    def iter_pull(self, topic: str, queue_id: int, offset: int, max_messages: int = 5000,
                  max_wait_ms: int = 0, max_bytes: int = 0, *, stop_at_end: bool = True,
                  local_reads: bool = False, isolation: str = "read_committed") -> Iterator[PullResult]:
        """Pull continuously from ``offset``, keeping the next request in flight while the caller
        works on the current result (fetch pipelining). Stops at the queue's end unless told not to.
        A pull refused UNAVAILABLE (a node restarting or failing over, a topic still being created
        or a queue being moved on its shard) is made again as ``pull`` makes it: retried within
        the client's timeout, routes followed. ``local_reads``: as for ``pull``."""
        timeout = self.timeout_s + max_wait_ms / 1000.0

        level = isolation_of(isolation)
        remote_left = 0  # after a range in tiered storage, this many pulls go over gRPC before trying again
        core = self._shard_core(self._shard_of(topic, queue_id, offset))
        hops = 0  # refusals naming another shard followed in a row

        def request(at: int) -> tuple[Any, bool, Any]:
            nonlocal remote_left
            req = _request(pb.PullRequest, topic=topic, queue_id=queue_id, offset=at, max_messages=max_messages,
                           max_wait_ms=max_wait_ms, max_bytes=max_bytes, isolation=level)
            assert core._stub is not None
            local = local_reads and not remote_left and not_local(core.current_address) is None
            remote_left = max(0, remote_left - 1)
            if local:
                return req, True, core._stub.PullLocal.future(_local_request(req), timeout=timeout, metadata=self._metadata)
            return req, False, core._stub.Pull.future(req, timeout=timeout, metadata=self._metadata)

        pending = request(offset)
        while True:
            req, local, future = pending
            try:
                response = future.result()
                if local:
                    response = self._read_local(core, response)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                if error.owner is not None and hops < ROUTE_HOPS_MAX:  # another shard's segment: go there
                    hops += 1
                    self._named_elsewhere(topic, queue_id, error.owner, req.offset)
                    core = self._shard_core(error.owner.shard)
                    pending = request(req.offset)
                    continue
                code = exc.code()  # type: ignore[attr-defined]
                if code not in RETRYABLE:
                    if not local:
                        raise error from None
                    self._local_refused(core, code, error)
                    remote_left = COLD_PULLS_REMOTE  # a tiered range: keep the pipeline on gRPC through it
                response = None
            if response is None:  # not readable locally, or a transient refusal: this one as ``pull`` makes it
                result = self.pull(topic, queue_id, req.offset, max_messages, max_wait_ms, max_bytes, isolation=isolation)
                core = self._shard_core(self._shard_of(topic, queue_id, result.next_offset))
            else:
                result = PullResult(response)
            hops = 0
            if not len(result) and stop_at_end and result.next_offset == req.offset:
                return
            pending = request(result.next_offset)
            if len(result) or not stop_at_end:  # an empty answer past aborted offsets is not the end
                yield result

    def offset_for_time(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        """The first queue offset whose message was stored at or after ``timestamp_ms`` (the end
        of the queue if none was)."""
        req = _request(pb.OffsetForTimeRequest, topic=topic, queue_id=queue_id, timestamp_ms=timestamp_ms)
        return int(self._routed(topic, queue_id, lambda core: core._call("OffsetForTime", req)).offset)

    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Store ``offset`` (the next one to consume) as ``group``'s position on one queue."""
        self.commit_offsets(group, {(topic, queue_id): offset})

    def commit_offsets(self, group: str, offsets: Mapping[tuple[str, int], int]) -> None:
        """Store several positions of ``group`` at once: ``{(topic, queue_id): offset}``."""
        req = _request(pb.CommitOffsetRequest, offsets=[_request(pb.CommittedOffset, group=group, topic=t, queue_id=q, offset=o)
                                                        for (t, q), o in offsets.items()])
        self._coordinated(group, lambda core: core._call("CommitOffset", req))

    def committed_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        """``group``'s stored position on one queue, or None if it never committed one."""
        req = _request(pb.GetOffsetRequest, group=group, topic=topic, queue_id=queue_id)
        resp = self._coordinated(group, lambda core: core._call("GetOffset", req))
        return int(resp.offset) if resp.found else None
