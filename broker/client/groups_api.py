"""The client's API, consumer groups: subscribe mode, pop mode and their operator views (DESIGN §12)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Self, cast

import grpc

from broker.client import group_merge
from broker.client.consumer import BrokerClient as ConsumerClient
from broker.client.consumer import Consumer
from broker.client.core import ClientCore, _request
from broker.client.data_api import isolation_of
from broker.client.errors import BrokerError, NotFound, error_for
from broker.client.messages import PoppedMessage, PopResult
from proto import tidemark_pb2 as pb

POP_WAIT_SLICE_MS = 500  # a cluster of shards: a waiting pop waits this long on one shard, then the next
POP_SHARD_TIMEOUT_S = 3.0  # ... and gives a shard this long to answer before trying the others


def _popped(resp: pb.PopResponse) -> int:
    return sum(r.count for r in resp.runs) + len(resp.messages)


class GroupsAPI(ClientCore):
    """Consumer groups: subscribe mode, pop mode and their operator views (DESIGN §12)."""

    def clone(self) -> Self:
        """A new client with the same addresses and options, on a channel of its own."""
        return type(self)(list(self.addresses), **self._options)

    def consumer(self, group: str, topics: Sequence[str] | str, *, session_timeout_ms: int = 10_000,
                 auto_offset_reset: str = "latest", max_poll_interval_ms: int = 300_000,
                 max_messages: int = 1000, client_id: str | None = None,
                 on_assigned: Callable[[set[tuple[str, int]]], None] | None = None,
                 on_revoked: Callable[[set[tuple[str, int]]], None] | None = None,
                 isolation: str = "read_committed") -> Consumer:
        """A subscribe-mode member of ``group``: the master shares the topics' queues among the
        group's members (see ``broker/client/consumer.py``). Use it as a context manager."""
        client = cast(ConsumerClient, self)  # BrokerClient, which is every area of the API
        return Consumer(client, group, [topics] if isinstance(topics, str) else list(topics),
                        session_timeout_ms=session_timeout_ms, auto_offset_reset=auto_offset_reset,
                        max_poll_interval_ms=max_poll_interval_ms, max_messages=max_messages, client_id=client_id,
                        on_assigned=on_assigned, on_revoked=on_revoked, isolation=isolation)

    def list_groups(self) -> list[dict[str, Any]]:
        """Every group with live members, committed offsets or pop state: name, members, topics, lag."""
        if not self.sharded:
            resp = self._call("ListGroups", pb.ListGroupsRequest())
            return [{"name": g.name, "members": g.members, "topics": list(g.topics), "lag": g.lag} for g in resp.groups]
        # a cluster of shards: each shard lists the groups it coordinates (with the committed offsets
        # of other shards' queues, whose lag is added from those shards' ends) and those with pop
        # leases on its queues
        self._learn_routes([])
        answers, failure = [], None
        for shard in self._routes.shards():
            try:
                answers.append(self._shard_core(shard)._call("ListGroups", pb.ListGroupsRequest()))
            except BrokerError as exc:  # a shard between masters: the others' groups are listed
                failure = exc
        if not answers and failure is not None:
            raise failure

        def ends() -> dict[str, list[int]]:  # each queue's stable end, from its own shard
            try:
                return {t: list(info["stable_offsets"]) for t, info in cast(Any, self).list_topics().items()}
            except BrokerError:  # a shard between masters: those queues' lag is left out
                return {}
        return group_merge.merge_listed(answers, ends)

    def describe_group(self, group: str) -> dict[str, Any]:
        """Members and their queues, and per queue: committed offset, end, lag, owner, pop leases;
        ``shard``: the coordinating shard in a cluster of shards ('' otherwise)."""
        req = _request(pb.DescribeGroupRequest, group=group)
        g = self._describe_sharded(group) if self.sharded else self._call("DescribeGroup", req).group
        return {
            "name": g.name, "shard": g.shard, "generation": g.generation, "rebalances": g.rebalances,
            "dlq_messages": g.dlq_messages, "redeliveries": g.redeliveries,
            "members": [{"member_id": m.member_id, "client_id": m.client_id, "topics": list(m.topics),
                         "assigned": [(r.topic, r.queue_id) for r in m.assigned],
                         "session_timeout_ms": m.session_timeout_ms, "last_heartbeat_ms_ago": m.last_heartbeat_ms_ago}
                        for m in g.members],
            "queues": [{"topic": q.topic, "queue_id": q.queue_id,
                        "committed_offset": q.committed_offset if q.has_committed else None,
                        "end_offset": q.end_offset, "lag": q.lag, "owner": q.owner, "in_flight": q.in_flight,
                        "pop_offset": q.pop_offset, "shard": q.shard} for q in g.queues],
        }

    def _describe_sharded(self, group: str) -> pb.GroupDescription:
        """The coordinator's description, each other shard's part folded in (``group_merge``). A
        queue whose shard did not answer keeps ``shard`` set: its end and lag are not known."""
        req = _request(pb.DescribeGroupRequest, group=group)
        try:
            desc = self._coordinated(group, lambda core: core._call("DescribeGroup", req)).group
        except NotFound:
            desc = pb.GroupDescription(name=group, shard=self._routes.group_shard(group) or "")
        asked = group_merge.asked_of(desc)
        self._learn_routes([])
        heres = []
        for shard in self._routes.shards():
            if shard == desc.shard:
                continue
            here = _request(pb.DescribeGroupRequest, group=group, here_only=True, queues=asked.get(shard, []))
            try:
                heres.append(self._shard_core(shard)._call("DescribeGroup", here).group)
            except BrokerError:  # that shard is between masters: its queues stay unknown (shard set)
                continue
        out = group_merge.merge_described(desc, heres)
        if not out.members and not out.queues:
            raise error_for(grpc.StatusCode.NOT_FOUND, f"group {group!r} has no members, no committed offsets and no "
                            "pop state on any shard")
        return out

    def reset_offsets(self, group: str, topic: str, to: str) -> dict[int, int]:
        """Commit new offsets for every queue of ``topic``: ``to`` is ``earliest``, ``latest``,
        ``time:MS`` or ``offset:N``. Refused (FAILED_PRECONDITION) while the group has live members.
        Returns queue id -> the offset committed."""
        kind, _, value = to.partition(":")
        kinds = {"earliest": pb.RESET_TO_EARLIEST, "latest": pb.RESET_TO_LATEST, "time": pb.RESET_TO_TIME, "offset": pb.RESET_TO_OFFSET}
        if kind not in kinds or (kind in ("time", "offset")) != bool(value) or (value and not value.lstrip("-").isdigit()):
            raise ValueError(f"reset target must be earliest, latest, time:MS or offset:N, got {to!r}")
        elsewhere = self._reset_targets(topic, kind, int(value or 0)) if self.sharded else {}
        req = _request(pb.ResetOffsetsRequest, group=group, topic=topic, to=kinds[kind], value=int(value or 0),
                       queue_offsets=elsewhere)
        resp = self._coordinated(group, lambda core: core._call("ResetOffsets", req, retry=False))
        return {o.queue_id: o.offset for o in resp.offsets}

    def _reset_targets(self, topic: str, kind: str, value: int) -> dict[int, int]:
        """A cluster of shards: each queue's reset offset, resolved on the queue's own shard (the
        coordinator resolves its own queues itself and takes these for the others'). A shard that
        does not answer fails the reset: never another node's zeros."""
        owners = self._routes.queues(topic)
        if owners is None:
            self._learn_routes([topic])
            owners = self._routes.queues(topic)
        if owners is None:
            raise error_for(grpc.StatusCode.NOT_FOUND, f"topic {topic!r} does not exist")
        request = _request(pb.DescribeTopicRequest, name=topic)
        out: dict[int, int] = {}
        for shard in sorted(set(owners)):
            for q in self._shard_core(shard)._call("DescribeTopic", request).queues:
                if q.queue_id >= len(owners) or owners[q.queue_id] != shard:
                    continue
                low, high = int(q.min_offset), int(q.max_offset)
                if kind == "earliest":
                    out[q.queue_id] = low
                elif kind == "latest":
                    out[q.queue_id] = high
                elif kind == "time":
                    out[q.queue_id] = cast(Any, self).offset_for_time(topic, q.queue_id, value)
                else:
                    out[q.queue_id] = min(max(value, low), high)
        return out

    def pop(self, group: str, topic: str, max_messages: int = 32, invisible_ms: int = 30_000, max_wait_ms: int = 0,
            *, start: str = "latest", isolation: str = "read_committed",
            ack: PopResult | Sequence[PoppedMessage | str] | None = None) -> PopResult:
        """Lease up to ``max_messages`` of ``topic`` for ``group``, from any of its queues: each comes
        back (``delivery_count`` + 1) after ``invisible_ms`` unless acked; ``max_wait_ms``: wait this
        long for one. A new group starts at ``start`` (``latest`` or ``earliest``). ``isolation``:
        ``read_committed`` leases transactions' messages once committed and never aborted ones;
        ``read_uncommitted`` leases whatever is in the queue (use one isolation per group).
        ``ack``: what an earlier pop leased and the consumer is done with, acked in this same call
        (a consumer loop's ``pop(..., ack=previous)``: one call and one round trip instead of two);
        the result's ``ack_failures`` is what ``ack`` would have returned."""
        if start not in ("latest", "earliest"):
            raise ValueError(f"start must be 'latest' or 'earliest', got {start!r}")
        req = _request(pb.PopRequest, group=group, topic=topic, max_messages=max_messages, invisible_ms=invisible_ms,
                       max_wait_ms=max_wait_ms, start_earliest=start == "earliest", as_runs=True,
                       isolation=isolation_of(isolation))
        if not self.sharded:
            if ack is not None:
                req.ack_receipt_handles.extend(_handles(ack))
            result = PopResult(topic, self._call("Pop", req, timeout_s=self.timeout_s + max_wait_ms / 1000.0))
            result.ack_failures = {r.receipt_handle: r.message for r in result.ack_results if r.code != 0}
            return result
        failures = self.ack(group, ack) if ack is not None else {}  # each lease's own shard ends it
        result = PopResult(topic, self._pop_sharded(topic, req))
        result.ack_failures = failures
        return result

    def _pop_sharded(self, topic: str, req: pb.PopRequest) -> pb.PopResponse:
        """Pop leases stay with each queue's shard: ask the topic's shards in turn (from a rotating
        start) until ``max_messages`` are leased; with nothing anywhere, wait on one shard at a time
        (``POP_WAIT_SLICE_MS`` each) until ``max_wait_ms`` passes. A shard that fails (between
        masters) is skipped and doubted for a moment: the others' leases are returned; only when
        every shard failed and nothing was leased is the failure raised. One that had no master when
        the routes were learnt is skipped until they are asked again, now and then, for its master."""
        owners = self._routes.queues(topic)
        if owners is None:
            self._learn_routes([topic])
            owners = self._routes.queues(topic)
        if owners is None:  # not placed: the node answers NOT_FOUND (or pops a system topic)
            return self._call("Pop", req, timeout_s=self.timeout_s + req.max_wait_ms / 1000.0)
        # with the shards of moved queues' old segments: they serve the pop windows begun there
        shards = sorted({*owners, *(seg[0] for q in range(len(owners)) for seg in self._routes.segments(topic, q))})
        start = next(self._pop_turn) % len(shards)
        shards = shards[start:] + shards[:start]
        out = pb.PopResponse()
        deadline = time.monotonic() + req.max_wait_ms / 1000.0
        want = req.max_messages or 32
        failure: BrokerError | None = None
        while True:
            self._ask_masters(topic, shards)
            asked = [s for s in shards if self._routes.trusted(s)] or shards
            for shard in asked:
                ask = pb.PopRequest()
                ask.CopyFrom(req)
                ask.max_messages, ask.max_wait_ms = want - _popped(out), 0
                try:
                    resp = self._shard_core(shard)._call("Pop", ask, timeout_s=POP_SHARD_TIMEOUT_S)
                except BrokerError as exc:
                    self._routes.doubt(shard)
                    failure = exc
                    continue
                out.runs.extend(resp.runs)
                out.messages.extend(resp.messages)
                if _popped(out) >= want:
                    return out
            left_ms = int((deadline - time.monotonic()) * 1000)
            if _popped(out) or left_ms <= 0:
                if not _popped(out) and failure is not None and len(asked) == len(shards) and \
                        all(not self._routes.trusted(s) for s in shards):
                    raise failure
                return out
            ask = pb.PopRequest()
            ask.CopyFrom(req)
            ask.max_wait_ms = min(left_ms, POP_WAIT_SLICE_MS)
            waiter = asked[0]
            try:
                resp = self._shard_core(waiter)._call("Pop", ask, timeout_s=POP_SHARD_TIMEOUT_S + ask.max_wait_ms / 1000.0)
            except BrokerError as exc:
                self._routes.doubt(waiter)
                failure = exc
                resp = pb.PopResponse()
            if resp.runs or resp.messages:
                return resp
            shards = shards[1:] + shards[:1]

    def ack(self, group: str, messages: PopResult | Sequence[PoppedMessage | str] | PoppedMessage | str) -> dict[str, str]:
        """End these leases for good (one call; acks that reach the master together share one
        record). Returns the handles that could not be acked, with the reason: a lease that expired
        or was nacked (the message is or will be delivered again), or one an ack had already ended
        ("the message was acked": it is done; after
        an UNAVAILABLE this call is retried, and an earlier attempt whose answer was lost may have
        acked it); for a whole ``PopResult``, the handles of its runs in which some message could not be."""
        return self._end("Ack", pb.AckRequest, group, messages)

    def nack(self, group: str, messages: PopResult | Sequence[PoppedMessage | str] | PoppedMessage | str,
             delay_ms: int = 0) -> dict[str, str]:
        """Give these leases back: delivered again after ``delay_ms``. Returns refusals as ``ack``."""
        return self._end("Nack", pb.NackRequest, group, messages, delay_ms=delay_ms)

    def _end(self, method: str, request_type: Any, group: str, messages: Any, **fields: Any) -> dict[str, str]:
        handles = _handles(messages)
        if not self.sharded:
            resp = self._call(method, _request(request_type, group=group, receipt_handles=handles, **fields))
            return {r.receipt_handle: r.message for r in resp.results if r.code != 0}
        by_shard: dict[str | None, list[str]] = {}  # each lease ends on the shard of its queue's segment
        for h in handles:
            where = group_merge.queue_of_handle(h)
            by_shard.setdefault(self._shard_of(*where) if where is not None else None, []).append(h)
        out: dict[str, str] = {}
        for shard, mine in by_shard.items():
            try:
                resp = self._shard_core(shard)._call(method, _request(request_type, group=group, receipt_handles=mine,
                                                                       **fields))
            except BrokerError as exc:  # this shard's handles are not known to have ended; the others' are
                out.update(dict.fromkeys(mine, f"not {method.lower()}ed: shard {shard!r} did not answer ({exc}); "
                                               "retry them"))
                continue
            out.update({r.receipt_handle: r.message for r in resp.results if r.code != 0})
        return out

    def change_invisible(self, group: str, message: PoppedMessage | str, invisible_ms: int) -> str:
        """Extend (or shorten) one lease to ``invisible_ms`` from now; returns its new receipt handle
        (also set on ``message``); the old one stops working."""
        handle = message if isinstance(message, str) else message.receipt_handle
        where = group_merge.queue_of_handle(handle) if self.sharded else None
        core = self._shard_core(self._shard_of(*where)) if where is not None else self
        resp = core._call("ChangeInvisible", _request(pb.ChangeInvisibleRequest, group=group, receipt_handle=handle,
                                                      invisible_ms=invisible_ms), retry=False)
        if isinstance(message, PoppedMessage):
            message.receipt_handle = resp.receipt_handle
        return str(resp.receipt_handle)


def _handles(messages: PopResult | Sequence[PoppedMessage | str] | PoppedMessage | str) -> list[str]:
    """The receipt handles naming ``messages``: one a run for a whole ``PopResult``."""
    if isinstance(messages, PopResult):
        return messages.receipt_handles()
    items = [messages] if isinstance(messages, (str, PoppedMessage)) else list(messages)
    return [m if isinstance(m, str) else m.receipt_handle for m in items]
