"""Saying "unknown topic" only when etcd agrees (docs/shards.md "Routes").

A node of a cluster of shards knows the placed topics from its watched copy of etcd, which trails
etcd by the watch's delay: a topic created through another node a moment ago may not be in it
yet. A ``NOT_FOUND`` answered from the copy alone would contradict an acknowledged create (a
client creating a topic through one node and committing an offset on another saw exactly that).
So before a node answers that a topic does not exist, it reads the topic's record in etcd (one
linearizable point read, keys only): no record — the topic does not exist, ``NOT_FOUND`` stands;
a record — the copy is behind, and the request is ``UNAVAILABLE`` (retried by clients) while the
watch brings it.

Bounded: requests for one name share one read (a read begun before a request arrived cannot
answer it — the topic may have been created in between — so those that arrive during a read
share the next one); at most ``NAMES_MAX`` names are looked up at once (more: ``UNAVAILABLE``),
so a stranger sending made-up names costs etcd at most that many reads in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from broker.errors import BrokerError, shown
from replication.coordination.etcd import Etcd, Unreachable

NAMES_MAX = 64
CONFIRM_TIMEOUT_S = 1.0  # a pool thread waits this long at most (the server's pool is shared)

SubmitOnLoop = Callable[[Callable[[Etcd], Coroutine[Any, Any, int]]], "concurrent.futures.Future[int]"]


class _Lookup:
    """One name's read in flight, and the one that follows it (for requests that came meanwhile)."""

    __slots__ = ("next", "running")

    def __init__(self, running: concurrent.futures.Future[int]) -> None:
        self.running = running
        self.next: concurrent.futures.Future[int] | None = None


class UnknownTopics:
    def __init__(self, submit_on_loop: SubmitOnLoop) -> None:
        self._submit = submit_on_loop
        self._lock = threading.Lock()
        self._lookups: dict[str, _Lookup] = {}

    def confirm(self, topic: str) -> None:
        """Return when etcd holds no record of ``topic`` (blocks: one etcd read); UNAVAILABLE when
        it does (this node's copy is behind) or etcd does not answer."""
        future = self._begin(topic)
        try:
            revision = future.result(CONFIRM_TIMEOUT_S)
        except (TimeoutError, concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            raise self._unanswered(topic) from None
        except Unreachable as exc:
            raise self._unanswered(topic, str(exc)) from None
        self._check(topic, revision)

    async def confirm_async(self, topic: str) -> None:
        """``confirm`` for a caller on an event loop (waits without holding it)."""
        future = self._begin(topic)
        try:  # shielded: a waiter that gives up must not cancel the read the others share
            revision = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), CONFIRM_TIMEOUT_S)
        except (TimeoutError, concurrent.futures.CancelledError):
            raise self._unanswered(topic) from None
        except Unreachable as exc:
            raise self._unanswered(topic, str(exc)) from None
        self._check(topic, revision)

    def _begin(self, topic: str) -> concurrent.futures.Future[int]:
        """The read that answers a request arriving now: the next one if one is already running."""
        with self._lock:
            lookup = self._lookups.get(topic)
            if lookup is not None:
                if lookup.next is None:
                    lookup.next = concurrent.futures.Future()
                return lookup.next
            if len(self._lookups) >= NAMES_MAX:
                raise BrokerError("UNAVAILABLE", f"{NAMES_MAX} unknown topic names are being looked up in etcd "
                                  f"already; {shown(topic)} is not known here: retry")
            future = self._read(topic)
            self._lookups[topic] = _Lookup(future)
        future.add_done_callback(lambda _: self._finished(topic))  # outside the lock: it may run at once
        return future

    def _read(self, topic: str) -> concurrent.futures.Future[int]:
        async def read(etcd: Etcd) -> int:
            return await etcd.placed_at(topic)

        return self._submit(read)

    def _finished(self, topic: str) -> None:
        """A read ended: the requests waiting for the next one get it now."""
        with self._lock:
            lookup = self._lookups.get(topic)
            if lookup is None:
                return
            if lookup.next is None:
                del self._lookups[topic]
                return
            waiting, lookup.next = lookup.next, None
            try:
                lookup.running = self._read(topic)
            except Exception as exc:  # the etcd loop is gone (or closing): those waiting learn it
                del self._lookups[topic]
                waiting.set_exception(Unreachable(str(exc)[:200]))
                return
            running = lookup.running
        _chain(running, waiting)
        running.add_done_callback(lambda _: self._finished(topic))

    @staticmethod
    def _check(topic: str, revision: int) -> None:
        if revision:
            raise BrokerError("UNAVAILABLE", f"topic {shown(topic)} was just created (etcd revision {revision}); "
                              "this node's copy of the placements has not caught up yet: retry in a moment")

    @staticmethod
    def _unanswered(topic: str, why: str = "") -> BrokerError:
        return BrokerError("UNAVAILABLE", f"topic {shown(topic)} is not known here and etcd did not confirm it is "
                           f"unknown within {CONFIRM_TIMEOUT_S:g} s{': ' + why if why else ''}; retry")


def _chain(source: concurrent.futures.Future[int], target: concurrent.futures.Future[int]) -> None:
    """``target`` ends as ``source`` does."""
    def copy(done: concurrent.futures.Future[int]) -> None:
        if target.done():
            return
        if done.cancelled():
            target.set_exception(Unreachable("the etcd read was cancelled"))
        elif (exc := done.exception()) is not None:
            target.set_exception(exc)
        else:
            target.set_result(done.result())
    source.add_done_callback(copy)
