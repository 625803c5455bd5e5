"""Thread-style streaming servicers on the asyncio gRPC server.

grpc.aio runs plain unary handlers in its thread pool, but not plain *streaming* ones. Replication
(``Stream``, ``Snapshot``) is written as ordinary blocking generators with a reader thread; this
bridge runs such a generator in a thread of its own and passes messages both ways:

- requests: an asyncio task reads the client's stream and feeds a queue the generator iterates;
- responses: the generator's items cross to the loop through a bounded queue (back-pressure:
  at most ``QUEUE_MAX`` in flight, so a fast producer waits for a slow client);
- ``context.abort`` inside the thread raises ``Aborted``; the loop side then aborts the call.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

QUEUE_MAX = 64
_END = object()


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class ThreadContext:
    """What a blocking servicer uses of its context, on top of the asyncio one."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self.finished = threading.Event()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    def is_active(self) -> bool:
        return not self.finished.is_set() and not self._context.cancelled()

    def peer(self) -> str:
        return str(self._context.peer())

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()


def bridged(behavior: Callable[[Any, Any], Iterator[Any]], *, stream_requests: bool,
            pool: Any) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """An async-generator handler that runs ``behavior`` (a blocking generator) in ``pool``."""

    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        loop = asyncio.get_running_loop()
        requests: queue.Queue[Any] = queue.Queue()
        slots = threading.Semaphore(QUEUE_MAX)
        out: asyncio.Queue[Any] = asyncio.Queue()
        ctx = ThreadContext(context)

        def sync_requests() -> Iterator[Any]:
            while True:
                item = requests.get()
                if item is _END:
                    return
                yield item

        def produce() -> None:
            try:
                source = behavior(sync_requests() if stream_requests else request, ctx)
                for item in source:
                    while not slots.acquire(timeout=0.5):
                        if not ctx.is_active():
                            return
                    loop.call_soon_threadsafe(out.put_nowait, item)
                    if not ctx.is_active():
                        return
                loop.call_soon_threadsafe(out.put_nowait, _END)
            except BaseException as exc:  # an abort, or a failure: the loop side ends the call with it
                loop.call_soon_threadsafe(out.put_nowait, exc)

        async def pump() -> None:
            try:
                async for item in request:
                    requests.put(item)
            except (asyncio.CancelledError, grpc.RpcError):
                pass
            finally:
                requests.put(_END)

        pumping = asyncio.ensure_future(pump()) if stream_requests else None
        caller = contextvars.copy_context()  # the interceptor's caller, for the thread too
        producing = loop.run_in_executor(pool, caller.run, produce)
        try:
            while True:
                item = await out.get()
                if item is _END:
                    break
                if isinstance(item, Aborted):
                    await context.abort(item.code, item.details)
                if isinstance(item, BaseException):
                    raise item
                slots.release()
                yield item
        finally:
            ctx.finished.set()
            requests.put(_END)
            if pumping is not None:
                pumping.cancel()
            await asyncio.shield(producing)

    return handler


class BridgedServicer:
    """``servicer`` with the named streaming methods bridged (``{name: requests are a stream}``)."""

    def __init__(self, servicer: Any, methods: dict[str, bool], pool: Any) -> None:
        self._servicer = servicer
        for name, stream_requests in methods.items():
            setattr(self, name, bridged(getattr(servicer, name), stream_requests=stream_requests, pool=pool))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._servicer, name)
