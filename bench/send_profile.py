"""Where an ack=flush send's time goes: the disk row's profile, thread by thread.

One daemon and the producers of ``send_throughput.py`` (``--producers`` x ``--batch`` 1 KiB messages
per send, ack=flush) for one window. Printed, all from that window:

- the machine's CPU by state (/proc/stat): busy, iowait, idle, in cores;
- each daemon thread (by its OS name, ``broker/threads.py``) from /proc/PID/task/TID/schedstat:
  cores on a CPU, cores *runnable but waiting for a CPU*, and context switches per second;
- the daemon's own figures (its /metrics): fsyncs per second, their mean, and the mean time a send
  spends in the daemon against the client's round trip;
- with ``perf`` installed (Debian's ``linux-perf``; ``--no-perf`` skips it): the share of each thread's
  samples whose stack holds a given kernel or library function (writev, fdatasync, recvmsg, futex, ...).

A thread that is runnable but waits for a CPU while the machine shows idle CPU points at wake-up
hand-offs, not at work: the time is lost between threads, not in them.

Usage: .venv/bin/python bench/send_profile.py [--producers 4] [--batch 1000] [--seconds 8] [--no-perf]
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import common
import load
from common import KiB, Results, log

from broker.cli.node_process import free_port
from broker.client import BrokerClient

TOPIC = "bench-profile"
QUEUES = 4
STATES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
# function names looked for in a sample's stack (perf); each thread prints its 6 most frequent
IN_STACK = ("do_writev", "__x64_sys_fdatasync", "sys_recvmsg", "sys_sendmsg", "__x64_sys_pread64", "__x64_sys_futex",
            "epoll_wait", "__schedule", "_PyEval_EvalFrameDefault", "memmove", "crc32c")


def _threads(pid: int) -> dict[str, tuple[str, int, int, int]]:
    """tid -> (OS name, ns on a CPU, ns runnable and waiting, switches) of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns, switches = (int(x) for x in f.read().split())
        except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
            continue
        out[tid] = (name, run_ns, wait_ns, switches)
    return out


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(tidemark_(?:fsync|send)_seconds_(?:sum|count))(\{[^}]*\})? (\S+)$", text, re.M):
        if m.group(1).startswith("tidemark_send") and 'ack="flush"' not in (m.group(2) or ""):
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def _perf_in_stack(data: str, pid: int) -> dict[str, tuple[int, collections.Counter[str]]]:
    """OS thread name -> (samples, samples whose stack holds each ``IN_STACK`` function)."""
    names = {tid: v[0] for tid, v in _threads(pid).items()}
    script = subprocess.run(["perf", "script", "-i", data, "-F", "tid,ip,sym"], capture_output=True, text=True, check=False).stdout
    out: dict[str, tuple[int, collections.Counter[str]]] = {}
    for block in script.split("\n\n"):
        lines = block.strip().splitlines()
        if not lines:
            continue
        tid = lines[0].split()[0]
        name = f"{names.get(tid, '?')} {tid}"
        stack = "\n".join(lines[1:])
        n, hits = out.get(name, (0, collections.Counter()))
        hits.update(k for k in IN_STACK if k in stack)
        out[name] = (n + 1, hits)
    return out


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0] if __doc__ else "")
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1000, help="messages per send")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--no-perf", action="store_true", help="do not sample stacks with perf even where it is installed")
    a = p.parse_args()
    seconds = 4.0 if a.quick else a.seconds
    res = Results("send_profile", a.results, {"producers": a.producers, "batch": a.batch, "seconds": seconds})
    common.preflight(res, a.max_wait_quiet)
    use_perf = not a.no_perf and shutil.which("perf") is not None
    metrics_port = free_port()
    with common.temp_dir("tm-profile-", a.workdir or "/tmp") as wd, \
            common.running_daemon(wd, config={"node.metrics_listen": f"127.0.0.1:{metrics_port}"}) as daemon:
        assert daemon.proc is not None
        pid = daemon.proc.pid
        with BrokerClient(daemon.address) as c:
            c.create_topic(TOPIC, queues=QUEUES)
        args = [(daemon.address, TOPIC, QUEUES, "flush", a.batch, KiB, 0.0, 0.0) for _ in range(a.producers)]
        snaps: dict[str, Any] = {}
        perf_data = os.path.join(wd, "perf.data")

        def at_start() -> None:  # the window opens: first snapshots, then sample until it ends
            snaps["t0"], snaps["threads0"], snaps["machine0"], snaps["metrics0"] = (
                time.monotonic(), _threads(pid), common.cpu_ticks()[:8], _metrics(metrics_port))
            if use_perf:
                snaps["perf"] = subprocess.Popen(["perf", "record", "-q", "-F", "499", "-g", "-p", str(pid), "-o", perf_data,
                                                  "--", "sleep", str(seconds * 0.8)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

            def end() -> None:
                time.sleep(seconds * 0.9)
                snaps["t1"], snaps["threads1"], snaps["machine1"], snaps["metrics1"] = (
                    time.monotonic(), _threads(pid), common.cpu_ticks()[:8], _metrics(metrics_port))
            snaps["ender"] = threading.Thread(target=end)
            snaps["ender"].start()

        w = load.run_window(load.window_producer, args, 2.0, seconds, watch=[pid], at_start=at_start)
        snaps["ender"].join()
        if use_perf:
            snaps["perf"].wait(timeout=60)
        perf = _perf_in_stack(perf_data, pid) if use_perf and os.path.exists(perf_data) else {}
        daemon.stop()

    elapsed = snaps["t1"] - snaps["t0"]
    mb_s = w["rate"] * KiB / 1e6
    lat = w["latencies"]
    log(f"{a.producers} producers x {a.batch} msgs of 1 KiB, ack=flush: {mb_s:,.0f} MB/s, send p50 {1000 * statistics.median(lat):.2f} ms")
    res.add("ack=flush payload MB/s", mb_s, "MB/s", note=f"{a.producers} producers x {a.batch} messages per send")

    ticks = [b - x for x, b in zip(snaps["machine0"], snaps["machine1"], strict=True)]
    cores = os.cpu_count() or 1
    share = {s: cores * t / max(1, sum(ticks)) for s, t in zip(STATES, ticks, strict=True)}
    busy = cores - share["idle"] - share["iowait"]
    res.add("machine busy", busy, "cores", note=f"of {cores}; iowait {share['iowait']:.2f}, idle {share['idle']:.2f} "
            f"(system {share['system']:.2f}, softirq {share['softirq']:.2f}, steal {share['steal']:.2f})")

    m0, m1 = snaps["metrics0"], snaps["metrics1"]
    fsyncs = m1["tidemark_fsync_seconds_count"] - m0["tidemark_fsync_seconds_count"]
    fsync_s = m1["tidemark_fsync_seconds_sum"] - m0["tidemark_fsync_seconds_sum"]
    sends = m1["tidemark_send_seconds_count"] - m0["tidemark_send_seconds_count"]
    in_daemon_s = m1["tidemark_send_seconds_sum"] - m0["tidemark_send_seconds_sum"]
    res.add("fsyncs per second", fsyncs / elapsed, "/s", note=f"mean {1000 * fsync_s / max(fsyncs, 1):.2f} ms; the flusher "
            f"in fdatasync {fsync_s / elapsed:.0%} of the time")
    res.add("mean time of a send in the daemon", 1000 * in_daemon_s / max(sends, 1), "ms",
            note=f"arrival to answer; the client's mean round trip {1000 * statistics.mean(lat):.2f} ms: the rest is the "
                 "request and the answer between the client's call and the handler")

    t0, t1 = snaps["threads0"], snaps["threads1"]
    rows = []
    for tid, (name, run_ns, wait_ns, switches) in t1.items():
        _, run0, wait0, sw0 = t0.get(tid, (name, 0, 0, 0))
        rows.append((name, tid, (run_ns - run0) / 1e9 / elapsed, (wait_ns - wait0) / 1e9 / elapsed, (switches - sw0) / elapsed))
    for name, tid, on_cpu, waiting, switches in sorted(rows, key=lambda r: -(r[2] + r[3]))[:10]:
        if on_cpu + waiting < 0.01:
            continue
        hits = perf.get(f"{name} {tid}")
        stack = "" if hits is None else "; in stack: " + ", ".join(
            f"{k} {v / hits[0]:.0%}" for k, v in hits[1].most_common(6))
        res.add(f"thread {name} ({tid}) on a CPU", on_cpu, "cores",
                note=f"runnable, waiting for a CPU {waiting:.2f}; {switches:,.0f} switches/s{stack}")
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
