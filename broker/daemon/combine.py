"""Calls that arrive while one like them runs go together in the next run (group commit for calls).

A pop or an ack is one ``__pop`` record, and the next call on its queue waits until the view has
applied it (``broker/groups/pop_locks.py``): an fsync and a view round per call and queue, each
with its thread hand-overs. Eight consumers popping 500 messages at a time spent ~25 ms a call
there. Calls of one key (a group and topic, with the same lease terms) that arrive while a run of
that key is under way wait for it to end and are then served by one run: one pass, one record
(or one append of two: the acks pops carry, and their leases).
A call that finds no run under way starts one at once, so a lone call waits for nothing.

A run goes on when its callers give up meanwhile (a deadline): what it got for them is handed
to ``unclaimed`` (pops: their leases are given back at once, not left to their deadline).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

import structlog

K = TypeVar("K", bound=Hashable)
A = TypeVar("A")
R = TypeVar("R")

log = structlog.get_logger("combine")


class Combiner(Generic[K, A, R]):
    """``run(key, args)`` answers one result per argument, in order (an exception as a result is
    raised to that caller alone); at most ``most`` arguments a run. ``unclaimed(key, results)``
    gets the results of callers that gave up during their run."""

    def __init__(self, run: Callable[[K, list[A]], Awaitable[list[R]]], most: int,
                 unclaimed: Callable[[K, list[R]], Awaitable[None]] | None = None) -> None:
        self._run = run
        self._most = most
        self._unclaimed = unclaimed
        self._waiting: dict[K, list[tuple[A, asyncio.Future[R]]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # referenced until done (asyncio keeps weak ones)

    @property
    def keys_waiting(self) -> int:
        return len(self._waiting)

    async def call(self, key: K, arg: A) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        waiting = self._waiting.get(key)
        if waiting is None:  # no run of this key under way: start one (it takes this call at once)
            self._waiting[key] = [(arg, future)]
            task = loop.create_task(self._drain(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        else:
            waiting.append((arg, future))
        return await future

    async def _drain(self, key: K) -> None:
        """Runs of ``key`` until no call of it waits; the key is forgotten once none does."""
        waiting = self._waiting[key]
        batch: list[tuple[A, asyncio.Future[R]]] = []
        try:
            while waiting:
                batch = [(arg, f) for arg, f in waiting[: self._most] if not f.cancelled()]
                del waiting[: self._most]
                if batch:
                    await self._serve(key, batch)
        finally:
            del self._waiting[key]
            for _, f in batch + waiting:  # only when the run itself was cancelled (shutdown)
                if not f.done():
                    f.cancel()

    async def _serve(self, key: K, batch: list[tuple[A, asyncio.Future[R]]]) -> None:
        try:
            results = await self._run(key, [arg for arg, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"a combined run answered {len(results)} results for {len(batch)} calls")
        except Exception as exc:  # each caller gets the run's failure as its own
            for _, f in batch:
                if not f.done():
                    f.set_exception(exc)
            return
        gone: list[R] = []
        for (_, f), result in zip(batch, results, strict=True):
            if f.done():  # its caller gave up during the run
                if not isinstance(result, Exception):
                    gone.append(result)
            elif isinstance(result, Exception):  # that call's own refusal
                f.set_exception(result)
            else:
                f.set_result(result)
        if gone and self._unclaimed is not None:
            try:
                await self._unclaimed(key, gone)
            except Exception as exc:  # the results stay as they are (pops: leased until their deadline)
                log.warning("combined_results_unclaimed", key=str(key)[:200], error=str(exc)[:300])
