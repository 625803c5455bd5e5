"""Health checks and ack=flush sends while hostile or careless clients call (issue 35).

One daemon; a prober (this process) asks a gRPC health check and sends one 1 KiB message with
ack=flush every 20 ms, and records each latency. It runs quiet first, then under each load alone,
then under all of them at once, each load in processes of its own:

- ``bad sends``: Send requests of 20,000 plain messages plus one whose property is 70,000 bytes
  (refused whole: INVALID_ARGUMENT), back to back;
- ``decoded pulls``: 4 readers looping ``Pull(decode=true, max_messages=100000)`` over a queue of
  100,000 messages;
- ``waiting pops``: 2,000 ``Pop(max_wait_ms=25000)`` parked on a 1,024-queue topic, re-issued as
  each returns; probed once the daemon has taken them in (idle again), within their 25 s.

Figures: health and send p50/p99 per phase; the goal is p99 <= 50 ms for both under all loads.

Usage: .venv/bin/python bench/hostile.py [--quick] [--seconds 10]
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import common
import grpc
from common import KiB, Results, log
from grpc_health.v1 import health_pb2, health_pb2_grpc
from measure import quantile

from broker.client import BrokerClient, Message
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

PROBE = "probe"
READ = "read"
WIDE = "wide"
GOAL_MS = 50.0
BIG = 256 << 20


def _stub(address: str) -> pb_grpc.BrokerStub:
    return pb_grpc.BrokerStub(grpc.insecure_channel(address, options=[("grpc.max_send_message_length", BIG),
                                                                      ("grpc.max_receive_message_length", BIG)]))


def bad_sender(address: str, messages: int, ready: Any, stop: Any) -> None:
    stub = _stub(address)
    request = pb.SendRequest(ack=pb.ACK_FLUSH, messages=[pb.PlainMessage(topic=PROBE, body=b"m" * 300)] * messages
                             + [pb.PlainMessage(topic=PROBE, properties={"p": "v" * 70_000})])
    ready.set()
    while not stop.is_set():
        with contextlib.suppress(grpc.RpcError):
            stub.Send(request, timeout=60)


def decoded_reader(address: str, messages: int, ready: Any, stop: Any) -> None:
    stub = _stub(address)
    ready.set()
    while not stop.is_set():
        stub.Pull(pb.PullRequest(topic=READ, queue_id=0, offset=0, max_messages=messages, decode=True), timeout=60)


def pop_holder(address: str, count: int, ready: Any, stop: Any) -> None:
    """``count`` pops parked on the wide topic (over 8 channels), each re-issued when it returns."""
    stubs = [_stub(address) for _ in range(8)]
    request = pb.PopRequest(group="bench", topic=WIDE, max_wait_ms=25_000)

    def park(i: int) -> None:
        if not stop.is_set():
            stubs[i % len(stubs)].Pop.future(request, timeout=60).add_done_callback(lambda _f: park(i))

    for i in range(count):
        park(i)
    ready.set()
    stop.wait()


def _daemon_cpu_share(pid: int, interval_s: float) -> float:
    before = common.cpu_seconds_of(pid)
    time.sleep(interval_s)
    return (common.cpu_seconds_of(pid) - before) / interval_s


@contextlib.contextmanager
def loads(address: str, pid: int, kinds: list[str], quick: bool) -> Iterator[None]:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = []
    plan: dict[str, list[tuple[Callable[..., None], tuple[Any, ...]]]] = {
        "bad sends": [(bad_sender, (address, 2_000 if quick else 20_000))],
        "decoded pulls": [(decoded_reader, (address, 100_000))] * 4,
        "waiting pops": [(pop_holder, (address, 200 if quick else 2_000))],
    }
    for kind in sorted(kinds, key=lambda k: k != "waiting pops"):  # the pops first: see below
        for target, args in plan[kind]:
            ready = ctx.Event()
            p = ctx.Process(target=target, args=(*args, ready, stop), daemon=True)
            p.start()
            ready.wait(120)
            procs.append(p)
        if kind == "waiting pops":
            with BrokerClient(address) as c:
                common.wait_for(lambda: c.status()["long_polls"] >= (200 if quick else 2_000), 120, "the pops parked")
            # a pop counts as waiting from the moment it arrives: wait until the daemon has looked at
            # every one (then they wait, as the 2,000 do), before any other load starts
            common.wait_for(lambda: _daemon_cpu_share(pid, 1.0) < 0.1, 120, "the daemon idle with the pops parked")
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def probe(address: str, seconds: float) -> dict[str, float]:
    """Health checks and one-message ack=flush sends every 20 ms for ``seconds``: p50/p99 of each."""
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    health_s: list[float] = []
    send_s: list[float] = []
    with BrokerClient(address) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.perf_counter()
            health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
            t1 = time.perf_counter()
            c.send(PROBE, [Message(b"p" * KiB)], ack="flush")
            t2 = time.perf_counter()
            health_s.append(t1 - t0)
            send_s.append(t2 - t1)
            time.sleep(max(0.0, 0.02 - (t2 - t0)))
    channel.close()
    h, s = sorted(health_s), sorted(send_s)
    return {"health_p50": 1000 * quantile(h, 0.5), "health_p99": 1000 * quantile(h, 0.99),
            "send_p50": 1000 * quantile(s, 0.5), "send_p99": 1000 * quantile(s, 0.99), "samples": len(h)}


def prepare(address: str) -> None:
    with BrokerClient(address) as c:
        c.create_topic(PROBE)
        c.create_topic(READ)
        c.create_topic(WIDE, queues=1024)
        for _ in range(10):
            c.send(READ, [Message(b"r" * 100)] * 10_000, ack="flush")


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=None, help="probe window per phase (default 10, quick 3)")
    a = p.parse_args()
    seconds = a.seconds or (3.0 if a.quick else 10.0)
    res = Results("hostile", a.results, {"seconds": seconds, "quick": a.quick})
    common.preflight(res, a.max_wait_quiet)
    phases = [[], ["bad sends"], ["decoded pulls"], ["waiting pops"], ["bad sends", "decoded pulls", "waiting pops"]]
    with common.temp_dir("tm-hostile-", a.workdir) as wd, common.running_daemon(wd) as d:
        prepare(d.address)
        for kinds in phases:
            name = " + ".join(kinds) or "quiet"
            assert d.proc is not None
            with loads(d.address, d.proc.pid, kinds, a.quick):
                time.sleep(1.0)  # the loads reach their pace
                f = probe(d.address, seconds)
            log(f"{name}: {f}")
            everything = len(kinds) == 3
            for what in ("health", "send"):
                target, ok = common.at_most(f[f"{what}_p99"], GOAL_MS) if everything else ("", None)
                label = "health check" if what == "health" else "ack=flush send of 1 KiB"
                res.add(f"{label} p99, {name}", f[f"{what}_p99"], "ms", target=target, ok=ok,
                        p50_ms=round(f[f"{what}_p50"], 2), samples=f["samples"])
        res.add("daemon RSS at the end", common.rss_anon_of(d.proc.pid) / 1e6, "MB")
    res.print_table()
    return 0


if __name__ == "__main__":
    threading.excepthook = lambda args: log(f"thread failed: {args.exc_value}")
    sys.exit(main())
