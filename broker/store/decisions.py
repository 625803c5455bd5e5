"""Transactions decided in the log that the transactions view has not applied yet.

A producer's begin and commit are answered once replicated, not once the transactions view (the
LSO's source) applied them (issue 37's throughput). A reader that starts after the answer must
still see what it decided: each read that bounds by the LSO asks here whether a transaction
holding one of its queues back has already ended on the append side (its decision is in the log,
confirmed once answered) and, only then, waits for the view to apply the confirm offset. A
transaction that is still open costs a reader no wait.
"""

from __future__ import annotations

from collections.abc import Iterable

from broker.store.appender import Appender
from broker.store.dispatcher import Dispatcher
from broker.store.viewset import ViewSet
from broker.store.watermarks import Watermarks

QueueKey = tuple[str, int]
WAIT_S = 2.0  # a reader waits at most this long for the view


class Decisions:
    def __init__(self, appender: Appender, views: ViewSet, watermarks: Watermarks, dispatcher: Dispatcher) -> None:
        self.appender = appender
        self.views = views
        self.watermarks = watermarks
        self.dispatcher = dispatcher

    def pending(self, keys: Iterable[QueueKey]) -> int:
        """The offset the view must reach for these queues' readers (0: none to wait for). The
        append side's open set is read without its lock: a membership test, and it only ever
        moves forward to what the log holds."""
        confirmed = self.watermarks.confirm_offset
        txns = self.views.txns
        if txns.applied_offset >= confirmed:
            return 0
        open_now = self.appender.tail.txn_open
        for key in keys:
            if any(pid not in open_now for pid in txns.holders(key)):
                return confirmed
        return 0

    def settle(self, keys: Iterable[QueueKey]) -> None:
        """Until the view knows every decision a reader of ``keys`` starting now must see (bounded)."""
        target = self.pending(keys)
        if target:
            self.dispatcher.wait_applied(self.views.txns, target, WAIT_S)

    async def settle_async(self, keys: Iterable[QueueKey]) -> None:
        target = self.pending(keys)
        if target:
            await self.dispatcher.wait_applied_async(self.views.txns, target, WAIT_S)

    def caught_up(self, master: bool) -> None:
        """Until the view applied the last ``__txn`` batch this node holds (an operator's look: a
        begin or end answered before it is in what it sees). A master waits for its own last one
        (a counted begin is answered at ack=leader, before it is confirmed); any other node only
        up to its confirm offset, which is all its view ever applies."""
        end = self.appender.tail.txn_end
        target = end if master else min(end, self.watermarks.confirm_offset)
        if target > self.views.txns.applied_offset:
            self.dispatcher.wait_applied(self.views.txns, target, WAIT_S)
