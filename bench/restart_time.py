"""Restart time: kill -9 under load with 1 GiB and 4 GiB of log, then a full replay from offset 0.

For each size: fill the log (two producer processes, ``--fill-batch`` x 1 KiB per send, ack=leader),
start a background producer process (1000 x 1 KiB per send, ack=leader, no pause), let it run for
``--load-seconds``, ``kill -9`` the daemon while it sends, restart it and take
``DaemonProcess.ready_seconds`` (process start until gRPC health says SERVING; the target is <= 2 s)
and ``status()["recovery"]``. Every send the background producer saw acknowledged must still be
there after the restart (checked). Then a clean restart (SIGTERM, start) and a full replay: stop,
delete ``checkpoints/``, ``cq/`` and ``metadata/`` (derived views; the log and the identity stay) and
start, so every view is rebuilt from offset 0 (log in the page cache, as it was just written), and
once more with the data directory's pages evicted first (``posix_fadvise(DONTNEED)``, as after a
reboot). The ratios full replay / crash restart are reported.

The start time of an empty data directory is reported as the floor (interpreter, imports, gRPC).
Ready times come from ``common.start_timed`` (spawn until health SERVING, polled every 10-20 ms):
``DaemonProcess.start()`` polls through a channel with gRPC's default reconnect backoff and so
rounds its ``ready_seconds`` up to ~1 s or ~2.6 s; one clean restart per size is timed both ways.

Usage: .venv/bin/python bench/restart_time.py [--quick] [--sizes-mib 1024,4096] [--segment-mib 1024]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import time
from typing import Any

import common
import load
from common import GiB, KiB, MiB, Results, log

from broker.client import BrokerClient, BrokerError, Message
from tests.procs import DaemonProcess

TOPIC = "bench-restart"
QUEUES = 4
TARGET_S = 2.0


def load_producer(address: str, batch: int, body_bytes: int, stop: Any, out: Any) -> None:
    """Send until ``stop`` is set; report the highest acknowledged queue offset per queue."""

    body = os.urandom(body_bytes)
    messages = [Message(body=body) for _ in range(batch)]
    acked: dict[int, int] = {}
    sends = failures = 0
    client = BrokerClient(address, timeout_s=10.0)
    while not stop.is_set():
        try:
            for r in client.send(TOPIC, messages, ack="leader"):
                acked[r.queue_id] = max(acked.get(r.queue_id, -1), r.queue_offset)
            sends += 1
        except BrokerError:
            failures += 1  # the daemon is down: its restart is being measured
            time.sleep(0.05)
    client.close()
    out.put({"acked": acked, "sends": sends, "failures": failures})


def fill_to(daemon: DaemonProcess, target_bytes: int, batch: int, body: int) -> float:

    with BrokerClient(daemon.address) as c:
        have = int(c.status()["log_bytes"])
        if have >= target_bytes:
            return 0.0
        need = target_bytes - have
        count = load.whole_sends(need // 2, batch, body + 8 + 3)  # per process; a keyed record's overhead
        t0 = time.perf_counter()
        load.fill(daemon.address, TOPIC, [count, count], batch, body, keys=64)
        dt = time.perf_counter() - t0
        st = common.wait_applied(c)
        log(f"log now {st['log_bytes'] / GiB:.2f} GiB in {st['segments']} segments "
            f"(filled {need / MiB:,.0f} MiB in {dt:.1f}s, {need / MiB / dt:,.0f} MiB/s)")
    return dt


def run_size(res: Results, daemon: DaemonProcess, size: int, label: str, a: Any) -> None:

    ctx = mp.get_context("spawn")
    fill_to(daemon, size, a.fill_batch, a.body)

    # -- kill -9 under load ----------------------------------------------------------------------
    stop = ctx.Event()
    out = ctx.Queue()
    loader = ctx.Process(target=load_producer, args=(daemon.address, 1000, a.body, stop, out))
    loader.start()
    with BrokerClient(daemon.address) as c:
        before = int(c.status()["max_offset"])
        deadline = time.monotonic() + 60
        while int(c.status()["max_offset"]) == before and time.monotonic() < deadline:
            time.sleep(0.05)  # the loader is connected and sending
        time.sleep(a.load_seconds)
        st = c.status()
    log_at_kill = int(st["max_offset"])
    log(f"{label}: load running (max_offset {st['max_offset']:,}, confirm {st['confirm_offset']:,}, "
        f"applied {st['applied_offset']:,}); kill -9")
    daemon.kill9()
    common.start_timed(daemon, timeout_s=600)
    with BrokerClient(daemon.address) as c:
        st = c.status()
    rec = st["recovery"]
    log(f"{label}: crash restart ready in {daemon.ready_seconds:.3f}s; recovery {rec}")
    stop.set()
    report = out.get(timeout=120)
    loader.join(30)
    with BrokerClient(daemon.address) as c:
        st = common.wait_applied(c)
        highs = c.list_topics()[TOPIC]["max_offsets"]
    lost = {q: off for q, off in report["acked"].items() if off >= highs[q]}
    if lost:
        raise SystemExit(f"{label}: acknowledged messages missing after kill -9: acked {report['acked']}, stored {highs}")
    target, ok = common.at_most(daemon.ready_seconds, TARGET_S)
    res.add(f"{label} kill -9 restart: ready", daemon.ready_seconds, "s", target=target, ok=ok,
            note=f"log {log_at_kill / GiB:.2f} GiB at the kill; recovery {rec['seconds']:.3f}s "
                 f"(scanned {rec['scanned_bytes'] / MiB:,.0f} MiB, replayed {rec['replayed_bytes'] / MiB:,.0f} MiB "
                 f"in {rec['replay_seconds']:.3f}s); acked data intact",
            log_bytes_at_kill=log_at_kill, recovery=rec, load_sends=report["sends"])
    res.add(f"{label} kill -9 restart: recovery passes", float(rec["seconds"]), "s", note="status()['recovery']['seconds']")
    crash_ready = daemon.ready_seconds

    # -- clean restart ---------------------------------------------------------------------------
    daemon.stop()
    common.start_timed(daemon, timeout_s=600)
    with BrokerClient(daemon.address) as c:
        rec = c.status()["recovery"]
    res.add(f"{label} clean restart: ready", daemon.ready_seconds, "s",
            note=f"clean={rec['clean']}, recovery {rec['seconds']:.3f}s, replayed {rec['replayed_bytes'] / MiB:,.0f} MiB",
            recovery=rec)
    daemon.stop()
    daemon.start(timeout_s=600)  # the same clean restart, timed by DaemonProcess.wait_ready itself
    res.add(f"{label} clean restart: ready as DaemonProcess.start() reports it", daemon.ready_seconds, "s",
            note="its health poll waits out gRPC's reconnect backoff (1 s, x1.6), so it rounds up")

    # -- full replay from offset 0 ---------------------------------------------------------------
    daemon.stop()
    for sub in ("checkpoints", "cq", "metadata"):
        shutil.rmtree(os.path.join(daemon.data_dir, sub), ignore_errors=True)
    common.start_timed(daemon, timeout_s=3600)
    with BrokerClient(daemon.address) as c:
        st = c.status()
        rec = st["recovery"]
        highs_after = c.list_topics()[TOPIC]["max_offsets"]
    if highs_after != highs:
        raise SystemExit(f"{label}: full replay rebuilt queue ends {highs_after}, expected {highs}")
    res.add(f"{label} full replay from 0: ready", daemon.ready_seconds, "s",
            note=f"log {st['log_bytes'] / GiB:.2f} GiB; recovery {rec['seconds']:.3f}s, replayed {rec['replayed_bytes'] / MiB:,.0f} MiB in "
                 f"{rec['replay_seconds']:.3f}s ({rec['replayed_bytes'] / MiB / max(rec['replay_seconds'], 1e-9):,.0f} "
                 f"MiB/s); queues rebuilt identical", recovery=rec, log_bytes=st["log_bytes"])
    res.add(f"{label} ratio full replay / kill -9 restart", daemon.ready_seconds / crash_ready, "x")
    warm_replay = daemon.ready_seconds

    # -- the same full replay with the log out of the page cache (as after a reboot) --------------
    daemon.stop()
    for sub in ("checkpoints", "cq", "metadata"):
        shutil.rmtree(os.path.join(daemon.data_dir, sub), ignore_errors=True)
    evicted = common.evict_page_cache(daemon.data_dir)
    common.start_timed(daemon, timeout_s=3600)
    with BrokerClient(daemon.address) as c:
        rec = c.status()["recovery"]
        if c.list_topics()[TOPIC]["max_offsets"] != highs:
            raise SystemExit(f"{label}: cold full replay rebuilt different queue ends")
    res.add(f"{label} full replay from 0, cold page cache: ready", daemon.ready_seconds, "s",
            note=f"{evicted / GiB:.2f} GiB evicted first (posix_fadvise DONTNEED); recovery {rec['seconds']:.3f}s "
                 f"({rec['replayed_bytes'] / MiB / max(rec['replay_seconds'], 1e-9):,.0f} MiB/s)", recovery=rec)
    res.add(f"{label} ratio cold full replay / kill -9 restart", daemon.ready_seconds / crash_ready, "x",
            note=f"warm full replay {warm_replay:.2f}s")


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default=None, help="log sizes to test (default 1024,4096; quick 64,256)")
    p.add_argument("--segment-mib", type=int, default=1024, help="commitlog.segment_bytes in MiB (default: the default, 1024)")
    p.add_argument("--fill-batch", type=int, default=4000)
    p.add_argument("--body", type=int, default=KiB)
    p.add_argument("--load-seconds", type=float, default=None, help="load before kill -9 (default 3, quick 1.5)")
    a = p.parse_args()
    sizes = [int(x) * MiB for x in (a.sizes_mib or ("64,256" if a.quick else "1024,4096")).split(",")]
    if a.load_seconds is None:
        a.load_seconds = 1.5 if a.quick else 3.0
    segment = a.segment_mib * MiB
    params = {"segment_bytes": segment, "fill_batch": a.fill_batch, "body_bytes": a.body, "load_seconds": a.load_seconds,
              "quick": a.quick}
    res = Results("restart_time", a.results, params)
    common.preflight(res, a.max_wait_quiet, a.malloc_tuned)
    parent = a.workdir or "/tmp"
    common.require_free_disk(parent, int(max(sizes) * 1.3) + 2 * GiB)
    with common.temp_dir("tm-restart-", parent) as wd:

        with common.running_daemon(wd, config={"commitlog.segment_bytes": segment}, timeout_s=600) as daemon:
            res.add("commitlog.segment_bytes", segment / MiB, "MiB", note="the default" if segment == 1 << 30 else "not the default")
            res.add("empty data dir: ready", daemon.ready_seconds, "s", note="floor: interpreter + imports + gRPC start")
            with BrokerClient(daemon.address) as c:
                c.create_topic(TOPIC, queues=QUEUES)
            for size in sizes:
                label = f"{size / GiB:g} GiB" if size >= GiB else f"{size // MiB} MiB"
                run_size(res, daemon, size, label, a)
            daemon.stop()
        log(f"data dir size at the end: {common.dir_bytes(wd) / GiB:.2f} GiB (removed now)")
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
