"""The gRPC ``Broker`` service: request checks, mapping to the store, status codes.

It runs on an asyncio gRPC server (``grpc.aio``): ``Pull`` is a coroutine (a long-poll holds no
thread), and so are ``Send`` and the topic creates and deletes (they append on the loop and their
waits park a future, not a thread); every other method is a plain function run in the server's
thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import grpc
import structlog

from broker import clock, metrics
from broker.daemon import plain, status_message
from broker.daemon.failures import refuse, unexpected
from broker.daemon.group_admin import GroupAdmin, check_group
from broker.daemon.heartbeats import Heartbeats
from broker.daemon.longpoll import ANY_QUEUE, LongPolls
from broker.daemon.send_wire import SendRequestView
from broker.daemon.wire import pull_response_bytes
from broker.errors import MESSAGE_MAX, BrokerError, invalid, shown
from broker.groups.pops import PopService, as_messages
from broker.logformat import system_records
from broker.ports import BatchReceipt, IncomingBatch, RoleController
from broker.security.auth import current_caller
from broker.storage import instance
from broker.store import Store
from broker.store.reads import LocalPull, PullResult
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

log = structlog.get_logger("service")
T = TypeVar("T")
SendRequest = pb.SendRequest | SendRequestView  # the fast path's batches are views (send_wire.py)
ACK_NAMES: dict[int, str] = {pb.ACK_UNSPECIFIED: "replica", pb.ACK_REPLICA: "replica", pb.ACK_LEADER: "leader", pb.ACK_FLUSH: "flush"}


def _handle(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """``fn()``, or the call refused with the status of what it raised (``refuse``: the handler
    answers None, which grpc does not send)."""
    try:
        return fn()
    except BrokerError as exc:
        failure = exc
    except Exception as exc:
        failure = unexpected(exc)
    code, message, metadata = getattr(grpc.StatusCode, failure.code), failure.message[:MESSAGE_MAX], failure.metadata
    del failure  # its traceback holds this frame: no cycle keeps the request alive
    refuse(context, code, message, metadata)
    return None  # type: ignore[return-value]


# A send is checked (records CRC, the framing walk: ~2 ns a record in C, ~0.3 us in Python when the
# C module is not built; plain messages encoded at a few us each) and appended on the event loop
# when it is small enough not to hold the loop for long; a bigger one in a pool thread.
SEND_ON_LOOP_RECORDS_MAX = 16_384
MESSAGES_ON_LOOP_MAX = 500  # plain messages encoded, or messages decoded, on the loop (~3 us each)
HEAVY_JOBS = 1  # pool jobs that loop over a request's messages in Python, at once (``_heavy``)
SEND_ON_LOOP_BYTES_MAX = 8 << 20
# How long a call waits, on a node that just took office, for its metadata view to apply what was
# confirmed then (``Store.wait_metadata_fence``): a coroutine (no thread held), and a call run in
# the server's thread pool, whose threads every other call needs; UNAVAILABLE after it (retried).
METADATA_FENCE_WAIT_S = 5.0
METADATA_FENCE_WAIT_IN_POOL_S = 0.5
# Calls that never wait for it: what an operator uses while a failover settles.
FENCE_EXEMPT = frozenset({"Status", "Promote", "Demote"})
# How long a pull at the end of its queue waits for the queue view to apply what is confirmed
# (read-your-writes: ``_read_your_writes``); it reads what is applied after it.
READ_YOUR_WRITES_WAIT_S = 2.0


def _send_response(request: SendRequest, receipts: list[BatchReceipt], plain_batches: plain.Encoded | None) -> pb.SendResponse:
    """A receipt per batch, then one per plain message (a Python object each: a pool thread's work
    for a large send, as its encoding was)."""
    n = len(request.batches)
    return pb.SendResponse(
        receipts=[
            pb.BatchReceipt(commit_offset=r.commit_offset, base_queue_offset=r.base_queue_offset,
                            record_count=r.record_count, duplicate=r.duplicate)
            for r in receipts[:n]
        ],
        message_receipts=plain.receipts(plain_batches, receipts[n:], request.messages) if plain_batches else [],
    )


async def _handle_async(context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[T]]) -> T:
    """``_handle`` for coroutine handlers (long-polls, parked heartbeats)."""
    try:
        return await fn()
    except BrokerError as exc:
        failure = exc
    except Exception as exc:
        failure = unexpected(exc)
    code, message, metadata = getattr(grpc.StatusCode, failure.code), failure.message[:MESSAGE_MAX], failure.metadata
    del failure  # its traceback holds this frame: no cycle keeps the request alive
    refuse(context, code, message, metadata)
    return None  # type: ignore[return-value]


class BrokerService(pb_grpc.BrokerServicer):
    def __init__(self, store: Store, longpolls: LongPolls, read_pool: Executor, heartbeats: Heartbeats) -> None:
        self.store = store
        self.config = store.config
        self.longpolls = longpolls
        self.read_pool = read_pool  # pull reads and large sends; admin calls run in the server's own pool
        self.heartbeats = heartbeats
        self.groups = GroupAdmin(store, heartbeats.membership)
        self.pops = PopService(store)
        self.groups.pops = self.pops
        self.instance = instance.InstanceFile(self.config["node.data_dir"])  # for PullLocal
        self._heavy_slots: asyncio.Semaphore | None = None  # made on the loop at first use

    # -- a new master's metadata fence (wire.add_broker_service runs these before every call) -----
    def wait_fence(self) -> None:
        self.store.wait_metadata_fence(METADATA_FENCE_WAIT_IN_POOL_S)

    async def wait_fence_async(self) -> None:
        await self.store.wait_metadata_fence_async(METADATA_FENCE_WAIT_S)

    # -- data --------------------------------------------------------------------------------
    async def Send(self, request: SendRequest, context: grpc.aio.ServicerContext) -> pb.SendResponse:
        return await _handle_async(context, lambda: self._send(request))

    async def _send(self, request: SendRequest) -> pb.SendResponse:
        """Append on the event loop (like a topic create: one writev, ~0.5 ms a MiB, with the
        interpreter lock released), then wait for the acknowledgement as a parked future. A send
        in a pool thread paid two thread hops and the lock hand-offs of a waiting thread: 0.8x.
        A large send (``SEND_ON_LOOP_*``) is checked and appended in a pool thread instead."""
        started = time.perf_counter()
        if request.ack not in ACK_NAMES:
            raise invalid(f"unknown ack mode {request.ack}")
        if not request.batches and not request.messages:
            raise invalid("a send request needs at least one batch or message")
        ack = ACK_NAMES[request.ack]
        if ack == "replica":
            self.store.watermarks.check_replica_ack_possible()
        # a framing walk stops at the declared record count, so declared counts bound the checks
        on_loop = (sum(b.record_count for b in request.batches) + len(request.messages) <= SEND_ON_LOOP_RECORDS_MAX
                   and len(request.messages) <= MESSAGES_ON_LOOP_MAX)
        plain_batches = await self._heavy(on_loop, plain.encode, request.messages, request.producer_id,
                                          self._queues_of) if request.messages else None
        batches = [
            IncomingBatch(system_records.TIMER_TOPIC, 0, b.records, b.record_count, b.records_crc, b.producer_id,
                          b.base_sequence, timer_target=(b.topic, b.queue_id))
            if b.delayed else
            IncomingBatch(b.topic, b.queue_id, b.records, b.record_count, b.records_crc, b.producer_id, b.base_sequence)
            for b in request.batches
        ] + (plain_batches.batches if plain_batches is not None else [])
        records_bytes = sum(len(b.records) for b in batches)
        on_loop = on_loop and records_bytes <= SEND_ON_LOOP_BYTES_MAX
        try:
            receipts, wait_offset = await self._on_loop_or_pool(on_loop, self.store.appender.append, batches)
        except BrokerError:
            metrics.SEND_REQUESTS.labels("refused").inc()
            raise
        await self.store.writes.acknowledged_async(wait_offset, ack, timeout_ms=request.timeout_ms)
        metrics.SEND_REQUESTS.labels("ok").inc()
        metrics.SEND_SECONDS.labels(ack).observe(time.perf_counter() - started)
        metrics.SEND_MESSAGES.inc(sum(r.record_count for r in receipts if not r.duplicate))
        metrics.SEND_BYTES.inc(records_bytes)
        if plain_batches is None:
            return _send_response(request, receipts, None)
        return await self._heavy(on_loop, _send_response, request, receipts, plain_batches)

    async def _heavy(self, on_loop: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: work that is a Python loop per message of one request (encoding plain
        messages, decoding a pull or a pop, building their answers). Small, right here; large, in a
        pool thread, one such job at a time (``HEAVY_JOBS``): the interpreter runs one thread at a
        time, and four decoders at once made every other call wait for it in turn (health checks
        1.8 s behind four decoded pulls of 100,000). Those waiting hold no thread."""
        if on_loop:
            return fn(*args)
        if self._heavy_slots is None:
            self._heavy_slots = asyncio.Semaphore(HEAVY_JOBS)
        async with self._heavy_slots:
            return await asyncio.get_running_loop().run_in_executor(self.read_pool, fn, *args)

    async def _on_loop_or_pool(self, on_loop: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` right here on the loop, or (work that would hold the loop, and every other
        call, too long) in a pool thread."""
        if on_loop:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.read_pool, fn, *args)

    def _queues_of(self, topic: str) -> int | None:
        info = self.store.views.metadata.topic(topic)
        return int(info["queues"]) if info is not None else None

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> bytes:
        """Answers wire bytes of a PullResponse (see broker/daemon/wire.py: no copy of the log bytes).

        The read runs in the read pool; a pull that finds nothing parks a future (longpoll.py) and
        holds no thread until its queue grows or ``max_wait_ms`` passes."""
        return await _handle_async(context, lambda: self._pull(request, local=False))

    async def PullLocal(self, request: pb.PullLocalRequest, context: grpc.aio.ServicerContext) -> pb.PullLocalResponse:
        """A pull answered with where its batches lie in this node's segment files, for a reader on
        this host that reads them itself (broker/storage/instance.py); the same checks as Pull."""
        return await _handle_async(context, lambda: self._pull(request, local=True))

    async def _pull(self, request: pb.PullRequest | pb.PullLocalRequest, *, local: bool) -> Any:
        loop = asyncio.get_running_loop()
        _check_system_read(request.topic)
        max_messages = min(request.max_messages or 1000, self.config["limits.pull_messages_max"])
        if isinstance(request, pb.PullRequest) and request.decode:
            max_messages = min(max_messages, self.config["limits.pull_decoded_messages_max"])
        max_bytes = min(request.max_bytes or self.config["limits.pull_bytes_max"], self.config["limits.pull_bytes_max"])
        wait_s = min(request.max_wait_ms, self.config["limits.pull_wait_ms_max"]) / 1000.0
        reads = self.store.reads
        read: Callable[[], PullResult | LocalPull] = functools.partial(
            reads.pull_spans if local else reads.pull, request.topic, request.queue_id, request.offset, max_messages,
            max_bytes, 0)
        key = (request.topic, request.queue_id)
        deadline = loop.time() + wait_s
        await self._read_your_writes(request.topic, request.queue_id, request.offset, max_messages)
        while True:
            parked = self.longpolls.park(key) if wait_s > 0 else None
            try:
                r = await loop.run_in_executor(self.read_pool, read)
                left = deadline - loop.time()
                if r.count or parked is None or left <= 0 or self.store.closing:
                    decoded = isinstance(request, pb.PullRequest) and request.decode
                    return await self._heavy(not decoded or r.count <= MESSAGES_ON_LOOP_MAX, self._pull_answer, request, r)
                await self.longpolls.wait(parked, left)
            finally:
                if parked is not None:
                    self.longpolls.unpark(key, parked)

    def _pull_answer(self, request: pb.PullRequest | pb.PullLocalRequest, r: PullResult | LocalPull) -> Any:
        if isinstance(r, LocalPull):
            return pb.PullLocalResponse(spans=[pb.LogSpan(path=os.path.abspath(p), position=at, length=n) for p, at, n in r.spans],
                                        skip_first=r.skip_first, count=r.count, next_offset=r.next_offset,
                                        min_offset=r.min_offset, max_offset=r.max_offset,
                                        instance_file=self.instance.path, instance=self.instance.token)
        if isinstance(request, pb.PullRequest) and request.decode:
            return pb.PullResponse(messages=plain.decode(r.batches, r.skip_first, r.count),
                                   next_offset=r.next_offset, min_offset=r.min_offset,
                                   max_offset=r.max_offset, count=r.count).SerializeToString()
        return pull_response_bytes(r.batches, skip_first=r.skip_first, count=r.count, next_offset=r.next_offset,
                                   min_offset=r.min_offset, max_offset=r.max_offset)

    async def _read_your_writes(self, topic: str, queue_id: int, offset: int, max_messages: int) -> None:
        """A pull that could take more than the queue view holds of its queue, while records of that
        queue were appended beyond it and the view lags the confirm offset, first waits (at most
        ``READ_YOUR_WRITES_WAIT_S``) for the view to apply what is confirmed now: a send
        acknowledged before the pull began is confirmed, and must be in the answer (not missed,
        nor an offset from its receipt refused as beyond the end) however far the view's apply
        lags. Costs nothing when the view is current, holds all the pull may take, or holds all
        this queue has."""
        confirmed = self.store.watermarks.confirm_offset
        queues = self.store.views.queues
        if queues.applied_offset >= confirmed or self.store.closing:
            return
        qf = queues.queue(topic, queue_id)
        have = qf.next_queue_offset if qf is not None else 0
        if offset + max_messages <= have or self.store.appender.queue_end_hint(topic, queue_id) <= have:
            return
        await self.store.dispatcher.wait_applied_async(queues, confirmed, READ_YOUR_WRITES_WAIT_S)

    def OffsetForTime(self, request: pb.OffsetForTimeRequest, context: grpc.ServicerContext) -> pb.OffsetForTimeResponse:
        def run() -> pb.OffsetForTimeResponse:
            _check_system_read(request.topic)
            return pb.OffsetForTimeResponse(
                offset=self.store.reads.offset_for_time(request.topic, request.queue_id, request.timestamp_ms))
        return _handle(context, run)

    # -- consumer offsets ----------------------------------------------------------------------
    def CommitOffset(self, request: pb.CommitOffsetRequest, context: grpc.ServicerContext) -> pb.CommitOffsetResponse:
        def run() -> pb.CommitOffsetResponse:
            self.store.check_writable()
            if len(request.offsets) > self.config["limits.commit_offsets_max"]:
                raise invalid(f"{len(request.offsets)} offsets in one call; at most limits.commit_offsets_max "
                              f"({self.config['limits.commit_offsets_max']})")
            entries = []
            for o in request.offsets:
                self._check_group(o.group)
                if o.topic.startswith(system_records.SYSTEM_PREFIX):
                    raise invalid(f"consumer offsets are not stored for system topic {shown(o.topic)}")
                self.store.reads.queue_bounds(o.topic, o.queue_id)  # NOT_FOUND / INVALID_ARGUMENT
                high = self.store.appender.queue_end(o.topic, o.queue_id)  # acked sends count before views apply them
                if o.offset > high:
                    raise invalid(f"offset {o.offset} is beyond the end of {o.topic}/{o.queue_id} ({high})")
                entries.append((o.group, o.topic, o.queue_id, o.offset))
            self._check_new_groups({g for g, _, _, _ in entries})
            # answered once durable: the commit is in a confirmed record (commitSync semantics)
            self.store.offsets.commit(entries, wait_s=self.config["limits.send_timeout_ms"] / 1000.0)
            return pb.CommitOffsetResponse()
        return _handle(context, run)

    def GetOffset(self, request: pb.GetOffsetRequest, context: grpc.ServicerContext) -> pb.GetOffsetResponse:
        def run() -> pb.GetOffsetResponse:
            self._check_group(request.group)
            self.store.reads.queue_bounds(request.topic, request.queue_id)  # NOT_FOUND / INVALID_ARGUMENT
            value = self.store.offsets.get(request.group, request.topic, request.queue_id)
            if value is None:
                value = self.store.views.metadata.committed_offset(request.group, request.topic, request.queue_id)
            return pb.GetOffsetResponse(found=value is not None, offset=value or 0)
        return _handle(context, run)

    def _check_new_groups(self, groups: set[str]) -> None:
        """Groups with committed offsets are bounded (``groups.committed_groups_max``): every one is
        kept, listed and measured for lag. A commit naming new groups beyond it is refused whole."""
        metadata = self.store.views.metadata
        buffered = {g for g, _, _ in self.store.offsets.buffered()}
        new = {g for g in groups if g not in buffered and not metadata.group_known(g)}
        if not new:
            return
        known = metadata.groups_count() + len({g for g in buffered if not metadata.group_known(g)})
        top = self.config["groups.committed_groups_max"]
        if known + len(new) > top:
            raise BrokerError("RESOURCE_EXHAUSTED", f"{known} groups have committed offsets on this node "
                              f"(groups.committed_groups_max = {top}); a commit of {len(new)} new group(s) is refused")

    @staticmethod
    def _check_group(group: str) -> None:
        check_group(group)

    # -- topics --------------------------------------------------------------------------------
    def _topic_info(self, name: str, queues: int) -> pb.TopicInfo:
        highs = []
        for q in range(queues):
            qf = self.store.views.queues.queue(name, q)
            highs.append(qf.next_queue_offset if qf else 0)
        return pb.TopicInfo(name=name, queues=queues, queue_max_offsets=highs)

    @staticmethod
    def _new_topic(request: pb.CreateTopicRequest) -> tuple[str, dict[str, Any]]:
        """The ``topic.create`` change a request asks for (INVALID_ARGUMENT for a bad name or count)."""
        err = system_records.topic_name_error(request.name)
        if err:
            raise invalid(err)
        queues = request.queues or 1
        if not 1 <= queues <= system_records.QUEUES_MAX:
            raise invalid(f"queues must be 1..{system_records.QUEUES_MAX}, got {queues}")
        return system_records.TOPIC_CREATE, {"topic": request.name, "queues": queues}

    # Topic creates and deletes run on the event loop: the append is one short write under the
    # appender's lock, and the waits for its acknowledgement and its application park a future,
    # not a thread (one thread hand-off fewer per call: issue 13's creates per second)
    async def CreateTopic(self, request: pb.CreateTopicRequest, context: grpc.aio.ServicerContext) -> pb.CreateTopicResponse:
        async def run() -> pb.CreateTopicResponse:
            change = self._new_topic(request)
            # the appender checks "already exists" against its own topic set, under its lock: concurrent
            # creates are safe and share one group commit
            await self._write_metadata([change])
            return pb.CreateTopicResponse(topic=self._topic_info(request.name, change[1]["queues"]))
        return await _handle_async(context, run)

    async def CreateTopics(self, request: pb.CreateTopicsRequest, context: grpc.aio.ServicerContext) -> pb.CreateTopicsResponse:
        """Many topics, all or none: one metadata batch, one wait for its ack and its application."""
        async def run() -> pb.CreateTopicsResponse:
            if not 1 <= len(request.topics) <= system_records.CREATE_TOPICS_MAX:
                raise invalid(f"a CreateTopics call takes 1..{system_records.CREATE_TOPICS_MAX} topics, "
                              f"got {len(request.topics)}")
            changes = [self._new_topic(t) for t in request.topics]
            if len({t.name for t in request.topics}) != len(changes):
                raise invalid("a topic name appears more than once in the request")
            await self._write_metadata(changes)
            return pb.CreateTopicsResponse(topics=[self._topic_info(f["topic"], f["queues"]) for _, f in changes])
        return await _handle_async(context, run)

    async def DeleteTopic(self, request: pb.DeleteTopicRequest, context: grpc.aio.ServicerContext) -> pb.DeleteTopicResponse:
        async def run() -> pb.DeleteTopicResponse:
            if request.name.startswith(system_records.SYSTEM_PREFIX):
                raise invalid(f"system topic {shown(request.name)} cannot be deleted")
            await self._write_metadata([(system_records.TOPIC_DELETE, {"topic": request.name})])
            return pb.DeleteTopicResponse()
        return await _handle_async(context, run)

    async def _write_metadata(self, changes: list[tuple[str, dict[str, Any]]]) -> None:
        """Append ``changes`` as one batch; return once it is acknowledged (ack=replica) and applied."""
        self._check_queues_total(changes)
        await self.store.writes.write_system_async(changes, applied=self.store.views.metadata)

    def _check_queues_total(self, changes: list[tuple[str, dict[str, Any]]]) -> None:
        """The queues of all topics stay within ``limits.queues_max`` (each costs memory and a file;
        1,000 topics of 1,024 queues per call took 820 MB). Counted against what the metadata view
        applied: creates in flight at the same moment may pass it by as many queues as they add."""
        adding = sum(int(f["queues"]) for c, f in changes if c == system_records.TOPIC_CREATE)
        if not adding:
            return
        total, top = self.store.views.metadata.queues_total, self.config["limits.queues_max"]
        if total + adding > top:
            raise BrokerError("RESOURCE_EXHAUSTED", f"this node holds {total} queues; {adding} more would pass "
                              f"limits.queues_max ({top})")

    def ListTopics(self, request: pb.ListTopicsRequest, context: grpc.ServicerContext) -> pb.ListTopicsResponse:
        def run() -> pb.ListTopicsResponse:
            topics = [self._topic_info(n, t["queues"]) for n, t in sorted(self.store.views.metadata.list_topics().items())]
            if request.include_system:
                topics += [self._topic_info(n, 1) for n in system_records.SYSTEM_TOPICS]
            return pb.ListTopicsResponse(topics=topics)
        return _handle(context, run)

    def Promote(self, request: pb.PromoteRequest, context: grpc.ServicerContext) -> pb.PromoteResponse:
        return _handle(context, lambda: pb.PromoteResponse(epoch=self._roles().promote(request.unclean)))

    def Demote(self, request: pb.DemoteRequest, context: grpc.ServicerContext) -> pb.DemoteResponse:
        def run() -> pb.DemoteResponse:
            self._roles().demote(request.master)
            return pb.DemoteResponse()
        return _handle(context, run)

    def _roles(self) -> RoleController:
        if self.store.role_controller is None:
            raise BrokerError("UNIMPLEMENTED", "replication is not available in this daemon")
        return self.store.role_controller

    # -- consumer groups: subscribe mode and operator views (DESIGN §12) ---------------------------
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        """Join, stay, or leave. A member with nothing to do parks (no thread) until its answer changes
        or ``max_wait_ms`` (at most the heartbeat interval, and a third of its session) passes."""
        return await _handle_async(context, lambda: self._heartbeat(request))

    async def _heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        self.store.check_still_master()
        group, topics, owned, session_ms = self.groups.check_heartbeat(request)
        membership = self.heartbeats.membership
        interval_ms = min(self.config["groups.heartbeat_interval_ms"], session_ms // 3)
        if request.leave:
            membership.leave(group, request.member_id)
            self.heartbeats.wake({(group, request.member_id)})  # its own parked heartbeat answers now
            log.info("member_left", group=group, member=request.member_id)
            return pb.HeartbeatResponse(member_id=request.member_id, heartbeat_interval_ms=interval_ms)
        answer = membership.heartbeat(group, request.member_id, topics, owned, session_timeout_ms=session_ms,
                                      client_id=request.client_id[:200], now=time.monotonic())
        if not request.member_id:
            log.info("member_joined", group=group, member=answer.member_id, client=request.client_id[:200])
        wait_s = min(request.max_wait_ms, interval_ms) / 1000.0
        if answer.settled and wait_s > 0:
            key = (group, answer.member_id)
            parked = self.heartbeats.park(key)
            try:
                if not membership.pending(group, answer.member_id, time.monotonic()):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(parked), wait_s)
            finally:
                self.heartbeats.unpark(key, parked)
            self.store.check_still_master()
            later = membership.refresh(group, answer.member_id, time.monotonic())
            if later is None:  # forgotten meanwhile (a role change): rejoin with what it holds
                raise BrokerError("FAILED_PRECONDITION", f"member {shown(answer.member_id)} is no longer known to "
                                  "this node (a role change): heartbeat again to rejoin")
            answer = later
        return pb.HeartbeatResponse(member_id=answer.member_id, heartbeat_interval_ms=interval_ms,
                                    generation=answer.generation,
                                    assigned=[pb.QueueRef(topic=t, queue_id=q) for t, q in sorted(answer.assigned)])

    def ListGroups(self, request: pb.ListGroupsRequest, context: grpc.ServicerContext) -> pb.ListGroupsResponse:
        return _handle(context, lambda: pb.ListGroupsResponse(groups=self.groups.list_groups()))

    def DescribeGroup(self, request: pb.DescribeGroupRequest, context: grpc.ServicerContext) -> pb.DescribeGroupResponse:
        return _handle(context, lambda: pb.DescribeGroupResponse(
            group=self.groups.describe(request.group, member_ids=current_caller().may("admin"))))

    def ResetOffsets(self, request: pb.ResetOffsetsRequest, context: grpc.ServicerContext) -> pb.ResetOffsetsResponse:
        def run() -> pb.ResetOffsetsResponse:
            offsets = self.groups.reset_offsets(request.group, request.topic, request.to, request.value)
            log.info("offsets_reset", group=request.group, topic=request.topic, to=pb.ResetTo.Name(request.to),
                     value=request.value)
            return pb.ResetOffsetsResponse(offsets=offsets)
        return _handle(context, run)

    def DescribeTopic(self, request: pb.DescribeTopicRequest, context: grpc.ServicerContext) -> pb.DescribeTopicResponse:
        def run() -> pb.DescribeTopicResponse:
            _check_system_read(request.name)
            return self.groups.describe_topic(request.name)
        return _handle(context, run)

    def CancelTimer(self, request: pb.CancelTimerRequest, context: grpc.ServicerContext) -> pb.CancelTimerResponse:
        def run() -> pb.CancelTimerResponse:
            at, topic, queue = self.store.timers.cancel(request.timer_offset)
            log.info("timer_cancelled", timer_offset=request.timer_offset, topic=topic, queue=queue, deliver_at_ms=at)
            return pb.CancelTimerResponse(deliver_at_ms=at, topic=topic, queue_id=queue)
        return _handle(context, run)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        def run() -> pb.StatusResponse:
            st = self.store.status()
            return pb.StatusResponse(json=json.dumps(st), status=status_message.to_message(st))
        return _handle(context, run)

    # -- pop mode (DESIGN §12) -------------------------------------------------------------------
    async def Pop(self, request: pb.PopRequest, context: grpc.aio.ServicerContext) -> pb.PopResponse:
        return await _handle_async(context, lambda: self._pop(request))

    async def _pop(self, request: pb.PopRequest) -> pb.PopResponse:
        """Lease what is available; else wait (parked on the topic: one future, however many queues
        it has; no thread) until a queue of the topic grows or the next lease ends, at most
        ``max_wait_ms``. The answer is built in the read pool (decoding is a Python loop per message)."""
        loop = asyncio.get_running_loop()
        self.pops.check_group(request.group)
        self.pops.topic_queues(request.topic)
        wait_s = min(request.max_wait_ms, self.config["limits.pull_wait_ms_max"]) / 1000.0
        max_messages = request.max_messages or 32
        if request.decode:
            max_messages = min(max_messages, self.config["limits.pull_decoded_messages_max"])
        pop = functools.partial(self.pops.pop, request.group, request.topic, max_messages,
                                request.invisible_ms or 30_000, request.start_earliest,
                                current_caller().may("admin"))
        deadline = loop.time() + wait_s
        key = (request.topic, ANY_QUEUE)
        while True:
            parked = self.longpolls.park(key) if wait_s > 0 else None
            try:
                idle, wake_ms = self.pops.idle(request.group, request.topic)
                got: list[pb.PoppedRun] = []
                if not idle:
                    got, wake_ms = await loop.run_in_executor(self.read_pool, pop)
                left = deadline - loop.time()
                if got or parked is None or left <= 0 or self.store.closing:
                    small = sum(run.count for run in got) <= MESSAGES_ON_LOOP_MAX
                    return await self._heavy(request.as_runs or small, _pop_response, request, got)
                if wake_ms is not None:
                    left = min(left, max(0.001, wake_ms / 1000.0 - clock.wall_s()))
                await self.longpolls.wait(parked, left)
            finally:
                if parked is not None:
                    self.longpolls.unpark(key, parked)

    def Ack(self, request: pb.AckRequest, context: grpc.ServicerContext) -> pb.AckResponse:
        return _handle(context, lambda: pb.AckResponse(results=_handle_results(
            self.pops.ack(request.group, list(request.receipt_handles)))))

    def Nack(self, request: pb.NackRequest, context: grpc.ServicerContext) -> pb.NackResponse:
        return _handle(context, lambda: pb.NackResponse(results=_handle_results(
            self.pops.nack(request.group, list(request.receipt_handles), request.delay_ms))))

    def ChangeInvisible(self, request: pb.ChangeInvisibleRequest,
                        context: grpc.ServicerContext) -> pb.ChangeInvisibleResponse:
        return _handle(context, lambda: pb.ChangeInvisibleResponse(receipt_handle=self.pops.change_invisible(
            request.group, request.receipt_handle, request.invisible_ms)))


def _check_system_read(topic: str) -> None:
    """``__`` topics hold users' delayed messages (``__timer``) and every topic and group name
    (``__metadata``): reading them, their offsets or their description needs the system role."""
    if topic.startswith(system_records.SYSTEM_PREFIX) and not current_caller().may("system"):
        raise BrokerError("PERMISSION_DENIED", f"reading the system topic {shown(topic)} needs a token with the "
                          "system role")


def _pop_response(request: pb.PopRequest, runs: list[pb.PoppedRun]) -> pb.PopResponse:
    """Runs as leased (as_runs), or one message each: encoded records, or decoded (decode)."""
    if request.as_runs:
        return pb.PopResponse(runs=runs)
    messages = as_messages(runs)
    return pb.PopResponse(messages=plain.decode_popped(runs, messages) if request.decode else messages)


def _handle_results(results: list[tuple[str, int, str]]) -> list[pb.HandleResult]:
    return [pb.HandleResult(receipt_handle=h, code=code, message=msg) for h, code, msg in results]
