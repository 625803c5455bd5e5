"""Subscribe-mode heartbeats on the event loop: parked answers, session expiry, role changes.

A member whose grant equals what it holds has nothing to do, so its heartbeat parks (a future on
the loop, no thread) until its answer changes -- a queue to take or to release -- or until the
heartbeat interval passes. So a join or a leave reaches every member within one round trip, not
one heartbeat interval. Every change to the membership is made on the loop's thread; describe
calls from worker threads only read it under its lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from broker import metrics
from broker.groups.membership import MemberKey, Membership

log = structlog.get_logger("groups")
TICK_S = 0.1


class Heartbeats:
    def __init__(self, loop: asyncio.AbstractEventLoop, queues_of: Callable[[str], int | None], *,
                 members_max: int, rejoin_grace_ms: int, groups_max: int, members_total_max: int = 100_000) -> None:
        self._loop = loop
        self._parked: dict[MemberKey, asyncio.Future[None]] = {}
        self.membership = Membership(queues_of, self._wake, members_max=members_max, rejoin_grace_ms=rejoin_grace_ms,
                                     groups_max=groups_max, members_total_max=members_total_max)
        self._tick_handle: asyncio.TimerHandle | None = None
        self._closed = False

    def start(self) -> None:
        self._loop.call_soon_threadsafe(self._tick)

    def close(self) -> None:
        def stop() -> None:
            self._closed = True
            if self._tick_handle is not None:
                self._tick_handle.cancel()
            self._wake(set(self._parked))
        with contextlib.suppress(RuntimeError):  # the loop is closed already
            self._loop.call_soon_threadsafe(stop)

    def _tick(self) -> None:
        """Expire sessions every ``TICK_S``; a failure is logged and counted, never ends the ticks."""
        try:
            gone = self.membership.expire(time.monotonic())
            for group, member in gone:
                log.info("member_expired", group=group, member=member)
            metrics.GROUP_MEMBERS.set(sum(self.membership.summary().values()))
        except Exception as exc:  # no background work dies silently (DESIGN §10)
            log.exception("group_tick_failed", error=str(exc))
            metrics.BACKGROUND_ERRORS.labels("groups").inc()
        if not self._closed:
            self._tick_handle = self._loop.call_later(TICK_S, self._tick)

    def role_changed_threadsafe(self, role: str) -> None:
        def reset() -> None:
            woken = self.membership.reset(time.monotonic(), master=role == "master")
            self._wake(woken)
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(reset)

    # -- parking (on the loop's thread) ------------------------------------------------------------
    def park(self, key: MemberKey) -> asyncio.Future[None]:
        old = self._parked.pop(key, None)
        if old is not None and not old.done():  # a newer heartbeat of the same member replaces it
            old.set_result(None)
        fut: asyncio.Future[None] = self._loop.create_future()
        self._parked[key] = fut
        return fut

    def unpark(self, key: MemberKey, fut: asyncio.Future[None]) -> None:
        if self._parked.get(key) is fut:
            del self._parked[key]
        if not fut.done():
            fut.cancel()

    def wake(self, keys: set[MemberKey]) -> None:
        """Answer these members' parked heartbeats now (on the loop's thread)."""
        self._wake(keys)

    def _wake(self, keys: set[MemberKey]) -> None:
        for key in keys:
            fut = self._parked.get(key)
            if fut is not None and not fut.done():
                fut.set_result(None)

    @property
    def parked(self) -> int:
        return len(self._parked)
