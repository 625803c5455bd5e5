"""Shared helpers for the benchmarks: result lines and tables, waiting for a quiet machine, daemons in
temp dirs, Redis. Producer processes are in ``load.py``; watching a measurement (who used the CPU,
redoing a disturbed one, samplers, py-spy) in ``measure.py``.

Every benchmark script records its figures with ``Results.add()``. Each figure is one JSON line
appended to ``bench/results/<run id>.jsonl`` (gitignored) and printed as a table at the end of
the script; ``run_all.py`` reads the same file back and prints every table once more.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

if REPO_DIR not in sys.path:  # the venv installs the package editable; this covers a bare checkout
    sys.path.insert(0, REPO_DIR)

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from broker.client import BrokerClient  # noqa: E402

try:
    from tests.procs import DaemonProcess, free_port
except ImportError:  # an older revision (benchmarked with these scripts copied into its checkout)
    from broker.procs import DaemonProcess, free_port  # type: ignore[no-redef]


def log(text: str) -> None:
    """Progress line on stderr (stdout carries the tables)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# -- command line --------------------------------------------------------------------------------
def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small-scale smoke run")
    p.add_argument("--results", help="JSON-lines file to append results to (default: a new file in bench/results/)")
    p.add_argument("--workdir", default=None, help="parent directory for temporary data (default: $TMPDIR or /tmp)")
    p.add_argument("--malloc-tuned", action="store_true",
                   help="diagnosis only: run daemon and clients with glibc's mmap/trim thresholds raised to 256 MiB/1 GiB, "
                        "so big buffers are reused instead of mmapped and page-faulted afresh each time")
    p.add_argument("--max-wait-quiet", type=float, default=600.0,
                   help="wait up to this many seconds for other load on the machine to end before measuring")
    return p


# -- the machine ---------------------------------------------------------------------------------
def cpu_ticks() -> list[int]:
    """The machine's CPU ticks from /proc/stat: user, nice, system, idle, iowait, irq, ..."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def cpu_busy_fraction(interval_s: float = 1.0) -> float:
    """Share of all CPUs busy over ``interval_s`` (from /proc/stat)."""

    def snap() -> tuple[int, int]:
        vals = cpu_ticks()
        return sum(vals), vals[3] + vals[4]

    t0, i0 = snap()
    time.sleep(interval_s)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def _proc_table() -> dict[int, tuple[int, str]]:
    table: dict[int, tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        table[int(name)] = (ppid, cmd)
    return table


def foreign_processes() -> list[str]:
    """Daemons, test runs and Redis servers on this machine that this benchmark run did not start."""
    table = _proc_table()
    root = os.getpid()
    parent = table.get(root, (0, ""))[0]
    if "run_all.py" in table.get(parent, (0, ""))[1]:
        root = parent
    out = []
    for pid, (_, cmd) in table.items():
        if not any(k in cmd for k in ("broker.cli serve", "pytest", "redis-server", "tidemark ")):
            continue
        p, seen = pid, 0
        while p > 1 and p != root and seen < 64:
            p = table.get(p, (0, ""))[0]
            seen += 1
        if p != root:
            out.append(f"{pid}: {cmd[:120]}")
    return out


def _ancestors_and_self(table: Mapping[int, tuple[int, str]]) -> set[int]:
    out = {os.getpid()}
    pid = os.getpid()
    for _ in range(64):
        pid = table.get(pid, (0, ""))[0]
        if pid <= 1:
            break
        out.add(pid)
    return out


def other_bench_scripts() -> list[str]:
    """Benchmark scripts (``bench/*.py``) run by someone else; ``foreign_processes`` covers daemons,
    pytest and redis-server but not a benchmark's own (client) processes."""
    table = _proc_table()
    mine = _ancestors_and_self(table)
    return [f"{pid}: {cmd[:120]}" for pid, (_, cmd) in table.items() if pid not in mine and re.search(r"bench/\w+\.py", cmd)]


def _wait_for_other_benches(max_wait_s: float) -> list[str]:
    """Wait (bounded) until no other benchmark script runs; those still running."""
    deadline = time.monotonic() + max_wait_s
    others = other_bench_scripts()
    if others:
        log(f"other benchmark scripts running ({others}); waiting up to {max_wait_s:.0f}s for them to end")
        while others and time.monotonic() < deadline:
            time.sleep(5.0)
            others = other_bench_scripts()
        if others:
            log(f"WARNING: measuring while other benchmark scripts run: {others}")
        else:
            log("other benchmark scripts ended")
    return others


def wait_for_quiet(max_wait_s: float, busy_max: float = 0.15, *, other_benches: bool = False) -> dict[str, Any]:
    """Wait (bounded) until no test run is alive and the CPUs are mostly idle; with ``other_benches``,
    first until no other benchmark script runs either (the result then names those still running)."""
    if other_benches:
        deadline = time.monotonic() + max_wait_s
        others = _wait_for_other_benches(max_wait_s)
        quiet = wait_for_quiet(max(5.0, deadline - time.monotonic()), busy_max)
        quiet["other_bench_scripts"] = others
        return quiet
    deadline = time.monotonic() + max_wait_s
    t0 = time.monotonic()
    announced = False
    while True:
        busy = cpu_busy_fraction(1.0)
        foreign = foreign_processes()
        testing = [f for f in foreign if "pytest" in f]  # an idle leftover daemon does not matter; a test run does
        if (busy <= busy_max and not testing) or time.monotonic() >= deadline:
            break
        if not announced:
            log(f"machine busy ({busy:.0%} CPU; other processes: {foreign or 'none'}); waiting up to {max_wait_s:.0f}s")
            announced = True
        time.sleep(2.0)
    waited = time.monotonic() - t0
    if busy > busy_max or foreign:
        log(f"WARNING: measuring on a machine that is not quiet: {busy:.0%} CPU busy; other processes: {foreign}")
    elif announced:
        log(f"machine quiet after {waited:.0f}s")
    return {"cpu_busy_before": round(busy, 3), "waited_for_quiet_s": round(waited, 1), "foreign_processes": foreign}


def git_revision() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_DIR, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "broker", "proto"], cwd=REPO_DIR,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# -- CPU accounting ------------------------------------------------------------------------------
def cpu_seconds_of(pid: int, with_children: bool = False) -> float:
    """User + system CPU seconds consumed so far by a process (all its threads); ``with_children``: and
    by the children it has waited for (Redis reaps its BGSAVE child)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(x) for x in fields[11:15 if with_children else 13]) / ticks


def machine_busy_seconds() -> float:
    """CPU seconds all processes on the machine have spent busy so far (from /proc/stat)."""
    vals = cpu_ticks()
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


MALLOC_TUNING = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


PACKAGES = ("broker", "replication", "tieredstore", "spark_connector", "proto")


def precompile() -> None:
    """Byte-compile the daemon's sources, as ``pip install`` does for a deployed node (whose
    /opt/tidemark is read-only under the unit's ProtectSystem=strict). An editable checkout run with
    PYTHONDONTWRITEBYTECODE=1 otherwise compiles every module at every start: ~0.4 s of a restart."""
    for package in PACKAGES:
        compileall.compile_dir(os.path.join(REPO_DIR, package), quiet=1)


def preflight(res: Results, max_wait_s: float, malloc_tuned: bool = False) -> None:
    """Record the code revision and the machine's state in every figure that follows."""
    res.params["git"] = git_revision()
    precompile()
    if malloc_tuned:  # inherited by the daemons and by every spawned client process
        os.environ.update(MALLOC_TUNING)
        res.params["malloc_tuned"] = True
        res.bench += " (malloc-tuned)"
    res.params.update(wait_for_quiet(max_wait_s))


# -- results -------------------------------------------------------------------------------------
@dataclass
class Figure:
    bench: str
    metric: str
    value: float
    unit: str
    target: str = ""
    ok: bool | None = None
    note: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    time: str = ""
    host: str = ""


class Results:
    """Collects the figures of one benchmark script and appends them to a JSON-lines file."""

    def __init__(self, bench: str, path: str | None, params: Mapping[str, Any] | None = None) -> None:
        self.bench = bench
        if path is None:
            os.makedirs(RESULTS_DIR, exist_ok=True)
            path = os.path.join(RESULTS_DIR, f"{time.strftime('%Y%m%d-%H%M%S')}-{bench}.jsonl")
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.params = dict(params or {})
        self.figures: list[Figure] = []

    def add(self, metric: str, value: float, unit: str, *, target: str = "", ok: bool | None = None,
            note: str = "", **params: Any) -> Figure:
        fig = Figure(self.bench, metric, float(value), unit, target, ok, note, {**self.params, **params},
                     time.strftime("%Y-%m-%dT%H:%M:%S"), platform.node())
        self.figures.append(fig)
        with open(self.path, "a") as f:
            f.write(json.dumps(asdict(fig)) + "\n")
        verdict = "" if ok is None else ("  [target met]" if ok else "  [TARGET MISSED]")
        log(f"{self.bench}: {metric} = {fmt_value(fig.value, unit)} {unit}{verdict}")
        return fig

    def print_table(self) -> None:
        others = foreign_processes()
        self.add("other daemons/tests running at the end", len(others), "procs", note="; ".join(others)[:200])
        print_table(self.figures)


def at_least(value: float, target: float) -> tuple[str, bool]:
    return f">= {fmt_value(target, '')}", value >= target


def at_most(value: float, target: float) -> tuple[str, bool]:
    return f"<= {fmt_value(target, '')}", value <= target


def fmt_value(value: float, unit: str) -> str:
    if unit in ("s", "x") or abs(value) < 100:
        return f"{value:,.2f}" if value != int(value) or unit in ("s", "x") else f"{int(value):,}"
    return f"{value:,.0f}"


def load_figures(path: str) -> list[Figure]:
    out: list[Figure] = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(Figure(**json.loads(line)))
    return out


def print_table(figures: list[Figure], title: str | None = None) -> None:
    rows = [("bench", "metric", "value", "unit", "target", "verdict", "note")]
    for fig in figures:
        verdict = "" if fig.ok is None else ("ok" if fig.ok else "MISSED")
        rows.append((fig.bench, fig.metric, fmt_value(fig.value, fig.unit), fig.unit, fig.target, verdict, fig.note))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    if title:
        print(f"\n== {title} ==")
    for n, r in enumerate(rows):
        cells = [c.rjust(w) if i == 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        print("  ".join(cells).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    sys.stdout.flush()


# -- temporary directories and daemons -----------------------------------------------------------
@contextlib.contextmanager
def temp_dir(prefix: str, parent: str | None = None) -> Iterator[str]:
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def running_daemon(workdir: str, name: str = "node", config: Mapping[str, object] | None = None,
                   timeout_s: float = 120.0) -> Iterator[DaemonProcess]:
    """A ``tidemark serve`` child process with its data in ``workdir/name``; always stopped at exit."""
    d = DaemonProcess(os.path.join(workdir, name), config=config)
    try:
        start_timed(d, timeout_s=timeout_s)
        log(f"daemon {name} serving on {d.address} (ready in {d.ready_seconds:.2f}s)")
        yield d
    finally:
        d.kill9()


FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
                  ("grpc.max_reconnect_backoff_ms", 20)]


def start_timed(d: DaemonProcess, timeout_s: float = 600.0) -> float:
    """Start ``d`` and set ``d.ready_seconds`` to the time from spawn until health says SERVING.

    ``DaemonProcess.wait_ready`` polls through one channel with gRPC's default reconnect backoff
    (1 s, then x1.6): after the first refused connect it only sees the daemon at the next backoff
    tick, so its ``ready_seconds`` is rounded up to ~1 s, ~2.6 s, ... Here the channel retries
    every 10-20 ms, so the figure is the daemon's own start time (+ <= 20 ms).
    """
    t0 = time.monotonic()
    d.start(wait=False)
    d.ready_seconds = wait_serving(d, t0, timeout_s)
    return d.ready_seconds


def wait_serving(d: DaemonProcess, t0: float, timeout_s: float = 600.0) -> float:
    """Seconds from ``t0`` (when ``d`` was spawned) until its health check says SERVING (see ``start_timed``)."""

    with grpc.insecure_channel(d.address, options=FAST_RECONNECT) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            assert d.proc is not None
            if d.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {d.proc.returncode}: {d.tail_log()}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5, wait_for_ready=True)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - t0
            except grpc.RpcError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"daemon on {d.address} not ready after {timeout_s}s: {d.tail_log()}")
            time.sleep(0.005)


def status(address: str) -> dict[str, Any]:
    """``status()`` of the daemon at ``address``, through a client of its own."""
    with BrokerClient(address) as c:
        return c.status()


def wait_applied(client: BrokerClient, timeout_s: float = 600.0) -> dict[str, Any]:
    """Poll ``status()`` until every view applied the whole log (or ``timeout_s`` passed); the last status."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.status()
        if st["applied_offset"] >= st["max_offset"] or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Poll ``cond`` until true; return the seconds it took (TimeoutError after ``timeout_s``)."""
    t0 = time.monotonic()
    while True:
        if cond():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def evict_page_cache(path: str) -> int:
    """Drop the cached pages of every file under ``path`` (clean pages only: fsync first); return bytes.

    Only these files lose their cache (``posix_fadvise(DONTNEED)``), not the rest of the machine.
    """
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            file_path = os.path.join(root, name)
            try:
                fd = os.open(file_path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


def free_disk_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def require_free_disk(path: str, needed: int) -> None:
    free = free_disk_bytes(path)
    log(f"free disk at {path}: {free / GiB:.1f} GiB (need about {needed / GiB:.1f} GiB)")
    if free < needed:
        raise SystemExit(f"not enough free disk at {path}: {free / GiB:.1f} GiB free, need {needed / GiB:.1f} GiB")


def proc_status_bytes(pid: int, field: str) -> int:
    """A ``kB`` field of ``/proc/PID/status`` (``RssAnon``, ``VmRSS``...) in bytes (0 when absent)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def rss_anon_of(pid: int) -> int:
    return proc_status_bytes(pid, "RssAnon")


# -- Redis ---------------------------------------------------------------------------------------
def ensure_redis_server() -> str:
    """Path of ``redis-server``; installs Debian's package with apt-get when it is missing."""
    path = shutil.which("redis-server")
    if path:
        return path
    log("redis-server not found: installing Debian's redis-server package (apt-get update; apt-get install)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "redis-server"], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    path = shutil.which("redis-server")
    if not path:
        raise SystemExit("apt-get installed redis-server but it is not on PATH")
    return path


class RedisServer:
    """Our own ``redis-server`` on a free loopback port, AOF on, RDB snapshots off."""

    def __init__(self, workdir: str, appendfsync: str) -> None:
        self.binary = ensure_redis_server()
        self.dir = tempfile.mkdtemp(prefix=f"redis-{appendfsync}-", dir=workdir)
        self.port = free_port()
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = os.path.join(self.dir, "redis.log")

    def version(self) -> str:
        out = subprocess.run([self.binary, "--version"], capture_output=True, text=True, check=True).stdout
        for part in out.split():
            if part.startswith("v="):
                return part[2:]
        return out.strip()

    def start(self, timeout_s: float = 15.0) -> RedisServer:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
               "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "",
               "--daemonize", "no", "--logfile", self.log_path, "--protected-mode", "yes"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
