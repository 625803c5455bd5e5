"""Send throughput: Tidemark (ack=flush, ack=leader) against Redis 7 XADD (appendfsync always, everysec).

Tidemark: N producer processes, each with its own ``BrokerClient``, each ``send()`` carrying a list of
``--batch`` 1 KiB messages without a key (round robin over the topic's 4 queues, so one request holds
4 batches). Redis: the same N processes with redis-py + hiredis, pipelines of 128 ``XADD`` of a 1 KiB
value (each process on its own stream, ``stream-{i % 4}``). Every system runs for the same window
after a warm-up; the rate is messages acknowledged in the window / window length.

Usage: .venv/bin/python bench/send_throughput.py [--quick] [--producers 4] [--seconds 15]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import common
from common import KiB, Results, log

TOPIC = "bench-send"
QUEUES = 4
REDIS_PIPELINE = 128


def _wait_until(t: float) -> None:
    while (d := t - time.time()) > 0:
        time.sleep(min(d, 0.05))


def tidemark_producer(address: str, ack: str, batch: int, body_bytes: int, start_at: float, warmup_s: float,
                      seconds: float, out: Any) -> None:
    from broker.client import BrokerClient, Message

    body = os.urandom(body_bytes)
    messages = [Message(body=body) for _ in range(batch)]
    count = 0
    latencies: list[float] = []
    first = last = 0.0
    error = ""
    try:
        with BrokerClient(address) as client:
            client.send(TOPIC, messages[:QUEUES], ack=ack)  # connect, learn the queue count
            _wait_until(start_at)
            window_start = start_at + warmup_s
            window_end = window_start + seconds
            while True:
                t0 = time.time()
                if t0 >= window_end:
                    break
                client.send(TOPIC, messages, ack=ack)
                t1 = time.time()
                if t0 >= window_start:
                    if not count:
                        first = t0
                    count += batch
                    last = t1
                    latencies.append(t1 - t0)
    except Exception as exc:  # reported to the parent, which fails the run
        error = f"{type(exc).__name__}: {exc}"
    out.put({"count": count, "first": first, "last": last, "latencies": latencies, "error": error})


def redis_producer(port: int, index: int, body_bytes: int, start_at: float, warmup_s: float, seconds: float,
                   out: Any) -> None:
    import redis

    body = os.urandom(body_bytes)
    stream = f"stream-{index % QUEUES}"
    count = 0
    latencies: list[float] = []
    first = last = 0.0
    error = ""
    try:
        r = redis.Redis(host="127.0.0.1", port=port)
        r.ping()
        _wait_until(start_at)
        window_start = start_at + warmup_s
        window_end = window_start + seconds
        while True:
            t0 = time.time()
            if t0 >= window_end:
                break
            pipe = r.pipeline(transaction=False)
            for _ in range(REDIS_PIPELINE):
                pipe.xadd(stream, {"v": body})
            pipe.execute()
            t1 = time.time()
            if t0 >= window_start:
                if not count:
                    first = t0
                count += REDIS_PIPELINE
                last = t1
                latencies.append(t1 - t0)
        r.close()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    out.put({"count": count, "first": first, "last": last, "latencies": latencies, "error": error})


def run_producers(target: Any, args_for: list[tuple[Any, ...]], warmup_s: float, seconds: float,
                  watch_pid: int | None = None) -> dict[str, float]:
    """Start one process per args tuple, all sending from the same wall-clock instant; aggregate."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0 + 0.3 * len(args_for)  # time to spawn and import
    procs = [ctx.Process(target=target, args=(*a, start_at, warmup_s, seconds, out)) for a in args_for]
    for p in procs:
        p.start()
    cpu0 = 0.0
    if watch_pid:
        _wait_until(start_at + warmup_s)
        cpu0 = common.cpu_seconds_of(watch_pid)
    _wait_until(start_at + warmup_s + seconds)
    cpu1 = common.cpu_seconds_of(watch_pid) if watch_pid else 0.0
    results = [out.get(timeout=seconds + warmup_s + 120) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(f"producer failed: {errors[0]}")
    count = sum(r["count"] for r in results)
    window = max(r["last"] for r in results) - (start_at + warmup_s)
    lat = sorted(x for r in results for x in r["latencies"])
    return {
        "count": count,
        "window_s": window,
        "rate": count / window if window > 0 else 0.0,
        "p50_ms": 1000 * statistics.median(lat) if lat else 0.0,
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
        "server_cpu": (cpu1 - cpu0) / seconds if watch_pid else 0.0,
    }


def bench_tidemark(workdir: str, ack: str, producers: int, batch: int, body: int, warmup_s: float,
                   seconds: float) -> dict[str, float]:
    from broker.client import BrokerClient

    with common.temp_dir(f"tm-send-{ack}-", workdir) as wd, common.running_daemon(wd) as daemon:
        assert daemon.proc is not None
        with BrokerClient(daemon.address) as c:
            c.create_topic(TOPIC, queues=QUEUES)
        args = [(daemon.address, ack, batch, body) for _ in range(producers)]
        log(f"tidemark ack={ack}: {producers} producer processes x {batch} msgs/send, {seconds}s window")
        res = run_producers(tidemark_producer, args, warmup_s, seconds, watch_pid=daemon.proc.pid)
        with BrokerClient(daemon.address) as c:
            st = c.status()
            res["log_bytes"] = float(st["log_bytes"])
            res["stored"] = float(sum(sum(t["max_offsets"]) for t in c.list_topics().values()))
        daemon.stop()
    return res


def bench_redis(workdir: str, appendfsync: str, producers: int, body: int, warmup_s: float,
                seconds: float) -> tuple[dict[str, float], str]:
    server = common.RedisServer(workdir, appendfsync)
    try:
        server.start()
        assert server.proc is not None
        version = server.version()
        log(f"redis {version} appendfsync={appendfsync} on port {server.port}: {producers} processes, "
            f"pipelines of {REDIS_PIPELINE} XADD, {seconds}s window")
        args = [(server.port, i, body) for i in range(producers)]
        res = run_producers(redis_producer, args, warmup_s, seconds, watch_pid=server.proc.pid)
    finally:
        server.stop()
    return res, version


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1000, help="messages per Tidemark send() call")
    p.add_argument("--body", type=int, default=KiB)
    p.add_argument("--seconds", type=float, default=None, help="measured window per system (default 15, quick 3)")
    p.add_argument("--warmup", type=float, default=None, help="unmeasured warm-up per system (default 2, quick 1)")
    p.add_argument("--skip-redis", action="store_true")
    a = p.parse_args()
    seconds = a.seconds or (3.0 if a.quick else 15.0)
    warmup = a.warmup if a.warmup is not None else (1.0 if a.quick else 2.0)
    params = {"producers": a.producers, "batch": a.batch, "body_bytes": a.body, "seconds": seconds, "queues": QUEUES,
              "quick": a.quick}
    res = Results("send_throughput", a.results, params)
    workdir = a.workdir
    common.require_free_disk(workdir or "/tmp", int(3 * 200_000 * a.body * seconds) if not a.quick else 1 << 30)

    tm: dict[str, dict[str, float]] = {}
    for ack in ("flush", "leader"):
        r = bench_tidemark(workdir or "/tmp", ack, a.producers, a.batch, a.body, warmup, seconds)
        tm[ack] = r
        res.add(f"tidemark ack={ack}", r["rate"], "msg/s",
                note=f"p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms per send of {a.batch}; "
                     f"daemon CPU {r['server_cpu']:.2f} cores",
                p50_ms=r["p50_ms"], p99_ms=r["p99_ms"], daemon_cpu_cores=r["server_cpu"], window_s=r["window_s"],
                messages=r["count"])
        res.add(f"tidemark ack={ack} MB/s", r["rate"] * a.body / 1e6, "MB/s", note="payload bytes only")

    if a.skip_redis:
        res.print_table()
        return 0
    rd: dict[str, dict[str, float]] = {}
    version = ""
    for fsync in ("always", "everysec"):
        r, version = bench_redis(workdir or "/tmp", fsync, a.producers, a.body, warmup, seconds)
        rd[fsync] = r
        res.add(f"redis {version} appendfsync={fsync}", r["rate"], "msg/s",
                note=f"p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms per pipeline of {REDIS_PIPELINE}; "
                     f"redis CPU {r['server_cpu']:.2f} cores",
                p50_ms=r["p50_ms"], p99_ms=r["p99_ms"], server_cpu_cores=r["server_cpu"], window_s=r["window_s"],
                messages=r["count"], redis_version=version)

    flush = tm["flush"]["rate"]
    for fsync, want in (("always", 4.0), ("everysec", 1.5)):
        ratio = flush / rd[fsync]["rate"] if rd[fsync]["rate"] else 0.0
        target, ok = common.at_least(ratio, want)
        res.add(f"ratio tidemark_flush / redis_{fsync}", ratio, "x", target=target, ok=ok)
    ratio = tm["leader"]["rate"] / rd["everysec"]["rate"] if rd["everysec"]["rate"] else 0.0
    res.add("ratio tidemark_leader / redis_everysec", ratio, "x", note="for reference (no target)")
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
