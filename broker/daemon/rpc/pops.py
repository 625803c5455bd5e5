"""The ``Broker`` service's pops RPCs: Pop, Ack, Nack, ChangeInvisible."""

from __future__ import annotations

import asyncio
import functools
from typing import NamedTuple

import grpc

from broker import clock, metrics
from broker.daemon import plain
from broker.daemon.combine import Combiner
from broker.daemon.longpoll import ANY_QUEUE
from broker.daemon.rpc.common import (
    MESSAGES_ON_LOOP_MAX,
    SEND_ON_LOOP_BYTES_MAX,
    Context,
    Rpcs,
    handle,
    handle_async,
)
from broker.daemon.wire import cut_answer, field_parts, varint
from broker.errors import BrokerError
from broker.groups import receipts
from broker.groups.lease_ends import EndResult
from broker.groups.pops import LeasedRun, as_messages
from broker.security.auth import current_caller
from proto import tidemark_pb2 as pb

# Pops (or acks) of one group and topic served by one pass and one record, at most
POPS_COMBINED_MAX = 64
ACKS_COMBINED_MAX = 64


class Popped(NamedTuple):
    """One pop's part of a combined run."""

    runs: list[LeasedRun]
    wake_ms: int | None  # answered empty: when a lease ends
    others_got: bool  # the run leased messages (to other pops, if this one has none)
    acked: EndResult  # what the acks it carried got


class PopTerms(NamedTuple):
    """What pops must share to be served together."""

    group: str
    topic: str
    invisible_ms: int
    start_earliest: bool
    may_create_dlq: bool
    committed: bool
    carrying: bool  # acks: a pop carrying none never waits on (or fails with) another's acks


class PopRpcs(Rpcs):
    """Pop mode: leases, acks, nacks, changed leases (DESIGN §12). Pops of one group and topic
    with the same lease terms, and acks of one group, that arrive while one runs are served
    together by the next (``combine.py``): one pass and one ``__pop`` record for all of them
    (pops carrying acks: one ``pop.ack`` and one ``pop.lease`` record, in one append)."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._pops: Combiner[PopTerms, tuple[int, list[str] | None], Popped] = Combiner(self._pop_many, POPS_COMBINED_MAX, self._give_back)
        self._acks: Combiner[str, list[str], EndResult] = Combiner(self._ack_many,
                                                                                                   ACKS_COMBINED_MAX)

    async def Pop(self, request: pb.PopRequest, context: grpc.aio.ServicerContext) -> pb.PopResponse | bytes:
        return await handle_async(context, lambda: self._pop(request))

    async def _pop(self, request: pb.PopRequest) -> pb.PopResponse | bytes:
        """A pop, and the acks it carries (``ack_receipt_handles``): ended in the pop's own pass
        (their record is appended with its lease record, one durable wait for both; on an idle
        topic, alone), durable before it answers. Handles refused (a lease that ended, or a
        malformed one: INVALID_ARGUMENT for all) are in ``ack_results``, beside the pop's
        messages; a pass that fails before the acks are written fails the pop and its acks alike
        (retry both: an ack done already answers FAILED_PRECONDITION, acked)."""
        self.pops.check_group(request.group)
        await self._check_placed(request.topic)
        self.pops.topic_queues(request.topic)  # a pop refused at once carries no ack out
        if not request.ack_receipt_handles:
            return (await self._pop_leases(request))[0]
        self.store.check_writable()
        handles = list(request.ack_receipt_handles)
        answer, _, acked = await self._pop_leases(request, handles)
        results = _ack_results(handles, acked)
        if not results:
            return answer
        if isinstance(answer, bytes):  # a parser takes fields in any order
            return answer + pb.PopResponse(ack_results=results).SerializeToString()
        answer.ack_results.extend(results)
        return answer

    async def _pop_leases(self, request: pb.PopRequest, carried: list[str] | None = None
                          ) -> tuple[pb.PopResponse | bytes, list[LeasedRun], EndResult]:
        """Lease what is available; else wait (parked on the topic: one future, however many queues
        it has; no thread) until a queue of the topic grows or the next lease ends, at most
        ``max_wait_ms``. ``carried``: acks ended by the first pass, before any wait. The answer,
        the runs it holds, and what the acks got (the group and topic checked by ``_pop``)."""
        loop = asyncio.get_running_loop()
        wait_s = min(request.max_wait_ms, self.config["limits.pull_wait_ms_max"]) / 1000.0
        max_messages = request.max_messages or 32
        if request.decode:
            max_messages = min(max_messages, self.config["limits.pull_decoded_messages_max"])
        terms = PopTerms(request.group, request.topic, request.invisible_ms or 30_000, request.start_earliest,
                         current_caller().may("admin"), request.isolation != pb.ISOLATION_READ_UNCOMMITTED, bool(carried))
        deadline = loop.time() + wait_s
        looked_again = False
        key = (request.topic, ANY_QUEUE)
        acked: EndResult = []
        while True:
            async with self.longpolls.parking(key, wait_s > 0) as parked:
                idle, wake_ms = self.pops.idle(request.group, request.topic)
                got: list[LeasedRun] = []
                if not idle or carried:
                    popped = await self._pops.call(terms, (max_messages, carried))
                    got, wake_ms, others_got = popped.runs, popped.wake_ms, popped.others_got
                    if carried:
                        acked, carried, terms = popped.acked, None, terms._replace(carrying=False)
                    if not got and others_got and (loop.time() < deadline or not looked_again):
                        looked_again = True
                        continue  # the pops served with this one took what was found: look again at once
                left = deadline - loop.time()
                if got or wait_s <= 0 or left <= 0 or self.store.closing:
                    return await self._pop_answer(request, got), got, acked
                if wake_ms is not None:
                    left = min(left, max(0.001, wake_ms / 1000.0 - clock.wall_s()))
                await self.longpolls.wait(parked, left)

    async def _check_placed(self, topic: str) -> None:
        """In a cluster of shards: a topic this node does not know yet is NOT_FOUND only once etcd
        agrees; one etcd places and this shard's log does not hold yet is UNAVAILABLE (just created
        elsewhere: retry), as for sends and pulls (replication/unknown_topics.py)."""
        placement = self.store.placement
        if placement is not None:
            await placement.confirm_unknown((topic,))
            placement.check_in_log(topic, confirm=False)

    async def _pop_answer(self, request: pb.PopRequest, got: list[LeasedRun]) -> pb.PopResponse | bytes:
        """The answer: runs as they are, or messages written by the C path (on the loop, for at most
        ``SEND_ON_LOOP_BYTES_MAX`` of batches; else in a pool thread), or by Python (``_heavy``)."""
        if request.as_runs:
            return _runs_wire(request.topic, got)
        small = sum(len(b) for run in got for b in run.batches) <= SEND_ON_LOOP_BYTES_MAX
        wire = await self._heavy(small, _popped_wire, got, request.decode)
        if wire is not None:
            return wire
        return await self._heavy(sum(run.count for run in got) <= MESSAGES_ON_LOOP_MAX, _pop_response, request, got)

    async def _pop_many(self, t: PopTerms, asks: list[tuple[int, list[str] | None]]) -> list[Popped]:
        metrics.POP_RUNS.labels("pop").inc()
        metrics.POP_RUN_CALLS.labels("pop").inc(len(asks))
        if t.carrying:  # (every pop of the run carries acks, or none does)
            metrics.POP_RUN_CALLS.labels("carried").inc(len(asks))
        done = await asyncio.get_running_loop().run_in_executor(
            self.read_pool, functools.partial(self.pops.pop_many, t.group, t.topic, [n for n, _ in asks], t.invisible_ms,
                                              t.start_earliest, t.may_create_dlq, t.committed,
                                              [h or [] for _, h in asks] if t.carrying else None))
        some = any(done.outs)
        acked = done.acked or [[] for _ in asks]
        return [Popped(out, done.wake_ms, some, a) for out, a in zip(done.outs, acked, strict=True)]

    async def _give_back(self, t: PopTerms, unclaimed: list[Popped]) -> None:
        """Leases of pops whose callers gave up while they were served end at once (a nack, no
        delay): their messages are delivered again now, not after ``invisible_ms``."""
        for popped in unclaimed:  # one call each: each is within a call's limits
            await self._nack_now(t.group, popped.runs)

    async def _nack_now(self, group: str, runs: list[LeasedRun]) -> None:
        """End these leases at once (a nack, no delay): delivered again now."""
        handles = [run.receipt_handle for run in runs]
        if handles:
            await asyncio.get_running_loop().run_in_executor(self.ctx.ends_pool, self.pops.nack, group, handles, 0)

    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.AckResponse:
        async def run() -> pb.AckResponse:
            self.pops.check_group(request.group)
            refused = await self._acks.call(request.group, list(request.receipt_handles))
            assert not isinstance(refused, BrokerError)  # the combiner raises a call's own error
            return pb.AckResponse(results=_handle_results(refused))
        return await handle_async(context, run)

    async def _ack_many(self, group: str, calls: list[list[str]]) -> list[EndResult]:
        """Acks of one group in one record; each call gets the refusals of its own handles."""
        metrics.POP_RUNS.labels("ack").inc()
        metrics.POP_RUN_CALLS.labels("ack").inc(len(calls))
        return await asyncio.get_running_loop().run_in_executor(self.ctx.ends_pool, self.pops.ack_many, group, calls)

    def Nack(self, request: pb.NackRequest, context: grpc.ServicerContext) -> pb.NackResponse:
        return handle(context, lambda: pb.NackResponse(results=_handle_results(
            self.pops.nack(request.group, list(request.receipt_handles), request.delay_ms))))

    def ChangeInvisible(self, request: pb.ChangeInvisibleRequest,
                        context: grpc.ServicerContext) -> pb.ChangeInvisibleResponse:
        return handle(context, lambda: pb.ChangeInvisibleResponse(receipt_handle=self.pops.change_invisible(
            request.group, request.receipt_handle, request.invisible_ms)))


def _runs_wire(topic: str, runs: list[LeasedRun]) -> bytes:
    """``PopResponse.runs`` as wire bytes, each run's batches joined in once (as ``pull_response_bytes``
    does for a pull): no copy into a ``PoppedRun`` and another into the response first. Each run
    carries only its records: its first and last batches cut to them (``cut_run``)."""
    parts: list[bytes | memoryview] = []
    for r in runs:
        blobs, skip_first = cut_answer(r.batches, r.skip_first, r.count, topic, r.queue_id)
        head = pb.PoppedRun(queue_id=r.queue_id, first_offset=r.first_offset, count=r.count,
                            delivery_count=r.delivery_count, receipt_handle=r.receipt_handle,
                            skip_first=skip_first).SerializeToString()
        fields = [head]
        for blob in blobs:
            fields += field_parts(_BATCH_TAG, blob)
        parts += (_RUNS_TAG, varint(sum(len(f) for f in fields)), *fields)
    return b"".join(parts)


_RUNS_TAG = b"\x12"  # PopResponse.runs: field 2, length-delimited
_BATCH_TAG = b"\x32"  # PoppedRun.batches: field 6, length-delimited


def _popped_wire(runs: list[LeasedRun], decode: bool) -> bytes | None:
    """``PopResponse.messages`` as wire bytes by the C path (``_plainwire.popped``, a run at a
    time); None when it leaves them to ``as_messages`` / ``plain.decode_popped``."""
    if plain.native is None:
        return None
    parts = []
    for r in runs:
        lease, topic = receipts.lease_of(r.receipt_handle), r.receipt_handle.split(".", 2)[2]
        part = plain.native.popped(list(r.batches), r.skip_first, r.count, r.queue_id, r.delivery_count, lease.encode(),
                                   topic.encode(), decode)
        if part is None:
            return None
        parts.append(part)
    return b"".join(parts)


def _pop_response(request: pb.PopRequest, runs: list[LeasedRun]) -> pb.PopResponse:
    """One message each: encoded records, or decoded (decode); in Python."""
    messages = as_messages(runs)
    return pb.PopResponse(messages=plain.decode_popped(runs, messages) if request.decode else messages)


def _ack_results(handles: list[str], acked: EndResult) -> list[pb.HandleResult]:
    """A pop's carried acks' results: the refused handles, or, when a handle was malformed, every
    handle with that refusal (INVALID_ARGUMENT), as it would refuse an Ack call."""
    if not isinstance(acked, BrokerError):
        return _handle_results(acked)
    code = getattr(grpc.StatusCode, acked.code, grpc.StatusCode.INVALID_ARGUMENT).value[0]
    return [pb.HandleResult(receipt_handle=h, code=code, message=acked.message) for h in handles]


def _handle_results(results: list[tuple[str, int, str]]) -> list[pb.HandleResult]:
    return [pb.HandleResult(receipt_handle=h, code=code, message=msg) for h, code, msg in results]
