"""The pop service's locks: one per (group, topic, queue), striped, each settled on the view.

A call on a queue holds its lock while it decides and appends, and first waits until the pop view
has applied the last record of ours that touched the queue (the whole log, the first time in an
epoch): so two calls of one group never lease the same message. When the queue has records its
view has not applied yet, it waits for what is confirmed now: a pop sees every send acknowledged
before it began, as a pull does. Striped: bounded memory however
many groups strangers name, and one Lock object per key for the process's life (pruning a dict
of locks could hand two threads different locks for one key).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator

from broker.errors import BrokerError
from broker.store import Store
from broker.views.pop_leases import PopLeaseView

QueueKey = tuple[str, str, int]  # (group, topic, queue): the unit of pop, ack and their locks
LOCK_STRIPES = 1024
KEYS_MAX = 100_000  # entries of the per-queue bookkeeping before it is cleared


class QueueLocks:
    def __init__(self, store: Store, view: PopLeaseView, on_appended: Callable[[Iterable[QueueKey]], None]) -> None:
        """``on_appended``: told which queues a record of ours touched (the idle cache forgets them)."""
        self.store = store
        self.view = view
        self.on_appended = on_appended
        self._stripes = [threading.Lock() for _ in range(LOCK_STRIPES)]
        self._last_end: dict[QueueKey, tuple[int, int]] = {}  # (epoch, end of our last record)

    def lock(self, key: QueueKey) -> threading.Lock:
        return self._stripes[self.stripe(key)]

    @staticmethod
    def stripe(key: QueueKey) -> int:
        return hash(key) % LOCK_STRIPES

    @contextlib.contextmanager
    def holding(self, keys: Iterable[QueueKey]) -> Iterator[set[int]]:
        """Hold the locks of these queues (each stripe once, in stripe order: no deadlock), settled;
        yields the stripes held (another queue of one of them is held too, but not settled)."""
        keys = set(keys)
        stripes = {self.stripe(k) for k in keys}
        taken: list[threading.Lock] = []
        try:
            for i in sorted(stripes):
                self._stripes[i].acquire()
                taken.append(self._stripes[i])
            self.settle(sorted(keys))
            yield stripes
        finally:
            for lock in reversed(taken):
                lock.release()

    def settle(self, keys: Iterable[QueueKey]) -> None:
        """With the queues' locks held: the view has applied every record of ours that touched them
        (all of the log, for a queue without a record from this master in this epoch)."""
        self.store.check_writable()
        epoch = self.store.epoch
        confirmed = self.store.watermarks.confirm_offset
        target = 0
        for k in keys:
            last = self._last_end.get(k)
            if last is None or last[0] != epoch:
                target = self.store.log.max_offset
                break
            target = max(target, last[1])
            # a send acknowledged before this call, or a commit answered before it: the pop sees it
            if self._behind(k) or self.store.decisions.pending([(k[1], k[2])]):
                target = max(target, confirmed)
        if not self.store.dispatcher.wait_applied(self.view, target, self.store.config["limits.send_timeout_ms"] / 1000.0):
            raise BrokerError("UNAVAILABLE", "pop state is not caught up with the log yet; retry")

    def _behind(self, key: QueueKey) -> bool:
        """The append side holds records of the queue that its view has not applied yet."""
        _, topic, queue = key
        qf = self.store.views.queues.queue(topic, queue)
        return self.store.appender.queue_end_hint(topic, queue) > (qf.next_queue_offset if qf is not None else 0)

    def appended(self, keys: Iterable[QueueKey], end: int) -> None:
        """With the queues' locks held: our record touching them ends at ``end``."""
        keys = list(keys)
        if len(self._last_end) > KEYS_MAX:
            self._last_end.clear()  # the next call of each queue settles on the whole log
        epoch = self.store.epoch
        for k in keys:
            self._last_end[k] = (epoch, end)
        self.on_appended(keys)
