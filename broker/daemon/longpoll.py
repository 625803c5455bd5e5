"""Long-polls that hold no thread (DESIGN §10).

A pull that finds nothing new parks an ``asyncio`` future on the event loop of the gRPC server,
keyed by its queue. After each dispatch round the store tells us which queues grew (from the
dispatcher's thread, ``notify_threadsafe``); their futures are resolved on the loop and those
pulls read again. So thousands of idle long-polls cost a future each, not a thread each, and
cannot starve sends, status or health checks. A pop waits on its topic (``ANY_QUEUE``), woken by
any of its queues: one future per waiting call, however many queues the topic has (2,000 pops
of a 1,024-queue topic parked two million futures, 1.4 GB). At most ``parked_max`` wait at once;
a call beyond it that finds nothing to read is refused (RESOURCE_EXHAUSTED) instead of parking.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

from broker import metrics
from broker.errors import BrokerError

QueueKey = tuple[str, int]
ANY_QUEUE = -1  # (topic, ANY_QUEUE): woken when any queue of the topic grows


class LongPolls:
    def __init__(self, loop: asyncio.AbstractEventLoop, parked_max: Callable[[], int] = lambda: 100_000) -> None:
        self._loop = loop
        self._waiting: defaultdict[QueueKey, set[asyncio.Future[None]]] = defaultdict(set)
        self._count = 0
        self._parked_max = parked_max  # limits.parked_waits_max, read at each park (reloadable)

    def park(self, key: QueueKey) -> asyncio.Future[None] | None:
        """A future resolved when ``key`` grows (or on shutdown); on the loop's thread. Park
        *before* the read that found nothing, so that no growth can slip in between. None when
        ``parked_max`` calls wait already: the caller reads anyway, and refuses (``full``) only if
        it found nothing, so a call with something to read is never refused."""
        if self._count >= self._parked_max():
            return None
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiting[key].add(fut)
        self._count += 1
        metrics.LONG_POLLS.set(self._count)
        return fut

    def full(self) -> BrokerError:
        metrics.LONG_POLLS_REFUSED.inc()
        return BrokerError("RESOURCE_EXHAUSTED", f"{self._count} calls already wait on this node "
                           "(limits.parked_waits_max): retry later, or with a shorter max_wait_ms")

    def unpark(self, key: QueueKey, fut: asyncio.Future[None]) -> None:
        waiting = self._waiting.get(key)
        if waiting is not None and fut in waiting:
            waiting.discard(fut)
            if not waiting:
                del self._waiting[key]
            self._count -= 1
            metrics.LONG_POLLS.set(self._count)
        if not fut.done():
            fut.cancel()

    @contextlib.asynccontextmanager
    async def parking(self, key: QueueKey, wanted: bool) -> AsyncIterator[asyncio.Future[None] | None]:
        """``park`` for the block (None when not ``wanted``, or when full), unparked at its end."""
        fut = self.park(key) if wanted else None
        try:
            yield fut
        finally:
            if fut is not None:
                self.unpark(key, fut)

    async def wait(self, fut: asyncio.Future[None] | None, timeout_s: float) -> None:
        """Until the queue grows or ``timeout_s`` passes; ``full`` for a call that could not park. A
        cancelled call (the client went away) raises ``CancelledError`` here, ending the pull."""
        if fut is None:
            raise self.full()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)

    def notify_threadsafe(self, keys: set[QueueKey] | None) -> None:
        """From any thread: these queues grew (None: wake everyone, e.g. at shutdown)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._wake, keys)

    def _wake(self, keys: set[QueueKey] | None) -> None:
        if keys is None:
            woken = list(self._waiting)
        else:
            woken = [*keys, *{(topic, ANY_QUEUE) for topic, _ in keys}]
        for key in woken:
            for fut in self._waiting.get(key, ()):
                if not fut.done():
                    fut.set_result(None)

    @property
    def parked(self) -> int:
        return self._count
