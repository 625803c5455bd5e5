"""Calls that arrive while one like them runs go together in the next run (group commit for calls).

A pop or an ack is one ``__pop`` record, and the next call on its queue waits until the view has
applied it (``broker/groups/pop_locks.py``): an fsync and a view round per call and queue, each
with its thread hand-overs. Eight consumers popping 500 messages at a time spent ~25 ms a call
there. Calls of one key (a group and topic, with the same lease terms) that arrive while a run of
that key is under way wait for it to end and are then served by one run: one pass, one record.
A call that finds no run under way starts one at once, so a lone call waits for nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
A = TypeVar("A")
R = TypeVar("R")


class Combiner(Generic[K, A, R]):
    """``run(key, args)`` answers one result per argument, in order (an exception as a result is
    raised to that caller alone); at most ``most`` arguments a run."""

    def __init__(self, run: Callable[[K, list[A]], Awaitable[list[R]]], most: int) -> None:
        self._run = run
        self._most = most
        self._waiting: dict[K, list[tuple[A, asyncio.Future[R]]]] = {}

    @property
    def keys_waiting(self) -> int:
        return len(self._waiting)

    async def call(self, key: K, arg: A) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.get(key)
        if waiting is None:  # no run of this key under way: start one (it takes this call at once)
            self._waiting[key] = [(arg, future)]
            asyncio.get_running_loop().create_task(self._drain(key))
        else:
            waiting.append((arg, future))
        return await future

    async def _drain(self, key: K) -> None:
        """Runs of ``key`` until no call of it waits; the key is forgotten once none does."""
        waiting = self._waiting[key]
        try:
            while waiting:
                batch = [(arg, f) for arg, f in waiting[: self._most] if not f.cancelled()]
                del waiting[: self._most]
                if not batch:
                    continue
                try:
                    results = await self._run(key, [arg for arg, _ in batch])
                except Exception as exc:  # each caller gets the run's failure as its own
                    for _, f in batch:
                        if not f.done():
                            f.set_exception(exc)
                    continue
                for (_, f), result in zip(batch, results, strict=True):
                    if f.done():
                        continue
                    if isinstance(result, Exception):  # that call's own refusal
                        f.set_exception(result)
                    else:
                        f.set_result(result)
        finally:
            del self._waiting[key]
            for _, f in waiting:  # only if the loop itself was cancelled (shutdown)
                if not f.done():
                    f.cancel()
