"""The event loop the asyncio gRPC server runs on, in a thread of its own.

The daemon's main thread handles signals and the watchdog; the store runs its own threads; the
gRPC server (``grpc.aio``) lives on this loop. Other threads hand it work with ``call`` (wait for a
coroutine's result) or ``soon`` (fire and forget).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
CANCEL_AFTER_S = 0.5  # tasks left on the loop after a stop get this long to end before they are cancelled


class LoopThread:
    def __init__(self, name: str = "grpc-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @staticmethod
    async def _cancel_pending(drain_s: float) -> None:
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        if pending:  # most end by themselves right after the server's stop (gRPC's own RPC scheduling
            # tasks print a CancelledError traceback when cancelled): cancel only what is still running
            _, still = await asyncio.wait(pending, timeout=min(drain_s, CANCEL_AFTER_S))
            for task in still:
                task.cancel()
            if still:
                await asyncio.wait(still, timeout=drain_s)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self, drain_s: float = 5.0) -> None:
        """Cancel what is still pending on the loop, wait for it to end, then stop the loop.

        A servicer still running in a worker thread after the gRPC server's grace period ends on
        its own later; its task must be cancelled first, or the loop is stopped under it and the
        interpreter prints "Task was destroyed but it is pending!" with tracebacks at exit."""
        with contextlib.suppress(Exception):  # a loop that no longer runs has nothing left to drain
            self.call(self._cancel_pending(drain_s), drain_s + 1.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()
