"""Threads parked until an offset (a watermark, a view's applied offset) reaches their target.

One shared ``Condition`` wakes every waiter at every move: with many requests in flight (eight
concurrent topic creates, say) each fsync or dispatch round woke all of them, each took the lock
and the interpreter lock only to find it had to wait on. Here each waiter parks on a lock of its
own and is released only when the offset reached its target (``wake``), or when everyone must look
again (``wake_all``: stop, shutdown). A woken waiter re-checks its whole condition and parks again
if something else is still missing (e.g. a replica's ack besides the confirm offset).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable


class OffsetWaiters:
    """Waiters keyed by target offset; ``wake(value)`` releases those with target <= value."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heap: list[tuple[int, int, threading.Lock]] = []  # (target, tie-break, the waiter's lock)
        self._seq = itertools.count()

    def wait(self, done: Callable[[], bool], target: int, timeout_s: float) -> bool:
        """Park until ``done()`` holds (True) or ``timeout_s`` passed (False). ``done`` is checked
        after registering, so a ``wake`` between the check and the park is never missed."""
        if done():
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            token = threading.Lock()
            token.acquire()
            entry = (target, next(self._seq), token)
            with self._lock:
                heapq.heappush(self._heap, entry)
            if done():
                self._discard(entry)
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not token.acquire(timeout=left):
                self._discard(entry)
                return done()

    def wake(self, value: int) -> None:
        """Release every waiter whose target is at or below ``value``."""
        with self._lock:
            while self._heap and self._heap[0][0] <= value:
                heapq.heappop(self._heap)[2].release()

    def wake_all(self) -> None:
        with self._lock:
            heap, self._heap = self._heap, []
        for _, _, token in heap:
            token.release()

    @property
    def parked(self) -> int:
        with self._lock:
            return len(self._heap)

    def _discard(self, entry: tuple[int, int, threading.Lock]) -> None:
        """Forget a waiter that returned by itself (rare: a timeout, or done before parking)."""
        with self._lock:
            try:
                self._heap.remove(entry)
            except ValueError:
                return  # already woken and popped
            heapq.heapify(self._heap)
