"""Timer messages: scheduling rate, fire lateness, restart with 1M pending timers, wheel memory.

1. Scheduling + memory + restart (one daemon). Two producer processes send ``--timers`` delayed
   messages (``--body`` bytes, ``--batch`` per send, ack=flush) due an hour from now (so none
   fires during the run): the scheduling rate is timers acknowledged per second (target >= 200,000); beside it,
   the rate until every timer is pending in the wheel (the view applied it).
   RssAnon of the idle daemon (topic created) and with every timer pending once the views applied
   everything: the difference is the wheel's memory (target <= 150 MB). Then, after a wheel
   snapshot exists, ``kill -9`` and restart: the time from spawn until gRPC health says SERVING
   (recovery, wheel restored, port serving) from the snapshot (target <= 1 s); again with the
   snapshots deleted (rebuilt from the timer log alone), and with the whole timer directory
   deleted (rebuilt by replaying the commit log). Every restart must report the same pending count.
2. Lateness (a fresh daemon, ``timer.precision_ms = 100``). ``--timers`` timers due uniformly over
   ``--window-s`` seconds, scheduled before the window starts; after it, every delivery is read back:
   lateness = the delivery batch's store time - ``deliver_at_ms`` (p50, p99, max; target p99 <= 200 ms).
   Checked: every timer delivered exactly once and none early.

Usage: .venv/bin/python bench/timers.py [--quick] [--timers 1000000] [--window-s 60]
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Any

import common
import load
from common import Results, log

from broker.client import BrokerClient, Message
from broker.timers import snapshot as snaps
from tests.procs import DaemonProcess

TOPIC = "bench-timers"
QUEUES = 4
HOUR_MS = 3_600_000
TARGET_SCHEDULE_S = 200_000  # timers acknowledged per second (the performance round's goal)


def producer(address: str, count: int, batch: int, body_bytes: int, start_ms: int, window_ms: int, first: int,
             total: int, out: Any) -> None:
    """Schedule timers ``first .. first+count`` of ``total``, due evenly over [start, start+window)."""

    body = os.urandom(body_bytes)
    sent = 0
    with BrokerClient(address) as client:
        t0 = time.monotonic()
        while sent < count:
            n = min(batch, count - sent)
            msgs = [Message(body=body, deliver_at_ms=start_ms + ((first + sent + i) * window_ms) // total)
                    for i in range(n)]
            client.send(TOPIC, msgs, ack="flush")
            sent += n
        out.put((sent, time.monotonic() - t0))


def schedule(address: str, total: int, batch: int, body_bytes: int, start_ms: int, window_ms: int,
             procs: int = 2) -> tuple[int, float]:
    share = total // procs
    args = [(address, share, batch, body_bytes, start_ms, window_ms, i * share, total) for i in range(procs)]
    t0 = time.monotonic()
    results = load.run_processes(producer, args, timeout_s=None)
    elapsed = time.monotonic() - t0
    sent = sum(r[0] for r in results)
    return sent, max(r[1] for r in results) or elapsed


def wait_applied(d: DaemonProcess) -> dict[str, Any]:

    with BrokerClient(d.address) as c:
        return common.wait_applied(c)


def newest_snapshot_covers(d: DaemonProcess) -> bool:

    snap_dir = os.path.join(d.data_dir, "timer", "snapshots")
    positions = snaps.positions(snap_dir)
    log_dir = os.path.join(d.data_dir, "timer", "log")
    end = sum(os.path.getsize(os.path.join(log_dir, n)) for n in os.listdir(log_dir))
    return bool(positions) and positions[0] >= end - 4096  # only MARK records after it


def restart_phase(res: Results, a: Any, workdir: str) -> None:
    d = DaemonProcess(os.path.join(workdir, "restart"), config={"timer.precision_ms": 100}).start()
    try:

        with BrokerClient(d.address) as c:
            c.create_topic(TOPIC, queues=QUEUES)
        time.sleep(1.0)
        idle = d.rss_anon_bytes()
        start = int(time.time() * 1000) + HOUR_MS
        t0 = time.monotonic()
        sent, elapsed = schedule(d.address, a.timers, a.batch, a.body, start, a.window_s * 1000)
        rate = sent / elapsed
        target, ok = common.at_least(rate, TARGET_SCHEDULE_S)
        res.add("scheduling rate (2 producer processes, ack=flush)", rate, "timers/s", target=target, ok=ok,
                timers=sent, batch=a.batch, body_bytes=a.body)
        st = wait_applied(d)
        in_wheel_s = time.monotonic() - t0
        assert st["timer_pending"] == sent, st["timer_pending"]
        res.add("timers in the wheel per second (first send until every timer is pending in the view)",
                sent / in_wheel_s, "timers/s", note=f"{sent:,} in {in_wheel_s:.2f}s")
        time.sleep(1.0)
        loaded = d.rss_anon_bytes()
        target, ok = common.at_most((loaded - idle) / 1e6, 150)
        res.add(f"RssAnon with {sent:,} timers pending, over the idle daemon", (loaded - idle) / 1e6, "MB",
                target=target, ok=ok, idle_mb=round(idle / 1e6, 1), loaded_mb=round(loaded / 1e6, 1),
                index_bytes=st["timer_wheel"]["index_bytes"])
        deadline = time.monotonic() + 60
        while not newest_snapshot_covers(d) and time.monotonic() < deadline:
            time.sleep(0.5)
        cases = [("from the newest wheel snapshot", None, "snapshot@", 1.0),
                 ("without snapshots (rebuilt from the timer log)", "timer/snapshots", "timer log rebuild", None),
                 ("without any timer state (commit-log replay)", "timer", "nothing", None)]
        base = 0.0
        for name, delete, source, limit in cases:
            d.kill9()
            if delete:
                shutil.rmtree(os.path.join(d.data_dir, delete))
            ready = common.start_timed(d)
            st = common.status(d.address)
            assert st["timer_pending"] == sent and st["timer_wheel"]["pending"] == sent, (st["timer_pending"], st["timer_wheel"])
            assert st["timer_wheel"]["loaded_from"].startswith(source), st["timer_wheel"]["loaded_from"]
            target, ok = common.at_most(ready, limit) if limit else ("", None)
            base = base or ready
            res.add(f"restart with {sent:,} pending, {name}: spawn to SERVING", ready, "s", target=target, ok=ok,
                    recovery_s=st["recovery"]["seconds"], loaded_from=st["timer_wheel"]["loaded_from"],
                    ratio_to_snapshot=round(ready / base, 2))
            if not delete:
                res.add("RssAnon after the restart from the snapshot, over the idle daemon", (d.rss_anon_bytes() - idle) / 1e6, "MB")
            wait_applied(d)
            deadline = time.monotonic() + 60
            while not newest_snapshot_covers(d) and time.monotonic() < deadline:
                time.sleep(0.5)
    finally:
        d.kill9()


def lateness_phase(res: Results, a: Any, workdir: str, lead_s: float) -> None:
    d = DaemonProcess(os.path.join(workdir, "lateness"), config={"timer.precision_ms": 100}).start()
    try:

        with BrokerClient(d.address) as c:
            c.create_topic(TOPIC, queues=QUEUES)
        start = int(time.time() * 1000) + int(lead_s * 1000)
        window_ms = a.window_s * 1000
        sent, elapsed = schedule(d.address, a.timers, a.batch, a.body, start, window_ms)
        log(f"scheduled {sent:,} in {elapsed:.1f}s; firing starts in {(start - time.time() * 1000) / 1000:.1f}s")
        if time.time() * 1000 > start:
            log("WARNING: scheduling took longer than the lead: the first timers fire late by design of this run")
        while time.time() * 1000 < start + window_ms + 2000:
            time.sleep(0.5)
        st = wait_applied(d)
        late: list[int] = []
        seen: set[int] = set()
        dup = early = 0
        with BrokerClient(d.address) as c:
            for q in range(QUEUES):
                for r in c.iter_pull(TOPIC, q, 0, max_messages=20_000):
                    for m in r:
                        p = m._all_properties()
                        off = int(p["__timer_offset"])
                        dup += off in seen
                        seen.add(off)
                        lateness = m.store_time_ms - int(p["__deliver_at_ms"])
                        early += lateness < 0
                        late.append(lateness)
        late.sort()
        n = len(late)
        assert n == sent and not dup and not early, (n, sent, dup, early)
        p50, p99, worst = late[n // 2], late[min(n - 1, int(n * 0.99))], late[-1]
        target, ok = common.at_most(p99, 200)
        res.add(f"fire lateness p99, {sent:,} timers due over {a.window_s}s (precision 100 ms)", p99, "ms",
                target=target, ok=ok, p50_ms=p50, max_ms=worst, pending_after=st["timer_pending"],
                rate_per_s=round(sent / a.window_s))
        res.add("fire lateness p50", p50, "ms")
        res.add("fire lateness max", worst, "ms")
    finally:
        d.kill9()


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--timers", type=int, default=None, help="timers per phase (default 1,000,000; quick 100,000)")
    p.add_argument("--window-s", type=int, default=None, help="firing window, seconds (default 60; quick 10)")
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--body", type=int, default=200)
    p.add_argument("--only", default="", help="restart or lateness")
    a = p.parse_args()
    a.timers = a.timers or (100_000 if a.quick else 1_000_000)
    a.window_s = a.window_s or (10 if a.quick else 60)
    res = Results("timers", a.results, {"timers": a.timers, "window_s": a.window_s, "quick": a.quick})
    common.preflight(res, a.max_wait_quiet, a.malloc_tuned)
    with common.temp_dir("bench-timers-", a.workdir) as workdir:
        if a.only in ("", "restart"):
            restart_phase(res, a, workdir)
        rate = next((f.value for f in res.figures if f.metric.startswith("scheduling rate")), 50_000.0)
        if a.only in ("", "lateness"):
            lateness_phase(res, a, workdir, lead_s=a.timers / rate * 1.5 + 5)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
