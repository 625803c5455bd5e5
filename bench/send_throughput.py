"""Send throughput: Tidemark (ack=flush, ack=leader) against Redis 7 XADD (appendfsync always, everysec).

Tidemark: N producer processes, each with its own ``BrokerClient``, each ``send()`` carrying a list of
``--batch`` 1 KiB messages without a key (the client spreads keyless sends over the topic's 4 queues).
Redis: the same N processes with redis-py + hiredis, pipelines of 128 ``XADD`` of a 1 KiB value (each
process on its own stream, ``stream-{i % 4}``). Every system runs for the same window
after a warm-up; the rate is messages acknowledged in the window / window length. The four systems run
``--rounds`` times, interleaved (the machine's disk and CPU drift: single runs of Redis with
appendfsync=always ranged 24k-50k msg/s here); the figures are medians, the ratios are ratios of medians.

The physical limit is probed in each round too, right after the Tidemark windows, in the same directory:
one process writing 1 MiB blocks to a file, each followed by ``fdatasync``, for the same window
(``disk_probe``). Tidemark's ack=flush payload MB/s over that MB/s is how close a group-committed send
comes to what the disk itself allows with one sync per MiB. The probe gives each synced block's pages
back to the kernel (``posix_fadvise DONTNEED``), so it measures the disk and not the page cache: on
these VMs a write into pages the guest never touched costs 2.5-2.8 ms a MiB against 0.35 ms into
recycled ones, and a probe that let its file's cache grow measured 258-470 MB/s one evening and
1.3 GB/s another morning on the same disk.

The ceiling for these clients on these cores is measured in each round as well: the same producers
against a Broker server that stores nothing (``grpc_floor.null_broker``: it reads the request as the
daemon does and answers receipts). Its MB/s over the disk's is what the disk row could reach if the
daemon's own work cost nothing; Tidemark over it is how much of that ceiling the daemon keeps.

The same send once more with ``--deep-producers`` x ``--deep-batch`` (8 x 2000: four times the bytes in
flight, ``DEEP``). With 4 sends of 1 MB in flight the pair leaves about half a core idle: each send's
time is mostly hops (the request reaching the handler, the wait for the group's fsync, the answer), not
CPU. The deeper run shows what the daemon takes once the clients keep the machine busy, and the CPU
ceiling row what both cores allow at the CPU per MB measured: ``cores / (daemon + clients ms per MB)``.

The storage + transport ceiling needs no daemon at all: the machine's CPU per MB while the null broker
and its clients ran (receiving) plus the machine's CPU per MB while the disk probe ran (writing and
syncing), both from the same round. ``cores / (their sum)`` over the disk's MB/s estimates what a
broker whose only work were these two could reach with these clients on these cores. An estimate:
the two are measured apart (neither run saturates the machine), and the probe's pattern (1 MiB, then
fdatasync) is the one the disk row is measured against, not the cheapest way to write.

Usage: .venv/bin/python bench/send_throughput.py [--quick] [--producers 4] [--seconds 15]
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import common
import grpc_floor
import load
import redis
from common import KiB, Results, log
from measure import redo_while_disturbed

from broker.client import BrokerClient

TOPIC = "bench-send"
QUEUES = 4
REDIS_PIPELINE = 128
DISK_RATIO_TARGET = 0.9
NULL_BROKER = "null broker (stores nothing)"
DEEP = "tidemark ack=flush deep"


def redis_producer(port: int, index: int, body_bytes: int, start_at: float, warmup_s: float, seconds: float,
                   out: Any) -> None:
    """Pipelines of ``REDIS_PIPELINE`` XADD on stream ``stream-{index % 4}`` through one window (``load.send_window``)."""

    body = os.urandom(body_bytes)
    stream = f"stream-{index % QUEUES}"

    def send() -> None:
        pipe = r.pipeline(transaction=False)
        for _ in range(REDIS_PIPELINE):
            pipe.xadd(stream, {"v": body})
        pipe.execute()

    try:
        r = redis.Redis(host="127.0.0.1", port=port)
        r.ping()
        report = load.send_window(send, REDIS_PIPELINE, start_at, warmup_s, seconds)
        r.close()
    except Exception as exc:  # reported to the parent, which fails the run
        report = load.failed_window(exc)
    out.put(report)


def run_producers(target: Any, args_for: list[tuple[Any, ...]], warmup_s: float, seconds: float,
                  watch_pid: int) -> dict[str, Any]:
    """One window of one process per args tuple (``load.run_window``); rate, latencies, CPU in cores."""
    w = load.run_window(target, args_for, warmup_s, seconds, watch=[watch_pid])
    lat, cpu = w["latencies"], w["cpu"]
    return {
        "count": w["count"],
        "window_s": w["window_s"],
        "rate": w["rate"],
        "p50_ms": 1000 * statistics.median(lat) if lat else 0.0,
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
        "server_cpu": cpu.procs[watch_pid] / seconds,
        "client_cpu": w["client_cpu"],
        "machine_cpu": cpu.machine / seconds,
    }


def bench_tidemark(workdir: str, ack: str, producers: int, batch: int, body: int, warmup_s: float,
                   seconds: float) -> dict[str, Any]:

    with common.temp_dir(f"tm-send-{ack}-", workdir) as wd, common.running_daemon(wd) as daemon:
        assert daemon.proc is not None
        with BrokerClient(daemon.address) as c:
            c.create_topic(TOPIC, queues=QUEUES)
        args = [(daemon.address, TOPIC, QUEUES, ack, batch, body, 0.0, 0.0) for _ in range(producers)]
        log(f"tidemark ack={ack}: {producers} producer processes x {batch} msgs/send, {seconds}s window")
        res = run_producers(load.window_producer, args, warmup_s, seconds, watch_pid=daemon.proc.pid)
        with BrokerClient(daemon.address) as c:
            st = c.status()
            res["log_bytes"] = float(st["log_bytes"])
            res["stored"] = float(sum(sum(t["max_offsets"]) for t in c.list_topics().values()))
        if res["stored"] < res["count"]:
            raise RuntimeError(f"the daemon stores {res['stored']:.0f} messages, fewer than the {res['count']:.0f} acknowledged")
        daemon.stop()
    return res


def bench_null_broker(producers: int, batch: int, body: int, warmup_s: float, seconds: float) -> dict[str, Any]:
    """The same producers against ``grpc_floor.null_broker``: a server that stores nothing."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    server = ctx.Process(target=grpc_floor.null_broker, args=(ports, TOPIC, QUEUES), daemon=True)
    server.start()
    try:
        address = f"127.0.0.1:{ports.get(timeout=60)}"
        args = [(address, TOPIC, QUEUES, "flush", batch, body, 0.0, 0.0) for _ in range(producers)]
        log(f"null broker: {producers} producer processes x {batch} msgs/send, {seconds}s window")
        return run_producers(load.window_producer, args, warmup_s, seconds, watch_pid=server.pid or 0)
    finally:
        server.kill()
        server.join()


def disk_probe(workdir: str, seconds: float, block_bytes: int = 1 << 20) -> tuple[float, float]:
    """MB/s of ``block_bytes`` writes, each followed by ``fdatasync``, into a fresh file in ``workdir``
    (each block's pages given back once synced: see the module's docstring), and the machine's busy
    cores meanwhile (the probe's own CPU, the kernel's writeback and interrupts included)."""
    block = os.urandom(block_bytes)
    with common.temp_dir("tm-disk-", workdir) as wd:
        fd = os.open(os.path.join(wd, "probe"), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            written = 0
            busy0 = common.machine_busy_seconds()  # as the machine's CPU of every other run is counted
            t0 = time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < seconds:
                n = os.write(fd, block)
                os.fdatasync(fd)
                os.posix_fadvise(fd, written, n, os.POSIX_FADV_DONTNEED)  # clean now: its pages are recycled
                written += n
            busy_cores = (common.machine_busy_seconds() - busy0) / elapsed
        finally:
            os.close(fd)
    return written / elapsed / 1e6, busy_cores


def bench_redis(workdir: str, appendfsync: str, producers: int, body: int, warmup_s: float,
                seconds: float) -> tuple[dict[str, Any], str]:
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


def bench_system(name: str, a: Any, warmup: float, seconds: float, round_no: int, _attempt: int) -> dict[str, Any]:
    """One window of ``tidemark ack=<mode>``, ``redis appendfsync=<mode>`` (then the Redis version in
    ``version``) or the null broker."""
    mode = name.rsplit("=", maxsplit=1)[-1]
    workdir = a.workdir or "/tmp"
    if name == DEEP:
        r: dict[str, Any] = bench_tidemark(workdir, "flush", a.deep_producers, a.deep_batch, a.body, warmup, seconds)
    elif name.startswith("tidemark"):
        r = bench_tidemark(workdir, mode, a.producers, a.batch, a.body, warmup, seconds)
    elif name == NULL_BROKER:
        r = bench_null_broker(a.producers, a.batch, a.body, warmup, seconds)
    else:
        r, version = bench_redis(workdir, mode, a.producers, a.body, warmup, seconds)
        r["version"] = version
    r["other_cpu"] = max(0.0, r["machine_cpu"] - r["server_cpu"] - r["client_cpu"])
    log(f"round {round_no}: {name}: {r['rate']:,.0f} msg/s (CPU: server {r['server_cpu']:.2f}, clients "
        f"{r['client_cpu']:.2f}, machine {r['machine_cpu']:.2f} cores)")
    return r


def _ms_per_mb(r: dict[str, Any], key: str, body: int) -> float:
    """CPU milliseconds (of ``key``: server_cpu or client_cpu, in cores) per payload MB of run ``r``."""
    return 1000 * r[key] / (r["rate"] * body / 1e6)


def _cpu_budget(res: Results, runs: dict[str, list[dict[str, Any]]], body: int,
                disk_mbps: float) -> None:
    """The disk row's floor on this machine, as arithmetic on CPU measured in the same run: at 0.9 of
    the disk the clients and the daemon together may spend ``cores / (0.9 * disk MB/s)`` per MB. The
    clients' share is what they spend against the server that stores nothing (their least); the rest
    is the daemon's budget, to set against what receiving alone costs (the null broker's server)."""
    cores = os.cpu_count() or 1
    flush, null = (sorted(runs[name], key=lambda r: r["rate"])[len(runs[name]) // 2] for name in ("tidemark ack=flush", NULL_BROKER))
    total_ms = 1000 * cores / (DISK_RATIO_TARGET * disk_mbps)
    clients_ms = _ms_per_mb(null, "client_cpu", body)
    for name, r in (("tidemark ack=flush daemon", flush), ("null broker server", null)):
        res.add(f"CPU ms per payload MB, {name}", _ms_per_mb(r, "server_cpu", body), "ms",
                note=f"clients {_ms_per_mb(r, 'client_cpu', body):.2f} ms; machine {r['machine_cpu']:.2f} of {cores} cores busy")
    deep = sorted(runs[DEEP], key=lambda r: r["rate"])[len(runs[DEEP]) // 2]
    both_ms = _ms_per_mb(deep, "server_cpu", body) + _ms_per_mb(deep, "client_cpu", body)
    res.add("ratio CPU ceiling / disk 1 MiB + fdatasync MB/s", 1000 * cores / both_ms / disk_mbps, "x",
            note=f"{cores} cores / ({_ms_per_mb(deep, 'server_cpu', body):.2f} ms daemon + {_ms_per_mb(deep, 'client_cpu', body):.2f} "
            f"ms clients per MB, deep run) = {1000 * cores / both_ms:,.0f} MB/s, if every cycle of both cores went to sends")
    res.add("CPU ms per payload MB the daemon may spend for the disk row's goal", total_ms - clients_ms,
            "ms", note=f"{cores} cores / ({DISK_RATIO_TARGET} x {disk_mbps:,.0f} MB/s) = {total_ms:.2f} ms for clients and "
            f"daemon, less the clients' {clients_ms:.2f} (against the null broker); receiving alone costs "
            f"{_ms_per_mb(null, 'server_cpu', body):.2f}, tidemark {_ms_per_mb(flush, 'server_cpu', body):.2f}")


def _storage_transport_ceiling(res: Results, null_runs: list[dict[str, Any]], disk: list[float],
                               disk_ms_per_mb: list[float], body: int) -> None:
    """An estimate of what a broker on these cores could reach whose only work were receiving (the
    null broker's server, with its clients: the machine's CPU per MB of that run) and writing with one
    fdatasync per MiB (the probe's: the machine's CPU per MB while it ran): ``cores / (both ms per
    MB)``, against the disk, per round. It needs no daemon, so it is the disk row's ceiling on this
    machine whatever the daemon's own code costs (see the module's docstring for what it assumes)."""
    cores = os.cpu_count() or 1
    ratios: list[float] = []
    notes: list[str] = []
    for null, d, d_ms in zip(null_runs, disk, disk_ms_per_mb, strict=True):
        transport_ms = 1000 * null["machine_cpu"] / (null["rate"] * body / 1e6)
        ratios.append(1000 * cores / (transport_ms + d_ms) / d)
        notes.append(f"{transport_ms:.2f} + {d_ms:.2f}")
    res.add("ratio storage + transport CPU ceiling / disk 1 MiB + fdatasync MB/s", statistics.median(ratios), "x",
            note=f"{cores} cores / (ms per MB receiving, null broker and clients + writing and syncing, disk probe) "
            f"per round: {' / '.join(notes)} ms; ratios " + " / ".join(f"{r:.2f}" for r in ratios),
            rates=ratios)


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1000, help="messages per Tidemark send() call")
    p.add_argument("--body", type=int, default=KiB)
    p.add_argument("--seconds", type=float, default=None, help="measured window per system (default 15, quick 3)")
    p.add_argument("--warmup", type=float, default=None, help="unmeasured warm-up per system (default 2, quick 1)")
    p.add_argument("--deep-producers", type=int, default=8, help=f"producers of the '{DEEP}' run")
    p.add_argument("--deep-batch", type=int, default=2000, help=f"messages per send of the '{DEEP}' run")
    p.add_argument("--skip-redis", action="store_true")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds of every system; medians (default 3, quick 1)")
    a = p.parse_args()
    seconds = a.seconds or (3.0 if a.quick else 15.0)
    warmup = a.warmup if a.warmup is not None else (1.0 if a.quick else 2.0)
    a.rounds = a.rounds or (1 if a.quick else 3)
    params = {"producers": a.producers, "batch": a.batch, "body_bytes": a.body, "seconds": seconds, "queues": QUEUES,
              "rounds": a.rounds, "quick": a.quick}
    res = Results("send_throughput", a.results, params)
    common.preflight(res, a.max_wait_quiet, a.malloc_tuned)
    workdir = a.workdir
    common.require_free_disk(workdir or "/tmp", int(3 * 200_000 * a.body * seconds) if not a.quick else 1 << 30)

    systems = ["tidemark ack=flush", "tidemark ack=leader", NULL_BROKER, DEEP]
    if not a.skip_redis:
        systems += ["redis appendfsync=always", "redis appendfsync=everysec"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    disk: list[float] = []
    disk_ms_per_mb: list[float] = []  # the machine's CPU per MB while the probe ran
    version = ""
    for round_no in range(1, a.rounds + 1):
        log(f"round {round_no} of {a.rounds}")
        for name in systems:  # interleaved, so slow drifts of the machine hit every system alike
            r = redo_while_disturbed(functools.partial(bench_system, name, a, warmup, seconds, round_no),
                                     lambda: common.wait_for_quiet(a.max_wait_quiet))
            version = r.pop("version", version)
            runs[name].append(r)
            if name == "tidemark ack=leader":
                mbps, busy = disk_probe(a.workdir or "/tmp", seconds)
                disk.append(mbps)
                disk_ms_per_mb.append(1000 * busy / mbps)
                log(f"round {round_no}: disk 1 MiB writes + fdatasync: {mbps:,.0f} MB/s ({busy:.2f} cores busy)")

    median: dict[str, float] = {}
    for name in systems:
        rs = runs[name]
        rates = [r["rate"] for r in rs]
        median[name] = statistics.median(rates)
        mid = sorted(rs, key=lambda r: r["rate"])[len(rs) // 2]
        label = name.replace("redis", f"redis {version}") if name.startswith("redis") else name
        redis_run = name.startswith("redis")
        unit_note = (f"per pipeline of {REDIS_PIPELINE}" if redis_run else
                     f"{a.deep_producers} producers, per send of {a.deep_batch}" if name == DEEP else f"per send of {a.batch}")
        server = "redis" if redis_run else "daemon" if name.startswith("tidemark") else "server"
        res.add(label, median[name], "msg/s",
                note=f"median of {len(rates)}: " + " / ".join(f"{x:,.0f}" for x in rates)
                     + f"; p50 {mid['p50_ms']:.1f} ms p99 {mid['p99_ms']:.1f} ms {unit_note}; CPU: {server} "
                     f"{mid['server_cpu']:.2f}, clients {mid['client_cpu']:.2f}, machine {mid['machine_cpu']:.2f} cores; "
                     f"max other {max(r['other_cpu'] for r in rs):.2f}",
                rates=rates, p50_ms=mid["p50_ms"], p99_ms=mid["p99_ms"], server_cpu_cores=mid["server_cpu"],
                client_cpu_cores=mid["client_cpu"], machine_cpu_cores=mid["machine_cpu"], window_s=mid["window_s"],
                messages=mid["count"], redis_version=version)
        if not redis_run:
            res.add(f"{name} MB/s", median[name] * a.body / 1e6, "MB/s", note="payload bytes only")

    flush = "tidemark ack=flush"
    disk_mbps = statistics.median(disk)
    res.add("disk 1 MiB writes + fdatasync", disk_mbps, "MB/s", note="median of " + " / ".join(f"{x:,.0f}" for x in disk),
            rates=disk)
    target, ok = common.at_least(median[flush] * a.body / 1e6 / disk_mbps, DISK_RATIO_TARGET)
    res.add("ratio ack=flush MB/s / disk 1 MiB + fdatasync MB/s", median[flush] * a.body / 1e6 / disk_mbps, "x",
            target=target, ok=ok, note="payload bytes; per round: " + " / ".join(
                f"{r['rate'] * a.body / 1e6 / d:.2f}" for r, d in zip(runs[flush], disk, strict=True)))
    res.add("ratio ack=flush deep MB/s / disk 1 MiB + fdatasync MB/s", median[DEEP] * a.body / 1e6 / disk_mbps, "x",
            note=f"{a.deep_producers} producers x {a.deep_batch} messages per send; per round: " + " / ".join(
                f"{r['rate'] * a.body / 1e6 / d:.2f}" for r, d in zip(runs[DEEP], disk, strict=True)))
    null_mbps = median[NULL_BROKER] * a.body / 1e6
    res.add("ratio null broker MB/s / disk 1 MiB + fdatasync MB/s", null_mbps / disk_mbps, "x",
            note="the disk row's ceiling if storing cost nothing, with these clients on these cores; per round: " + " / ".join(
                f"{r['rate'] * a.body / 1e6 / d:.2f}" for r, d in zip(runs[NULL_BROKER], disk, strict=True)))
    res.add("ratio tidemark_flush / null broker", median[flush] / median[NULL_BROKER], "x",
            note="of the medians; per round: " + " / ".join(
                f"{t['rate'] / n['rate']:.2f}" for t, n in zip(runs[flush], runs[NULL_BROKER], strict=True)))
    _cpu_budget(res, runs, a.body, disk_mbps)
    _storage_transport_ceiling(res, runs[NULL_BROKER], disk, disk_ms_per_mb, a.body)
    if not a.skip_redis:
        for fsync, want in (("always", 6.0), ("everysec", 1.5)):
            other = f"redis appendfsync={fsync}"
            ratio = median[flush] / median[other] if median[other] else 0.0
            paired = [t["rate"] / r["rate"] for t, r in zip(runs[flush], runs[other], strict=True) if r["rate"]]
            target, ok = common.at_least(ratio, want)
            res.add(f"ratio tidemark_flush / redis_{fsync}", ratio, "x", target=target, ok=ok,
                    note="of the medians; per round: " + " / ".join(f"{x:.2f}" for x in paired), paired=paired)
        other = "redis appendfsync=everysec"
        ratio = median["tidemark ack=leader"] / median[other] if median[other] else 0.0
        res.add("ratio tidemark_leader / redis_everysec", ratio, "x", note="for reference (no target)")
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
