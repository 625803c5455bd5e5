"""replication/unknown_topics.py: a NOT_FOUND confirmed with etcd, requests for one name sharing
reads, the number of names looked up at once bounded. The etcd stand-in answers ``placed_at`` on
a real event loop in its own thread, as the coordinator's loop does; the daemon-level behaviour
(a trailing node, real etcd) is tests/test_shards.py's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest

from broker.errors import BrokerError
from replication.unknown_topics import NAMES_MAX, UnknownTopics


class _Placements:
    """``placed_at`` as etcd answers it, each read held until ``release`` (to pile requests up)."""

    def __init__(self, records: dict[str, int]) -> None:
        self.records = records
        self.reads: list[str] = []
        self.gate = asyncio.Event()

    async def placed_at(self, topic: str) -> int:
        self.reads.append(topic)
        await self.gate.wait()
        return self.records.get(topic, 0)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()
    gc.collect()  # what the loop held is finalized here, not in the middle of a later test's work


def _unknown(loop: asyncio.AbstractEventLoop, etcd: _Placements) -> UnknownTopics:
    def submit(fn: Callable[[Any], Coroutine[Any, Any, int]]) -> concurrent.futures.Future[int]:
        return asyncio.run_coroutine_threadsafe(fn(etcd), loop)
    return UnknownTopics(submit)


def _make(loop: asyncio.AbstractEventLoop, records: dict[str, int]) -> tuple[UnknownTopics, _Placements]:
    etcd = asyncio.run_coroutine_threadsafe(_async_make(records), loop).result(5)
    return _unknown(loop, etcd), etcd


async def _async_make(records: dict[str, int]) -> _Placements:
    return _Placements(records)  # its Event belongs to the loop


def test_a_name_etcd_holds_is_unavailable_and_one_it_does_not_passes(loop: asyncio.AbstractEventLoop) -> None:
    unknown, etcd = _make(loop, {"fresh": 42})
    loop.call_soon_threadsafe(etcd.gate.set)
    unknown.confirm("nothing")  # absent in etcd: the caller's NOT_FOUND stands
    with pytest.raises(BrokerError) as behind:
        unknown.confirm("fresh")
    assert behind.value.code == "UNAVAILABLE" and "just created" in behind.value.message
    assert etcd.reads == ["nothing", "fresh"]


def test_requests_for_one_name_share_reads(loop: asyncio.AbstractEventLoop) -> None:
    """Forty callers at once: the read running when they came, and one more for all of them."""
    unknown, etcd = _make(loop, {})
    begun = []
    original = unknown._begin

    def counted(topic: str) -> concurrent.futures.Future[int]:
        future = original(topic)
        begun.append(topic)
        return future
    unknown._begin = counted  # type: ignore[method-assign]
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        first = pool.submit(unknown.confirm, "typo")
        while not etcd.reads:
            threading.Event().wait(0.005)
        rest = [pool.submit(unknown.confirm, "typo") for _ in range(39)]
        while len(begun) < 40:  # every caller waits on a read before the first one ends
            threading.Event().wait(0.005)
        loop.call_soon_threadsafe(etcd.gate.set)
        for f in [first, *rest]:
            f.result(5)
    assert etcd.reads == ["typo", "typo"], "one read running, one shared by those that came during it"


def test_names_looked_up_at_once_are_bounded(loop: asyncio.AbstractEventLoop) -> None:
    unknown, etcd = _make(loop, {})
    with concurrent.futures.ThreadPoolExecutor(NAMES_MAX) as pool:
        held = [pool.submit(unknown.confirm, f"made-up-{i}") for i in range(NAMES_MAX)]
        while len(etcd.reads) < NAMES_MAX:
            threading.Event().wait(0.005)
        with pytest.raises(BrokerError) as bounded:
            unknown.confirm("one-more")
        assert bounded.value.code == "UNAVAILABLE"
        loop.call_soon_threadsafe(etcd.gate.set)
        for f in held:
            f.result(5)
    while unknown._lookups:  # their done-callbacks run just after the waiters wake
        threading.Event().wait(0.005)
    unknown.confirm("one-more")  # the lookups ended: room again


def test_an_etcd_that_does_not_answer_is_unavailable_not_not_found(loop: asyncio.AbstractEventLoop,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("replication.unknown_topics.CONFIRM_TIMEOUT_S", 0.2)
    unknown, etcd = _make(loop, {})  # the gate stays shut until the end
    with pytest.raises(BrokerError) as silent:
        unknown.confirm("quiet")
    assert silent.value.code == "UNAVAILABLE" and "did not confirm" in silent.value.message

    async def on_a_loop() -> None:
        await unknown.confirm_async("quiet-too")
    with pytest.raises(BrokerError) as silent_async:
        asyncio.run(on_a_loop())
    assert silent_async.value.code == "UNAVAILABLE"
    loop.call_soon_threadsafe(etcd.gate.set)  # the reads end before the loop does
