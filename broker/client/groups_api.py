"""The client's API, consumer groups: subscribe mode, pop mode and their operator views (DESIGN §12)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Self, cast

from broker.client.consumer import BrokerClient as ConsumerClient
from broker.client.consumer import Consumer
from broker.client.core import ClientCore, _request
from broker.client.data_api import isolation_of
from broker.client.messages import PoppedMessage, PopResult
from proto import tidemark_pb2 as pb


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
        resp = self._call("ListGroups", pb.ListGroupsRequest())
        return [{"name": g.name, "members": g.members, "topics": list(g.topics), "lag": g.lag} for g in resp.groups]

    def describe_group(self, group: str) -> dict[str, Any]:
        """Members and their queues, and per queue: committed offset, end, lag, owner, pop leases."""
        g = self._call("DescribeGroup", _request(pb.DescribeGroupRequest, group=group)).group
        return {
            "name": g.name, "generation": g.generation, "rebalances": g.rebalances,
            "dlq_messages": g.dlq_messages, "redeliveries": g.redeliveries,
            "members": [{"member_id": m.member_id, "client_id": m.client_id, "topics": list(m.topics),
                         "assigned": [(r.topic, r.queue_id) for r in m.assigned],
                         "session_timeout_ms": m.session_timeout_ms, "last_heartbeat_ms_ago": m.last_heartbeat_ms_ago}
                        for m in g.members],
            "queues": [{"topic": q.topic, "queue_id": q.queue_id,
                        "committed_offset": q.committed_offset if q.has_committed else None,
                        "end_offset": q.end_offset, "lag": q.lag, "owner": q.owner, "in_flight": q.in_flight,
                        "pop_offset": q.pop_offset} for q in g.queues],
        }

    def reset_offsets(self, group: str, topic: str, to: str) -> dict[int, int]:
        """Commit new offsets for every queue of ``topic``: ``to`` is ``earliest``, ``latest``,
        ``time:MS`` or ``offset:N``. Refused (FAILED_PRECONDITION) while the group has live members.
        Returns queue id -> the offset committed."""
        kind, _, value = to.partition(":")
        kinds = {"earliest": pb.RESET_TO_EARLIEST, "latest": pb.RESET_TO_LATEST, "time": pb.RESET_TO_TIME, "offset": pb.RESET_TO_OFFSET}
        if kind not in kinds or (kind in ("time", "offset")) != bool(value) or (value and not value.lstrip("-").isdigit()):
            raise ValueError(f"reset target must be earliest, latest, time:MS or offset:N, got {to!r}")
        resp = self._call("ResetOffsets", _request(pb.ResetOffsetsRequest, group=group, topic=topic, to=kinds[kind],
                                                   value=int(value or 0)), retry=False)
        return {o.queue_id: o.offset for o in resp.offsets}

    def pop(self, group: str, topic: str, max_messages: int = 32, invisible_ms: int = 30_000, max_wait_ms: int = 0,
            *, start: str = "latest", isolation: str = "read_committed") -> PopResult:
        """Lease up to ``max_messages`` of ``topic`` for ``group``, from any of its queues: each comes
        back (``delivery_count`` + 1) after ``invisible_ms`` unless acked; ``max_wait_ms``: wait this
        long for one. A new group starts at ``start`` (``latest`` or ``earliest``). ``isolation``:
        ``read_committed`` leases transactions' messages once committed and never aborted ones;
        ``read_uncommitted`` leases whatever is in the queue (use one isolation per group)."""
        if start not in ("latest", "earliest"):
            raise ValueError(f"start must be 'latest' or 'earliest', got {start!r}")
        req = _request(pb.PopRequest, group=group, topic=topic, max_messages=max_messages, invisible_ms=invisible_ms,
                       max_wait_ms=max_wait_ms, start_earliest=start == "earliest", as_runs=True,
                       isolation=isolation_of(isolation))
        resp = self._call("Pop", req, timeout_s=self.timeout_s + max_wait_ms / 1000.0)
        return PopResult(topic, resp)

    def ack(self, group: str, messages: PopResult | Sequence[PoppedMessage | str] | PoppedMessage | str) -> dict[str, str]:
        """End these leases for good (one call, one record). Returns the handles that could not be
        acked, with the reason: a lease that expired or was nacked (the message is or will be
        delivered again), or one an ack had already ended ("the message was acked": it is done; after
        an UNAVAILABLE this call is retried, and an earlier attempt whose answer was lost may have
        acked it); for a whole ``PopResult``, the handles of its runs in which some message could not be."""
        return self._end("Ack", pb.AckRequest, group, messages)

    def nack(self, group: str, messages: PopResult | Sequence[PoppedMessage | str] | PoppedMessage | str,
             delay_ms: int = 0) -> dict[str, str]:
        """Give these leases back: delivered again after ``delay_ms``. Returns refusals as ``ack``."""
        return self._end("Nack", pb.NackRequest, group, messages, delay_ms=delay_ms)

    def _end(self, method: str, request_type: Any, group: str, messages: Any, **fields: Any) -> dict[str, str]:
        if isinstance(messages, PopResult):
            handles = messages.receipt_handles()
        else:
            items = [messages] if isinstance(messages, (str, PoppedMessage)) else list(messages)
            handles = [m if isinstance(m, str) else m.receipt_handle for m in items]
        resp = self._call(method, _request(request_type, group=group, receipt_handles=handles, **fields))
        return {r.receipt_handle: r.message for r in resp.results if r.code != 0}

    def change_invisible(self, group: str, message: PoppedMessage | str, invisible_ms: int) -> str:
        """Extend (or shorten) one lease to ``invisible_ms`` from now; returns its new receipt handle
        (also set on ``message``); the old one stops working."""
        handle = message if isinstance(message, str) else message.receipt_handle
        resp = self._call("ChangeInvisible", _request(pb.ChangeInvisibleRequest, group=group, receipt_handle=handle,
                                                       invisible_ms=invisible_ms), retry=False)
        if isinstance(message, PoppedMessage):
            message.receipt_handle = resp.receipt_handle
        return str(resp.receipt_handle)
