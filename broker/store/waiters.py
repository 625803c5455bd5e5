"""Threads parked until an offset (a watermark, a view's applied offset) reaches their target.

One shared ``Condition`` wakes every waiter at every move: with many requests in flight (eight
concurrent topic creates, say) each fsync or dispatch round woke all of them, each took the lock
and the interpreter lock only to find it had to wait on. Here each waiter parks on a lock of its
own and is released only when the offset reached its target (``wake``), or when everyone must look
again (``wake_all``: stop, shutdown). A woken waiter re-checks its whole condition and parks again
if something else is still missing (e.g. a replica's ack besides the confirm offset).

Coroutines on the server's event loop wait the same way without a thread (``wait_async``): their
waiter is a future, released with ``call_soon_threadsafe``.

A wait made of several (an acknowledgement, then a view applying the write) is written once, as a
generator of ``Park``s (``Steps``): it yields what to wait for and receives whether it came; it
returns its result or raises. ``run`` drives it in a thread, ``run_async`` on the event loop: one
loop for both kinds of caller, never a sync and an async copy of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
_Entry = tuple[int, int, "threading.Lock | asyncio.Future[bool]"]  # (target, tie-break, what releases the waiter)


class OffsetWaiters:
    """Waiters keyed by target offset; ``wake(value)`` releases those with target <= value."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._heap: list[_Entry] = []
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
            entry: _Entry = (target, next(self._seq), token)
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
        """``wait`` for a coroutine: the event loop goes on serving while it waits. Its waiter is a
        future; the timeout is a timer on the loop that resolves it with False."""
        if done():
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            woken: asyncio.Future[bool] = loop.create_future()
            entry: _Entry = (target, next(self._seq), woken)
            with self._lock:
                heapq.heappush(self._heap, entry)
            if done():
                self._discard(entry)
                return True
            left = deadline - loop.time()
            if left <= 0:
                self._discard(entry)
                return done()
            timer = loop.call_later(left, _resolve, woken, False)
            try:
                by_wake = await woken
            except asyncio.CancelledError:  # the call was cancelled: leave nothing parked
                self._discard(entry)
                raise
            finally:
                timer.cancel()
            if done():
                return True
            if not by_wake:  # the timer fired: the entry is still parked
                self._discard(entry)

    def wake(self, value: int) -> None:
        """Release every waiter whose target is at or below ``value``: threads at once, futures in
        one callback per event loop (one wake-up of the loop, however many coroutines waited)."""
        due: list[_Entry] = []
        with self._lock:
            while self._heap and self._heap[0][0] <= value:
                due.append(heapq.heappop(self._heap))
        _release(due)

    def wake_all(self) -> None:
        with self._lock:
            heap, self._heap = self._heap, []
        _release(heap)

    @property
    def parked(self) -> int:
        with self._lock:
            return len(self._heap)

    def _discard(self, entry: _Entry) -> None:
        """Forget a waiter that returned by itself (rare: a timeout, or done before parking)."""
        with self._lock:
            try:
                self._heap.remove(entry)
            except ValueError:
                return  # already woken and popped
            heapq.heapify(self._heap)


def _release(entries: list[_Entry]) -> None:
    """Release the waiters of ``entries`` from any thread: threads at once, futures with one
    ``call_soon_threadsafe`` per event loop."""
    loops: dict[asyncio.AbstractEventLoop, list[asyncio.Future[bool]]] = {}
    for _, _, token in entries:
        if isinstance(token, asyncio.Future):
            loops.setdefault(token.get_loop(), []).append(token)
        else:
            token.release()
    for loop, futures in loops.items():
        with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody waits any more
            loop.call_soon_threadsafe(_resolve_all, futures)


def _resolve_all(futures: list[asyncio.Future[bool]]) -> None:
    for f in futures:
        _resolve(f, True)


def _resolve(woken: asyncio.Future[bool], by_wake: bool) -> None:
    if not woken.done():  # woken meanwhile, or cancelled with its call
        woken.set_result(by_wake)


@dataclass(frozen=True, slots=True)
class Park:
    """One wait of a ``Steps``: on ``waiters`` for ``target``, until ``done()`` or ``timeout_s``."""

    waiters: OffsetWaiters
    done: Callable[[], bool]
    target: int
    timeout_s: float


Steps = Generator[Park, bool, T]  # yields waits, receives whether each came, returns the result


def run(steps: Steps[T]) -> T:
    """Drive ``steps`` in this thread."""
    try:
        park = next(steps)
        while True:
            park = steps.send(park.waiters.wait(park.done, park.target, park.timeout_s))
    except StopIteration as finished:
        return finished.value  # type: ignore[no-any-return]


async def run_async(steps: Steps[T]) -> T:
    """Drive ``steps`` as a coroutine (no thread waits)."""
    try:
        park = next(steps)
        while True:
            park = steps.send(await park.waiters.wait_async(park.done, park.target, park.timeout_s))
    except StopIteration as finished:
        return finished.value  # type: ignore[no-any-return]
