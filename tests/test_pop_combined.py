"""Pops and acks that arrive together are served together (broker/daemon/combine.py): one pass and
one ``__pop`` record for many calls, each call answered with its own messages, its own refusals
and its own errors."""

from __future__ import annotations

import asyncio
import gc
import re
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable

import pytest

from broker.client import BrokerClient, BrokerError, Message
from broker.daemon.combine import Combiner
from tests.procs import DaemonProcess, free_port


def _run(coro_fn: Callable[[], object]) -> object:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro_fn())  # type: ignore[arg-type]
    finally:
        loop.close()
        gc.collect()


def test_calls_arriving_during_a_run_share_the_next() -> None:
    runs: list[list[int]] = []

    async def run(key: str, args: list[int]) -> list[object]:
        runs.append(list(args))
        await asyncio.sleep(0.05)
        return [ValueError("odd") if a % 2 else a * 10 for a in args]

    async def main() -> list[object]:
        c: Combiner[str, int, object] = Combiner(run, most=3)
        first = asyncio.ensure_future(c.call("k", 0))
        await asyncio.sleep(0.01)  # the first run is under way: the next five wait for it
        rest = [asyncio.ensure_future(c.call("k", a)) for a in (2, 4, 6, 8, 1)]
        other = asyncio.ensure_future(c.call("other", 2))  # another key runs beside them
        out = await asyncio.gather(first, *rest, other, return_exceptions=True)
        assert c.keys_waiting == 0
        return out

    out = _run(main)
    assert runs == [[0], [2], [2, 4, 6], [8, 1]]  # "other" ran alone, at once
    assert out[:5] == [0, 20, 40, 60, 80] and isinstance(out[5], ValueError) and out[6] == 20  # type: ignore[index]


def test_a_failed_run_fails_its_calls_only_and_cancelled_calls_are_skipped() -> None:
    seen: list[list[int]] = []

    async def run(key: str, args: list[int]) -> list[int]:
        seen.append(list(args))
        await asyncio.sleep(0.02)
        if 99 in args:
            raise RuntimeError("boom")
        return args

    async def main() -> None:
        c: Combiner[str, int, int] = Combiner(run, most=10)
        first = asyncio.ensure_future(c.call("k", 99))
        await asyncio.sleep(0.005)
        gone = asyncio.ensure_future(c.call("k", 5))
        kept = asyncio.ensure_future(c.call("k", 6))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(RuntimeError):
            await first
        assert await kept == 6

    _run(main)
    assert seen == [[99], [6]]


def _metric(port: int, name: str, kind: str) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf'^{name}_total{{kind="{kind}"}} (\S+)$', page, re.M)
    return float(m.group(1)) if m else 0.0


def test_many_consumers_popping_at_once_share_records_and_get_each_message_once(
        spawn: Callable[..., DaemonProcess]) -> None:
    """16 consumers on 2 queues: every message delivered once, fewer pop passes than pops (their
    records shared), acks of one call refused alone when its handle is malformed. A pop's byte
    budget (``limits.pull_bytes_max``, here less than one batch of 10) cuts its share short: what it
    leaves goes to the next pop of the pass, or waits, never lost."""
    port = free_port()
    d = spawn("node", config={"node.metrics_listen": f"127.0.0.1:{port}", "limits.pull_bytes_max": 1024})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=2)
        for at in range(0, 3000, 10):
            c.send("t", [Message(b"m%d" % i + b"." * 200, key=str(i)) for i in range(at, at + 10)], ack="leader")
        seen: list[bytes] = []
        errors: list[BaseException] = []
        lock = threading.Lock()
        start = threading.Barrier(16)

        def consume() -> None:
            try:
                with BrokerClient(d.address) as cc:
                    start.wait(10)
                    while True:
                        msgs = cc.pop("g", "t", max_messages=20, invisible_ms=60_000, max_wait_ms=300, start="earliest")
                        if not msgs:
                            return
                        assert all(m.delivery_count == 1 for m in msgs)
                        assert cc.ack("g", msgs) == {}
                        with lock:
                            seen.extend(m.body.rstrip(b".") for m in msgs)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=consume) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert Counter(seen) == Counter(b"m%d" % i for i in range(3000))  # each exactly once
        desc = c.describe_group("g")
        assert sum(q["in_flight"] for q in desc["queues"]) == 0 and sum(q["lag"] for q in desc["queues"]) == 0
        pops, pop_runs = _metric(port, "tidemark_pop_run_calls", "pop"), _metric(port, "tidemark_pop_runs", "pop")
        assert pops >= 3000 / 20 and pop_runs < pops, (pops, pop_runs)
        acks, ack_runs = _metric(port, "tidemark_pop_run_calls", "ack"), _metric(port, "tidemark_pop_runs", "ack")
        assert acks >= 3000 / 20 and ack_runs < acks, (acks, ack_runs)

        # acks arriving together: a malformed handle refuses its own call, the others are done
        c.send("t", [Message(b"late%d" % i) for i in range(8)], ack="flush")
        got = c.pop("g", "t", max_messages=8, invisible_ms=60_000, max_wait_ms=2000)
        assert len(got) == 8
        handles = [m.receipt_handle for m in got]
        outcomes: list[object] = [None] * 9
        go = threading.Barrier(9)

        def ack(i: int) -> None:
            with BrokerClient(d.address) as cc:
                go.wait(10)
                try:
                    outcomes[i] = cc.ack("g", ["not-a-handle"] if i == 8 else [handles[i]])
                except BrokerError as exc:
                    outcomes[i] = exc.code.name

        acking = [threading.Thread(target=ack, args=(i,)) for i in range(9)]
        for t in acking:
            t.start()
        for t in acking:
            t.join(30)
        assert outcomes == [{}] * 8 + ["INVALID_ARGUMENT"]
        assert len(c.pop("g", "t", max_wait_ms=0)) == 0
        assert sum(q["in_flight"] for q in c.describe_group("g")["queues"]) == 0


def test_a_consumer_loop_carrying_its_acks_in_the_next_pop(spawn: Callable[..., DaemonProcess]) -> None:
    """``pop(ack=previous)``: one call acks the last batch and leases the next; every message once,
    nothing left in flight after the last ack; a malformed handle fails the carried acks alone.
    The acks ride the pop's own pass (no ack pass of their own), found nothing to lease or not."""
    port = free_port()
    d = spawn("node", config={"node.metrics_listen": f"127.0.0.1:{port}"})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=3)
        c.send("t", [Message(b"m%d" % i, key=str(i)) for i in range(1000)], ack="flush")
        seen: list[bytes] = []
        previous = None
        while True:
            got = c.pop("g", "t", max_messages=64, invisible_ms=60_000, max_wait_ms=300, start="earliest", ack=previous)
            assert got.ack_failures == {}
            if not got:
                break
            assert all(m.delivery_count == 1 for m in got)
            seen += got.bodies()
            previous = got
        assert Counter(seen) == Counter(b"m%d" % i for i in range(1000))
        assert sum(q["in_flight"] for q in c.describe_group("g")["queues"]) == 0  # the last pop carried the last ack
        assert _metric(port, "tidemark_pop_run_calls", "carried") >= 1000 / 64
        assert _metric(port, "tidemark_pop_runs", "ack") == 0  # no pass of their own
        c.send("t", [Message(b"x")], ack="flush")
        again = c.pop("g", "t", max_messages=8, max_wait_ms=2000, ack=["not-a-handle"])
        assert again.bodies() == [b"x"] and list(again.ack_failures) == ["not-a-handle"]
        assert again.ack_results[0].code == 3  # INVALID_ARGUMENT
        twice = c.pop("g", "t", max_messages=8, ack=again)
        assert len(twice) == 0 and twice.ack_failures == {}
        assert "acked" in c.ack("g", again)[again.receipt_handles()[0]]  # the pop acked it already


def test_carried_acks_make_room_at_once_and_may_name_another_topic(spawn: Callable[..., DaemonProcess]) -> None:
    """A pop whose group's window is full (``groups.pop_window_max``) carrying the acks that empty
    it leases the next messages in the same call, without waiting; a pop of one topic may carry
    the acks of another's leases."""
    d = spawn("node", config={"groups.pop_window_max": 1000})
    with BrokerClient(d.address) as c:
        for topic in ("t", "u"):
            c.create_topic(topic, queues=1)
            c.send(topic, [Message(b"%s%d" % (topic.encode(), i)) for i in range(2500)], ack="flush")
        first = c.pop("g", "t", max_messages=1000, invisible_ms=60_000, start="earliest")
        assert len(first) == 1000
        assert len(c.pop("g", "t", max_messages=10, start="earliest")) == 0  # the window is full
        elsewhere = c.pop("g", "u", max_messages=7, invisible_ms=60_000, start="earliest")
        assert len(elsewhere) == 7
        second = c.pop("g", "t", max_messages=1000, invisible_ms=60_000, ack=first)  # no wait: counted at once
        assert second.ack_failures == {}
        assert second.bodies() == [b"t%d" % i for i in range(1000, 2000)]
        assert len(c.pop("g", "t", max_messages=10)) == 0  # t's window is full again: t is idle now
        third = c.pop("g", "t", max_messages=10, ack=elsewhere)  # an idle topic's pass ends the acks alone
        assert len(third) == 0 and third.ack_failures == {}
        queues = {q["topic"]: q for q in c.describe_group("g")["queues"]}
        assert queues["t"]["in_flight"] == 1000 and queues["u"]["in_flight"] == 0
