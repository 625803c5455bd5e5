"""Threads parked until an offset (a watermark, a view's applied offset) reaches their target.

One shared ``Condition`` wakes every waiter at every move: with many requests in flight (eight
concurrent topic creates, say) each fsync or dispatch round woke all of them, each took the lock
and the interpreter lock only to find it had to wait on. Here each waiter parks on a lock of its
own and is released only when the offset reached its target (``wake``), or when everyone must look
again (``wake_all``: stop, shutdown). A woken waiter re-checks its whole condition and parks again
if something else is still missing (e.g. a replica's ack besides the confirm offset).

Coroutines on the server's event loop wait the same way without a thread (``wait_async``): their
waiter is a future, released with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable


class OffsetWaiters:
    """Waiters keyed by target offset; ``wake(value)`` releases those with target <= value."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heap: list[tuple[int, int, Callable[[], None]]] = []  # (target, tie-break, releases the waiter)
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
            entry = (target, next(self._seq), token.release)
            with self._lock:
                heapq.heappush(self._heap, entry)
            if done():
                self._discard(entry)
                return True
            left = deadline - time.monotonic()
            if left <= 0 or not token.acquire(timeout=left):
                self._discard(entry)
                return done()

    async def wait_async(self, done: Callable[[], bool], target: int, timeout_s: float) -> bool:
        """``wait`` for a coroutine: the event loop goes on serving while it waits."""
        if done():
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            woken: asyncio.Future[None] = loop.create_future()
            release: Callable[[], None] = functools.partial(_release, loop, woken)
            entry = (target, next(self._seq), release)
            with self._lock:
                heapq.heappush(self._heap, entry)
            if done():
                self._discard(entry)
                return True
            left = deadline - loop.time()
            if left > 0:
                try:
                    await asyncio.wait((woken,), timeout=left)
                except asyncio.CancelledError:  # the call was cancelled: leave nothing parked
                    self._discard(entry)
                    raise
            if not woken.done():
                self._discard(entry)
                return done()
            if done():
                return True

    def wake(self, value: int) -> None:
        """Release every waiter whose target is at or below ``value``."""
        with self._lock:
            while self._heap and self._heap[0][0] <= value:
                heapq.heappop(self._heap)[2]()

    def wake_all(self) -> None:
        with self._lock:
            heap, self._heap = self._heap, []
        for _, _, release in heap:
            release()

    @property
    def parked(self) -> int:
        with self._lock:
            return len(self._heap)

    def _discard(self, entry: tuple[int, int, Callable[[], None]]) -> None:
        """Forget a waiter that returned by itself (rare: a timeout, or done before parking)."""
        with self._lock:
            try:
                self._heap.remove(entry)
            except ValueError:
                return  # already woken and popped
            heapq.heapify(self._heap)


def _release(loop: asyncio.AbstractEventLoop, woken: asyncio.Future[None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody waits any more
        loop.call_soon_threadsafe(_resolve, woken)


def _resolve(woken: asyncio.Future[None]) -> None:
    if not woken.done():  # a waiter that timed out meanwhile
        woken.set_result(None)
