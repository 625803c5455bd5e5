"""The ``Broker`` service's data RPCs: Send, Pull, PullLocal, OffsetForTime, CommitOffset, GetOffset."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import grpc

from broker import metrics
from broker.daemon import plain
from broker.daemon.rpc.common import (
    ACK_NAMES,
    MESSAGES_ON_LOOP_MAX,
    READ_YOUR_WRITES_WAIT_S,
    SEND_ON_LOOP_BYTES_MAX,
    SEND_ON_LOOP_RECORDS_MAX,
    Rpcs,
    SendRequest,
    T,
    check_system_read,
    handle,
    handle_async,
)
from broker.daemon.rpc.transactions import begun_response, ended_response
from broker.daemon.send_wire import SendRequestView, begin_of, commit_of
from broker.daemon.wire import cut_answer, pull_response_bytes
from broker.errors import BrokerError, UnknownTopic, invalid, shown
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.logformat.txn_records import TXN_PID_BIT, is_txn_pid
from broker.ports import BatchReceipt, IncomingBatch
from broker.storage.failpoints import failpoint
from broker.store.appender import TxnAppend
from broker.store.reads import LocalPull, PullResult
from broker.txn.service import BeginPlan
from proto import tidemark_pb2 as pb


def check_transaction_send(request: SendRequest, beginning: bool = False) -> None:
    """A send inside a transaction: its batches carry the transaction's producer id (their
    sequences make it idempotent). Delayed messages are scheduled as always; the firing service
    holds them while the transaction is open and drops them if it aborts. A ``beginning`` send
    (SendRequest.begin) leaves every producer id 0: its transaction's is known once appended."""
    if beginning:
        # transaction TXN_PID_BIT: a node that does not know SendRequest.begin refuses the send
        # ("not open") instead of storing it as plain messages
        if request.transaction not in (0, TXN_PID_BIT) or request.producer_id or any(b.producer_id for b in request.batches):
            raise invalid("a send that begins a transaction leaves transaction 0 (or 1<<63) and every producer_id 0")
        return
    txn = request.transaction
    if not is_txn_pid(txn):
        raise invalid(f"transaction {txn:#x} is not a transaction's producer id (BeginTransactionResponse.producer_id, "
                      "SendResponse.begun.producer_id)")
    if request.producer_id and request.producer_id != txn:
        raise invalid("a send inside a transaction takes the transaction's producer id: leave producer_id 0")
    for i, b in enumerate(request.batches):
        if b.producer_id != txn:
            raise invalid(f"batch {i}: producer_id {b.producer_id:#x} is not the transaction's ({txn:#x})")


def check_commit_send(request: SendRequest, ending: pb.EndTransactionRequest,
                      begin: pb.BeginTransactionRequest | None, owner: str | None) -> None:
    """A send that commits its transaction (SendRequest.commit) names it and only commits.
    ``owner``: the transactional id of the open transaction the send names (None: not open)."""
    if not ending.commit:
        raise invalid("SendRequest.commit commits (commit true): abort with EndTransaction")
    if ending.offsets:
        raise invalid("a send's commit takes no consumer offsets: commit them with EndTransaction")
    if begin is not None:
        if ending.producer_id or ending.transactional_id != begin.transactional_id:
            raise invalid("a send that begins and commits its transaction names the begin's transactional_id "
                          "and producer_id 0 in its commit")
    elif request.transaction in (0, TXN_PID_BIT) or ending.producer_id != request.transaction:
        raise invalid("SendRequest.commit needs the send's transaction: producer_id equal to SendRequest.transaction "
                      "(or a SendRequest.begin)")
    elif owner is not None and owner != ending.transactional_id:
        raise invalid(f"transaction {request.transaction:#x} belongs to {shown(owner)}, not "
                      f"{shown(ending.transactional_id)}")


class DataRpcs(Rpcs):
    """Sends, pulls and consumer offsets."""

    async def Send(self, request: SendRequest, context: grpc.aio.ServicerContext) -> pb.SendResponse | bytes:
        return await handle_async(context, lambda: self._send(request))

    async def _send(self, request: SendRequest) -> pb.SendResponse | bytes:
        """Append on the event loop (like a topic create: one writev, ~0.5 ms a MiB, with the
        interpreter lock released), then wait for the acknowledgement as a parked future. A send
        in a pool thread paid two thread hops and the lock hand-offs of a waiting thread: 0.8x.
        A large send (``SEND_ON_LOOP_*``) is checked and appended in a pool thread instead."""
        started = time.perf_counter()
        if request.ack not in ACK_NAMES:
            raise invalid(f"unknown ack mode {request.ack}")
        if not request.batches and not request.messages:
            raise invalid("a send request needs at least one batch or message")
        # an uncounted transaction's send is answered as ack=replica whatever it asks: an answered send
        # survives a failover, so a commit on the next master never commits part of what its producer
        # sent. A counted one's commit checks its count instead (broker/txn/service.py).
        ack = ACK_NAMES[request.ack]
        asked = begin_of(request)
        if (asked is not None or commit_of(request) is not None) and self.store.placement is not None:
            raise BrokerError("FAILED_PRECONDITION", "in a cluster of shards a transaction begins with "
                              "BeginTransaction on its coordinator shard and ends with EndTransaction there "
                              "(docs/shards.md): SendRequest.begin and SendRequest.commit are refused")
        begin = (self.ctx.txns.begin_plan(asked.transactional_id, asked.timeout_ms, asked.check_back,
                                          asked.count_messages, asked.begin_id) if asked is not None else None)
        txn = request.transaction if begin is None else 0
        if txn or begin is not None:
            check_transaction_send(request, begin is not None)
        ending = commit_of(request)
        if ending is not None:  # whether its transaction is still open is decided under the append lock
            check_commit_send(request, ending, asked, self.store.appender.txn_owner(txn) if txn else None)
        elif txn:
            self.store.appender.check_txn_open(txn)  # a definite refusal, not a wait for a replica
        counted = begin.counted if begin is not None else bool(txn) and self.store.appender.txn_counted(txn)
        if ((txn or begin is not None) and not counted) or ending is not None:
            ack = "replica"  # a decision is answered once a promoted slave would know it
        if ack == "replica":
            self.store.watermarks.check_replica_ack_possible()
        # a framing walk stops at the declared record count, so declared counts bound the checks
        on_loop = sum(b.record_count for b in request.batches) + len(request.messages) <= SEND_ON_LOOP_RECORDS_MAX
        # plain messages in a transaction are idempotent when they carry sequences (else stored as sent);
        # a beginning send's producer id is known only under the append lock: TXN_PID_BIT stands in
        in_txn = txn or (TXN_PID_BIT if begin is not None else 0)
        producer_id = ((in_txn if any(m.HasField("sequence") for m in request.messages) else 0) if in_txn
                       else request.producer_id)
        plain_batches = await self._plain(request, producer_id) if request.messages else None
        batches = [
            IncomingBatch(system_records.TIMER_TOPIC, 0, b.records, b.record_count, b.records_crc, b.producer_id,
                          b.base_sequence, timer_target=(b.topic, b.queue_id))
            if b.delayed else
            IncomingBatch(b.topic, b.queue_id, b.records, b.record_count, b.records_crc, b.producer_id, b.base_sequence)
            for b in request.batches
        ] + (plain_batches.batches if plain_batches is not None else [])
        await self._check_shard(batches)
        if counted and any(b.base_sequence == bf.NO_SEQUENCE for b in batches):
            # a retried send stored twice would make up in the count for one a failover lost
            raise invalid("a counted transaction's sends are idempotent: give each plain message a queue_id and a "
                          "sequence (batches: base_sequence >= 0), or begin it without count_messages")
        if txn:
            for b in batches:
                b.producer_id = txn
                b.flags |= bf.FLAG_TRANSACTIONAL
        records_bytes = sum(len(b.records) for b in batches)
        on_loop = on_loop and records_bytes <= SEND_ON_LOOP_BYTES_MAX
        begun, ended = None, None
        try:
            if begin is not None or ending is not None:
                done = await self._append_in_txn(on_loop, batches, begin, ending)
                if done.not_open:
                    return await self._ended_before(done, begin, ending)
                receipts, wait_offset = done.receipts, done.wait_offset
                if begin is not None:
                    begun = begin.begun(done.begun)
                    if begin.ack(done.begun) == "replica":  # it fenced an older instance (or was retried)
                        ack = "replica"
                ended = self.ctx.txns.decided(done.ended)
            else:
                receipts, wait_offset = await self._on_loop_or_pool(on_loop, self.store.appender.append, batches)
        except BrokerError:
            metrics.SEND_REQUESTS.labels("refused").inc()
            raise
        # a commit is answered once replicated; a read_committed pull waits for the transactions view
        # to apply it (_read_your_writes), not the committing producer
        await self.store.writes.acknowledged_async(wait_offset, ack, timeout_ms=request.timeout_ms,
                                                   what="the transaction's commit")
        if ending is not None:
            failpoint("txn_after_decision")
        metrics.SEND_REQUESTS.labels("ok").inc()
        metrics.SEND_SECONDS.labels(ack).observe(time.perf_counter() - started)
        metrics.SEND_MESSAGES.inc(sum(r.record_count for r in receipts if not r.duplicate))
        metrics.SEND_BYTES.inc(records_bytes)
        n = len(request.batches)
        receipts_wire = (await self._heavy(len(request.messages) <= SEND_ON_LOOP_RECORDS_MAX, plain.receipts_wire,
                                           plain_batches, receipts[n:])
                         if plain_batches is not None and plain_batches.layout is not None else None)
        if plain_batches is None or receipts_wire is not None:
            response = _send_response(request, receipts, None)
        else:
            response = await self._heavy(len(request.messages) <= MESSAGES_ON_LOOP_MAX, _send_response, request,
                                         receipts, plain_batches)
        if begun is not None:
            response.begun.CopyFrom(begun_response(begun))
        if ending is not None:  # None: not expected (openness is checked under the lock, the id above)
            response.ended.CopyFrom(ended_response(ended) if ended is not None else
                                    await self._first_outcome(ending, begun.pid if begun else txn))
        # the message receipts' wire bytes follow the rest: a parser takes fields in any order
        return response if receipts_wire is None else response.SerializeToString() + receipts_wire

    async def _plain(self, request: SendRequest, producer_id: int) -> plain.Encoded:
        """The request's plain messages framed into batches: by the C path (on the loop for a request
        of at most ``SEND_ON_LOOP_BYTES_MAX`` and ``SEND_ON_LOOP_RECORDS_MAX`` messages: ~0.4 us each),
        else in Python; each in a pool thread when large (``_heavy``); a topic unknown here is
        NOT_FOUND only once etcd agrees (a node of a cluster of shards: UNAVAILABLE while its copy
        trails)."""
        wire = request.wire if isinstance(request, SendRequestView) else None
        try:
            if wire is not None:
                small = len(wire) <= SEND_ON_LOOP_BYTES_MAX and len(request.messages) <= SEND_ON_LOOP_RECORDS_MAX
                done = await self._heavy(small, plain.encode_native, wire, producer_id, self._queues_of)
                if done is not None:
                    return done
            return await self._heavy(len(request.messages) <= MESSAGES_ON_LOOP_MAX, plain.encode, request.messages,
                                     producer_id, self._queues_of)
        except UnknownTopic as exc:
            placement = self.store.placement
            if placement is not None:
                await placement.confirm_unknown((exc.topic,))  # unknown to the copy too: etcd's word
                placement.check_in_log(exc.topic, confirm=False)  # placed, its create not yet in the log
            raise

    async def _check_shard(self, batches: list[IncomingBatch]) -> None:
        """In a cluster of shards: every batch for a queue this node's shard writes."""
        placement = self.store.placement
        if placement is not None:
            targets = [b.timer_target or (b.topic, b.queue_id) for b in batches]
            await placement.confirm_unknown(t for t, _ in targets)
            for topic, queue in targets:
                placement.check_queue(topic, queue, confirm=False)

    async def _append_in_txn(self, on_loop: bool, batches: list[IncomingBatch], begin: BeginPlan | None,
                             ending: pb.EndTransactionRequest | None) -> TxnAppend:
        end = self.ctx.txns.commit_build(ending.transactional_id, ending.messages_sent) if ending is not None else None
        return await self._on_loop_or_pool(on_loop, functools.partial(
            self.store.appender.append_in_txn, batches, begin=begin.build if begin is not None else None,
            rejoin=begin.rejoin if begin is not None else None, end=end))

    async def _ended_before(self, done: TxnAppend, begin: BeginPlan | None,
                            ending: pb.EndTransactionRequest | None) -> pb.SendResponse:
        """A committing send, or a retried beginning one, whose transaction had ended when it reached
        the append lock: nothing of it was stored. A commit answers how it ended (a retry whose
        first attempt committed), with the transaction's ``begun`` if it began it."""
        if ending is None:
            raise BrokerError("FAILED_PRECONDITION", f"transaction {done.pid:#x} is not open: this retried "
                              "beginning send's first attempt began it, and it has ended since (committed, "
                              "aborted or timed out); nothing of this send was stored")
        response = pb.SendResponse(ended=await self._first_outcome(ending, done.pid))
        if begin is not None:
            response.begun.CopyFrom(begun_response(begin.begun([])))
        return response

    async def _first_outcome(self, ending: pb.EndTransactionRequest, pid: int) -> pb.EndTransactionResponse:
        """How a transaction a committing send found not open ended (as a retried end answers)."""
        return ended_response(await self.ctx.txns.end_async(ending.transactional_id, pid, True,
                                                            messages_sent=ending.messages_sent))

    async def _on_loop_or_pool(self, on_loop: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` right here on the loop, or (work that would hold the loop, and every other
        call, too long) in a pool thread."""
        if on_loop:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.read_pool, fn, *args)

    def _queues_of(self, topic: str) -> int | None:
        """The topic's queue count: the log's, else (a node of a cluster of shards whose log does not
        hold the create yet) etcd's placement, so that a queue of another shard is refused naming
        its owner (``_check_shard``) rather than UNAVAILABLE until this shard catches up."""
        info = self.store.views.metadata.topic(topic)
        if info is not None:
            return int(info["queues"])
        placement = self.store.placement
        return placement.queue_count(topic) if placement is not None else None

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> bytes:
        """Answers wire bytes of a PullResponse (see broker/daemon/wire.py: no copy of the log bytes).

        The read runs in the read pool; a pull that finds nothing parks a future (longpoll.py) and
        holds no thread until its queue grows or ``max_wait_ms`` passes."""
        return await handle_async(context, lambda: self._pull(request, local=False))

    async def PullLocal(self, request: pb.PullLocalRequest, context: grpc.aio.ServicerContext) -> pb.PullLocalResponse:
        """A pull answered with where its batches lie in this node's segment files, for a reader on
        this host that reads them itself (broker/storage/instance.py); the same checks as Pull."""
        return await handle_async(context, lambda: self._pull(request, local=True))

    async def _pull(self, request: pb.PullRequest | pb.PullLocalRequest, *, local: bool) -> Any:
        loop = asyncio.get_running_loop()
        check_system_read(request.topic)
        if self.store.placement is not None:  # the shard of the queue's segment holding the offset
            await self.store.placement.confirm_unknown((request.topic,))
            self.store.placement.check_read(request.topic, request.queue_id, request.offset, confirm=False)
        max_messages = min(request.max_messages or 1000, self.config["limits.pull_messages_max"])
        if isinstance(request, pb.PullRequest) and request.decode:
            max_messages = min(max_messages, self.config["limits.pull_decoded_messages_max"])
        max_bytes = min(request.max_bytes or self.config["limits.pull_bytes_max"], self.config["limits.pull_bytes_max"])
        wait_s = min(request.max_wait_ms, self.config["limits.pull_wait_ms_max"]) / 1000.0
        reads = self.store.reads
        read: Callable[[], PullResult | LocalPull] = functools.partial(
            reads.pull_spans if local else reads.pull, request.topic, request.queue_id, request.offset, max_messages,
            max_bytes, 0, request.isolation != pb.ISOLATION_READ_UNCOMMITTED)
        key = (request.topic, request.queue_id)
        deadline = loop.time() + wait_s
        await self._read_your_writes(request.topic, request.queue_id, request.offset, max_messages,
                                     request.isolation != pb.ISOLATION_READ_UNCOMMITTED)
        while True:
            async with self.longpolls.parking(key, wait_s > 0) as parked:
                r = await loop.run_in_executor(self.read_pool, read)
                left = deadline - loop.time()
                # aborted transactions' offsets passed: answered at once, so the reader moves on
                if r.count or r.next_offset != request.offset or wait_s <= 0 or left <= 0 or self.store.closing:
                    if isinstance(request, pb.PullRequest) and request.decode:
                        return await self._decoded_answer(request, r)
                    return self._pull_answer(request, r)
                await self.longpolls.wait(parked, left)

    async def _decoded_answer(self, request: pb.PullRequest, r: PullResult | LocalPull) -> Any:
        """A decoded pull's answer: by the C path (~0.1 us a message), on the loop for at most
        ``SEND_ON_LOOP_BYTES_MAX`` of batches, else in a pool thread (``_heavy``: it lets go of
        the interpreter lock while it copies); in Python (``_pull_answer``) if it leaves it."""
        if isinstance(r, PullResult):
            small = sum(len(b) for b in r.batches) <= SEND_ON_LOOP_BYTES_MAX
            answer = await self._heavy(small, _decoded_wire, r)
            if answer is not None:
                return answer
        return await self._heavy(r.count <= MESSAGES_ON_LOOP_MAX, self._pull_answer, request, r)

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
        blobs, skip_first = cut_answer(r.batches, r.skip_first, r.count, request.topic, request.queue_id)
        return pull_response_bytes(blobs, skip_first=skip_first, count=r.count, next_offset=r.next_offset,
                                   min_offset=r.min_offset, max_offset=r.max_offset)

    async def _read_your_writes(self, topic: str, queue_id: int, offset: int, max_messages: int,
                                committed: bool) -> None:
        """A pull that could take more than the queue view holds of its queue, while records of that
        queue were appended beyond it and the view lags the confirm offset, first waits (at most
        ``READ_YOUR_WRITES_WAIT_S``) for the view to apply what is confirmed now: a send
        acknowledged before the pull began is confirmed, and must be in the answer (not missed,
        nor an offset from its receipt refused as beyond the end) however far the view's apply
        lags. The same for a read_committed pull of a queue held back by a transaction whose
        decision the transactions view has not applied yet (``store/decisions.py``): a commit
        answered before the pull began is confirmed, and what it made visible must be in the
        answer. Costs nothing when the views are current, the queue view holds all the pull may
        take or all this queue has, and no ended transaction holds the queue back."""
        confirmed = self.store.watermarks.confirm_offset
        if self.store.closing:
            return
        queues = self.store.views.queues
        if queues.applied_offset < confirmed:
            qf = queues.queue(topic, queue_id)
            have = qf.next_queue_offset if qf is not None else 0
            if offset + max_messages > have and self.store.appender.queue_end_hint(topic, queue_id) > have:
                await self.store.dispatcher.wait_applied_async(queues, confirmed, READ_YOUR_WRITES_WAIT_S)
        if committed:
            await self.store.decisions.settle_async([(topic, queue_id)])

    def OffsetForTime(self, request: pb.OffsetForTimeRequest, context: grpc.ServicerContext) -> pb.OffsetForTimeResponse:
        def run() -> pb.OffsetForTimeResponse:
            check_system_read(request.topic)
            return pb.OffsetForTimeResponse(
                offset=self.store.reads.offset_for_time(request.topic, request.queue_id, request.timestamp_ms))
        return handle(context, run)

    def CommitOffset(self, request: pb.CommitOffsetRequest, context: grpc.ServicerContext) -> pb.CommitOffsetResponse:
        def run() -> pb.CommitOffsetResponse:
            self.store.check_writable()
            # answered once durable: the commit is in a confirmed record (commitSync semantics)
            self.groups.commit(self.groups.checked_offsets(request.offsets))
            return pb.CommitOffsetResponse()
        return handle(context, run)

    def GetOffset(self, request: pb.GetOffsetRequest, context: grpc.ServicerContext) -> pb.GetOffsetResponse:
        def run() -> pb.GetOffsetResponse:
            self.groups.check_coordinator(request.group)
            self.groups.check_queue(request.topic, request.queue_id)  # NOT_FOUND / INVALID_ARGUMENT
            value = self.store.offsets.get(request.group, request.topic, request.queue_id)
            if value is None:
                value = self.store.views.metadata.committed_offset(request.group, request.topic, request.queue_id)
            return pb.GetOffsetResponse(found=value is not None, offset=value or 0)
        return handle(context, run)


def _decoded_wire(r: PullResult) -> bytes | None:
    """A decoded pull's answer as wire bytes, by the C path; None when it leaves it to Python."""
    head = pull_response_bytes([], skip_first=0, count=r.count, next_offset=r.next_offset, min_offset=r.min_offset,
                               max_offset=r.max_offset)
    return plain.decode_wire(r.batches, r.skip_first, r.count, head)


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
