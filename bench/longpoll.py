"""Idle long-polls against a send load (issue 13): do parked pulls cost the writers anything?

Three runs on a fresh daemon each: 0, then 1,000 idle long-polls (pulls with ``max_wait_ms`` on an
empty topic, held by a separate client process that re-issues each one when it returns), while
``--producers`` processes send 1 KiB messages with ack=flush (``load.window_producer``) and a
prober asks ``Status`` every 50 ms. Then 10,000 idle long-polls alone: the daemon must stay up and
within the RSS budget.

Figures: send rate with 1,000 polls / without (target >= 0.9), send p99 with polls (target <=
1.5 x without + 20 ms), status p99 with polls (target <= 50 ms), RSS with 10,000 polls (<= 500 MB).

Usage: .venv/bin/python bench/longpoll.py [--quick] [--polls 1000] [--many 10000]
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import common
import grpc
import load
from common import KiB, Results, log
from measure import quantile

from broker.client import BrokerClient
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

TOPIC = "bench-load"
IDLE = "bench-idle"
QUEUES = 4


def holder(address: str, count: int, ready: Any, stop: Any) -> None:
    """Keep ``count`` long-polls parked on the idle topic (over 8 channels) until ``stop`` is set."""


    channels = [grpc.insecure_channel(address) for _ in range(8)]
    stubs = [pb_grpc.BrokerStub(ch) for ch in channels]
    request = pb.PullRequest(topic=IDLE, queue_id=0, offset=0, max_messages=1, max_wait_ms=30_000)
    lock = threading.Lock()

    def park(i: int) -> None:
        if stop.is_set():
            return
        fut = stubs[i % len(stubs)].Pull.future(request, timeout=60)
        fut.add_done_callback(lambda _f: park(i))

    with lock:
        for i in range(count):
            park(i)
    ready.set()
    stop.wait()
    for ch in channels:
        ch.close()


def probe_status(address: str, stop: threading.Event, out: list[float]) -> None:

    with BrokerClient(address) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.status()
            out.append(time.perf_counter() - t0)
            stop.wait(0.05)


@contextlib.contextmanager
def parked_polls(address: str, polls: int) -> Iterator[None]:
    """``polls`` idle long-polls held by a separate process for the duration of the block."""
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    hold = ctx.Process(target=holder, args=(address, polls, ready, stop))
    hold.start()
    try:
        ready.wait(300)
        _wait_parked(address, polls)
        yield
    finally:
        stop.set()
        hold.join(60)


def one_run(workdir: str, polls: int, producers: int, batch: int, warmup_s: float, seconds: float) -> dict[str, Any]:
    with common.temp_dir(f"tm-longpoll-{polls}-", workdir) as wd, common.running_daemon(wd) as d, \
            _topics(d.address, TOPIC, IDLE), parked_polls(d.address, polls):
        assert d.proc is not None
        status_s: list[float] = []
        probe_stop = threading.Event()
        prober = threading.Thread(target=probe_status, args=(d.address, probe_stop, status_s))
        prober.start()
        args = [(d.address, TOPIC, QUEUES, "flush", batch, KiB, 0.0, 0.0) for _ in range(producers)]
        w = load.run_window(load.window_producer, args, warmup_s, seconds, watch=(d.proc.pid,))
        probe_stop.set()
        prober.join()
        with BrokerClient(d.address) as c:
            parked = c.status().get("long_polls", -1)  # -1: a revision that does not count them
        lat = w["latencies"]
    return {"rate": w["rate"], "p99_ms": 1000 * quantile(lat, 0.99), "p50_ms": 1000 * quantile(lat, 0.5),
            "status_p99_ms": 1000 * quantile(sorted(status_s), 0.99), "parked": parked}


def many_run(workdir: str, polls: int) -> dict[str, Any]:
    with common.temp_dir(f"tm-longpoll-many-{polls}-", workdir) as wd, common.running_daemon(wd) as d, \
            _topics(d.address, IDLE), parked_polls(d.address, polls):
        assert d.proc is not None
        with BrokerClient(d.address) as c:
            t0 = time.perf_counter()
            c.status()
            status_ms = 1000 * (time.perf_counter() - t0)
            parked = c.status().get("long_polls", -1)
        rss = common.proc_status_bytes(d.proc.pid, "VmRSS")
        alive = d.proc.poll() is None
    return {"rss_bytes": rss, "alive": alive, "parked": parked, "status_ms": status_ms}


@contextlib.contextmanager
def _topics(address: str, *names: str) -> Iterator[None]:
    with BrokerClient(address) as c:
        for name in names:
            c.create_topic(name, queues=QUEUES if name == TOPIC else 1)
    yield


def _wait_parked(address: str, polls: int) -> None:
    """Until the daemon counts ``polls`` parked pulls; a revision that does not count them (before
    issue 13) gets 5 s to take them in."""

    with BrokerClient(address) as c:
        if "long_polls" not in c.status():
            time.sleep(5)
            return
        common.wait_for(lambda: c.status()["long_polls"] >= polls, 300, f"{polls} parked pulls")


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--polls", type=int, default=1000)
    p.add_argument("--many", type=int, default=None, help="idle long-polls for the memory run (default 10,000; quick 2,000)")
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--batch", type=int, default=200, help="messages per send")
    p.add_argument("--seconds", type=float, default=None, help="measured window (default 10, quick 3)")
    a = p.parse_args()
    seconds = a.seconds or (3.0 if a.quick else 10.0)
    many = a.many or (2000 if a.quick else 10_000)
    res = Results("longpoll", a.results, {"polls": a.polls, "producers": a.producers, "batch": a.batch,
                                          "seconds": seconds, "quick": a.quick})
    common.preflight(res, a.max_wait_quiet)
    workdir = a.workdir or "/tmp"
    base = one_run(workdir, 0, a.producers, a.batch, 1.0, seconds)
    loaded = one_run(workdir, a.polls, a.producers, a.batch, 1.0, seconds)
    log(f"without polls: {base}; with {a.polls}: {loaded}")
    res.add("send rate, ack=flush, no long-polls", base["rate"], "msg/s")
    res.add(f"send rate, ack=flush, {a.polls} idle long-polls", loaded["rate"], "msg/s", parked=loaded["parked"])
    target, ok = common.at_least(loaded["rate"] / base["rate"], 0.9)
    res.add("ratio: with / without long-polls", loaded["rate"] / base["rate"], "x", target=target, ok=ok)
    res.add("send p99, no long-polls", base["p99_ms"], "ms")
    limit = 1.5 * base["p99_ms"] + 20
    target, ok = common.at_most(loaded["p99_ms"], limit)
    res.add(f"send p99, {a.polls} idle long-polls", loaded["p99_ms"], "ms", target=target, ok=ok)
    target, ok = common.at_most(loaded["status_p99_ms"], 50)
    res.add(f"status p99, {a.polls} idle long-polls under send load", loaded["status_p99_ms"], "ms", target=target, ok=ok)
    m = many_run(workdir, many)
    target, ok = common.at_most(m["rss_bytes"] / 1e6, 500)
    res.add(f"RSS with {many} idle long-polls (daemon alive: {m['alive']})", m["rss_bytes"] / 1e6, "MB",
            target=target, ok=ok and m["alive"], parked=m["parked"], status_ms=m["status_ms"])
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
