"""The ``Broker`` service's transaction RPCs (DESIGN §14): BeginTransaction, EndTransaction,
ListTransactions, DescribeTransaction, AbortTransaction and the TransactionChecks stream.

Begin and a client's end run on the event loop (their append is one short write; the waits for the
``__txn`` record's ack and application park a future); an end with consumer offsets runs in a
thread (it waits for older offset commits first). The check-back stream is a coroutine on the loop;
the answers it receives end transactions in the read pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from broker import clock
from broker.daemon.rpc.common import Rpcs, handle, handle_async
from broker.errors import BrokerError, invalid, shown
from broker.logformat import txn_records as tr
from broker.txn.checks import CheckStream
from broker.txn.service import Begun, Outcome, check_tid
from broker.views.transactions import Ended, OpenTxn
from proto import tidemark_pb2 as pb

DECISIONS = {"commit": True, "abort": False}


def begun_response(begun: Begun) -> pb.BeginTransactionResponse:
    return pb.BeginTransactionResponse(producer_id=begun.pid, epoch=begun.epoch, timeout_ms=begun.timeout_ms,
                                       counted=begun.counted)


def ended_response(outcome: Outcome) -> pb.EndTransactionResponse:
    return pb.EndTransactionResponse(
        outcome=pb.TRANSACTION_OUTCOME_COMMITTED if outcome.committed else pb.TRANSACTION_OUTCOME_ABORTED,
        reason=outcome.reason)


def transaction_info(t: OpenTxn | Ended) -> pb.TransactionInfo:
    now = clock.wall_ms()
    if isinstance(t, OpenTxn):
        queues = [pb.TransactionQueue(topic=topic, queue_id=q, first_offset=runs[0][0])
                  for (topic, q), runs in sorted(t.runs.items())]
        return pb.TransactionInfo(transactional_id=t.tid, producer_id=t.pid, state="open",
                                  age_ms=max(0, now - t.begun_ms),
                                  write_age_ms=max(0, now - t.first_write_ms) if t.first_write_ms else 0,
                                  timeout_ms=t.timeout_ms, queues=queues)
    return pb.TransactionInfo(transactional_id=t.tid, producer_id=t.pid,
                              state="committed" if t.committed else "aborted", age_ms=max(0, now - t.begun_ms),
                              reason=t.reason)


class TransactionRpcs(Rpcs):
    """Transactions: begin, end, look, abort, check back."""

    # Begin and a client's end without offsets run on the event loop: one short append under the
    # append lock, then the ack parks a future, not a thread (issue 37's throughput)
    async def BeginTransaction(self, request: pb.BeginTransactionRequest,
                               context: grpc.aio.ServicerContext) -> pb.BeginTransactionResponse:
        async def run() -> pb.BeginTransactionResponse:
            if await self._check_coordinator(request.transactional_id, request.coordinator, request.group):
                return pb.BeginTransactionResponse(shard=request.coordinator)  # the group's offsets go there
            begun = await self.ctx.txns.begin_async(request.transactional_id, request.timeout_ms, request.check_back,
                                                    request.count_messages, request.begin_id, request.coordinator,
                                                    request.coordinator_epoch)
            response = begun_response(begun)
            if self.store.placement is not None:
                response.shard = self.store.placement.shard
            return response
        return await handle_async(context, run)

    async def EndTransaction(self, request: pb.EndTransactionRequest,
                             context: grpc.aio.ServicerContext) -> pb.EndTransactionResponse:
        async def run() -> pb.EndTransactionResponse:
            self.store.check_writable()
            if request.participants:  # over shards: prepare each participant, decide, deliver (a pool thread)
                return await asyncio.get_running_loop().run_in_executor(self.read_pool, self._end_over_shards,
                                                                        request)
            if request.commit and request.offsets:  # offsets wait for older offset commits: a pool thread
                return await asyncio.get_running_loop().run_in_executor(self.read_pool, self._end_with_offsets,
                                                                        request)
            outcome = await self.ctx.txns.end_async(request.transactional_id, request.producer_id, request.commit,
                                                    messages_sent=request.messages_sent)
            if self.store.placement is not None:  # an abort over shards: its participants told now, not next round
                self.ctx.over_shards.kick.set()
            return ended_response(outcome)
        return await handle_async(context, run)

    def _end_with_offsets(self, request: pb.EndTransactionRequest) -> pb.EndTransactionResponse:
        offsets = self.groups.checked_offsets(request.offsets)
        self.groups.check_room(offsets, request.producer_id)
        return ended_response(self.ctx.txns.end(request.transactional_id, request.producer_id, True, offsets,
                                        messages_sent=request.messages_sent))

    async def _check_coordinator(self, tid: str, coordinator: str, group: str) -> bool:
        """In a cluster of shards a transaction begins on its coordinator shard (its transactional
        id's slot, as a group's), refused elsewhere naming it; a participant's begin anywhere, or
        with ``group`` on the group's coordinator shard. True: that is the coordinator shard itself
        (nothing to begin)."""
        placement = self.store.placement
        if placement is None:
            if coordinator or group:
                raise BrokerError("FAILED_PRECONDITION", "this node is not in a cluster of shards: no transaction "
                                  "here is a participant of another shard's")
            return False
        check_tid(tid)
        if group and not coordinator:
            raise invalid("group: only with coordinator (a participant transaction for a group's offsets)")
        if group or not coordinator:
            name = group or tid
            if placement.knows_group(name):
                placement.check_group(name)
            else:  # its slot is given a shard first: an etcd write, off the loop
                await asyncio.get_running_loop().run_in_executor(self.read_pool, placement.check_group, name)
        if coordinator == placement.shard:
            if group:  # the group's offsets go with the coordinator's own transaction: nothing begins
                return True
            raise invalid(f"a participant transaction on its own coordinator shard {shown(coordinator)}: send "
                          "there within the coordinator's transaction")
        if group or not coordinator:
            placement.check_groups_open({group or tid})  # a slot moving away begins nothing new
        return False

    def _check_coordinates(self, tid: str) -> None:
        """Over shards a transactional id is described and aborted on its coordinator shard (the
        others hold only its participants): refused elsewhere naming it (blocks: a slot not given yet)."""
        check_tid(tid)
        if self.store.placement is not None:
            self.store.placement.check_group(tid)

    def _end_over_shards(self, request: pb.EndTransactionRequest) -> pb.EndTransactionResponse:
        tid, pid = request.transactional_id, request.producer_id
        # each participant's offsets are checked there, when it prepares
        parties = tuple(tr.Party(p.shard, p.producer_id, p.messages_sent,
                                 tuple((o.group, o.topic, o.queue_id, o.offset) for o in p.offsets))
                        for p in request.participants)
        if not request.commit:
            return ended_response(self.ctx.txns.end(tid, pid, False))
        offsets = self.groups.checked_offsets(request.offsets)
        self.groups.check_room(offsets, pid)
        return ended_response(self.ctx.over_shards.commit(tid, pid, request.messages_sent, offsets, parties))

    def AddTransactionParticipant(self, request: pb.AddTransactionParticipantRequest,
                                  context: grpc.ServicerContext) -> pb.AddTransactionParticipantResponse:
        def run() -> pb.AddTransactionParticipantResponse:
            self.store.check_writable()
            p = request.participant
            if not p.shard or not tr.is_txn_pid(p.producer_id):
                raise invalid("participant: a shard and its transaction's producer id")
            placement = self.store.placement
            if placement is None:
                raise BrokerError("FAILED_PRECONDITION", "this node is not in a cluster of shards: a transaction has "
                                  "no participants here")
            if p.shard == placement.shard:
                raise invalid(f"participant shard {shown(p.shard)}: another shard of this node's cluster")
            self.ctx.txns.add_participant(request.transactional_id, request.producer_id, tr.Party(p.shard, p.producer_id))
            return pb.AddTransactionParticipantResponse()
        return handle(context, run)

    def PrepareTransaction(self, request: pb.PrepareTransactionRequest,
                           context: grpc.ServicerContext) -> pb.PrepareTransactionResponse:
        def run() -> pb.PrepareTransactionResponse:
            self.store.check_writable()
            offsets = self.groups.checked_offsets(request.offsets)
            self.groups.check_room(offsets, request.producer_id)
            ended = self.ctx.txns.prepare(request.transactional_id, request.producer_id, request.messages_sent)
            if ended is None or ended.committed:  # committed: the decision reached it before a retried prepare
                return pb.PrepareTransactionResponse(prepared=True)
            return pb.PrepareTransactionResponse(prepared=False, reason=ended.reason or "aborted")
        return handle(context, run)

    def DecideTransaction(self, request: pb.DecideTransactionRequest,
                          context: grpc.ServicerContext) -> pb.DecideTransactionResponse:
        def run() -> pb.DecideTransactionResponse:
            self.store.check_writable()
            # checked when it prepared: a decision is applied as it comes
            offsets = [(o.group, o.topic, o.queue_id, o.offset) for o in request.offsets] if request.commit else []
            outcome = self.ctx.txns.decide(request.transactional_id, request.producer_id, request.commit, offsets)
            return pb.DecideTransactionResponse(
                outcome=pb.TRANSACTION_OUTCOME_COMMITTED if outcome.committed else pb.TRANSACTION_OUTCOME_ABORTED,
                reason=outcome.reason)
        return handle(context, run)

    def ListTransactions(self, request: pb.ListTransactionsRequest,
                         context: grpc.ServicerContext) -> pb.ListTransactionsResponse:
        def run() -> pb.ListTransactionsResponse:
            return pb.ListTransactionsResponse(
                transactions=[transaction_info(t) for t in self.ctx.txns.open_transactions()])
        return handle(context, run)

    def DescribeTransaction(self, request: pb.DescribeTransactionRequest,
                            context: grpc.ServicerContext) -> pb.DescribeTransactionResponse:
        def run() -> pb.DescribeTransactionResponse:
            self._check_coordinates(request.transactional_id)
            return pb.DescribeTransactionResponse(transaction=transaction_info(self.ctx.txns.describe(request.transactional_id)))
        return handle(context, run)

    def AbortTransaction(self, request: pb.AbortTransactionRequest,
                         context: grpc.ServicerContext) -> pb.AbortTransactionResponse:
        def run() -> pb.AbortTransactionResponse:
            self._check_coordinates(request.transactional_id)
            return pb.AbortTransactionResponse(transaction=transaction_info(self.ctx.txns.abort_by_operator(request.transactional_id)))
        return handle(context, run)

    async def TransactionChecks(self, requests: AsyncIterator[pb.TransactionCheckAnswer],
                                context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TransactionCheck]:
        """Questions to the producer about its transactions past their timeout, its answers back."""
        try:
            self.store.check_writable()
            stream = self.ctx.checks.open()
        except BrokerError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), exc.message)
            return
        reader = asyncio.ensure_future(self._answers(requests, stream))
        try:
            while True:
                get = asyncio.ensure_future(stream.queue.get())
                await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    failure = reader.exception()
                    if isinstance(failure, BrokerError):
                        await context.abort(getattr(grpc.StatusCode, failure.code), failure.message)
                    break
                question = get.result()
                if question is None:
                    break
                yield pb.TransactionCheck(transactional_id=question.tid, producer_id=question.pid,
                                          attempt=question.attempt)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self.ctx.checks.close(stream)

    async def _answers(self, requests: AsyncIterator[pb.TransactionCheckAnswer], stream: CheckStream) -> None:
        loop = asyncio.get_running_loop()
        async for answer in requests:
            if not isinstance(answer, pb.TransactionCheckAnswer):
                raise invalid("a TransactionCheckAnswer that does not decode")
            for tid in answer.transactional_ids:
                check_tid(tid)
            if answer.transactional_ids:
                self.ctx.checks.register(stream, list(answer.transactional_ids))
            if not answer.producer_id:
                continue
            if answer.decision == "unknown":
                continue  # asked again at the next interval
            if answer.decision not in DECISIONS:
                raise invalid(f"decision {answer.decision!r}: commit, abort or unknown")
            check_tid(answer.transactional_id)
            await loop.run_in_executor(self.read_pool, self._decide, answer)

    def _decide(self, answer: pb.TransactionCheckAnswer) -> None:
        # ended meanwhile (by a timeout, an operator, a newer instance): the first outcome stands
        with contextlib.suppress(BrokerError):
            self.ctx.txns.end(answer.transactional_id, answer.producer_id, DECISIONS[answer.decision], reason="check")
