"""Watching a measurement: who used the CPU, when to measure again, sampling and profiling on the side.

- ``CpuTimes``: CPU seconds of chosen processes, of the benchmark script and of the whole machine;
  the difference of two tells what "other processes" took of a measurement.
- ``redo_while_disturbed``: measure again while other processes took too much of it.
- ``Sampler``: a thread calling a probe (a status call, a memory reading) at a fixed interval.
- ``Spy``: py-spy stacks of a process (for ``--profile-dir``).
- ``quantile``: the nearest-rank quantile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from common import cpu_seconds_of, foreign_processes, log, machine_busy_seconds, other_bench_scripts


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds spent so far by some processes, by this script and by the whole machine (busy).

    ``later - earlier`` is what each spent in between (``wall``: the seconds between the two); a
    process that ``earlier`` does not watch counts from its start.
    """

    wall: float
    procs: dict[int, float]
    machine: float
    own: float

    @classmethod
    def now(cls, *pids: int, with_children: Collection[int] = ()) -> CpuTimes:
        procs = {pid: cpu_seconds_of(pid, pid in with_children) for pid in pids}
        return cls(time.monotonic(), procs, machine_busy_seconds(), time.process_time())

    def __sub__(self, earlier: CpuTimes) -> CpuTimes:
        procs = {pid: s - earlier.procs.get(pid, 0.0) for pid, s in self.procs.items()}
        return CpuTimes(self.wall - earlier.wall, procs, self.machine - earlier.machine, self.own - earlier.own)

    def other_seconds(self) -> float:
        """Busy CPU seconds of the machine spent neither by the watched processes nor by this script."""
        return self.machine - sum(self.procs.values()) - self.own

    def other_cores(self, seconds: float | None = None) -> float:
        """``other_seconds`` per second of ``seconds`` (default: of ``wall``), at least 0."""
        return max(0.0, self.other_seconds()) / (seconds or self.wall)


OTHER_CPU_MAX = 0.45  # cores that other processes (kernel work included) may take of a measurement before it is redone
ATTEMPTS = 3


def redo_while_disturbed(measure: Callable[[int], dict[str, Any]],
                         before_retry: Callable[[], object] | None = None) -> dict[str, Any]:
    """``measure(attempt)`` again while other processes took more than ``OTHER_CPU_MAX`` cores of it (its
    ``other_cpu``), ``ATTEMPTS`` times at most, calling ``before_retry()`` first; the last measurement."""
    attempt = 1
    while True:
        r = measure(attempt)
        if r["other_cpu"] <= OTHER_CPU_MAX or attempt == ATTEMPTS:
            return r
        log(f"{r['other_cpu']:.2f} cores went to other processes ({foreign_processes()}, {other_bench_scripts()}): "
            "measuring again")
        if before_retry is not None:
            before_retry()
        attempt += 1


class Sampler(threading.Thread):
    """Calls ``probe()`` every ``interval_s`` until stopped; keeps (time after the call, result)."""

    def __init__(self, probe: Callable[[], Any], interval_s: float) -> None:
        super().__init__(daemon=True)
        self.probe = probe
        self.interval_s = interval_s
        self.samples: list[tuple[float, Any]] = []
        self.errors = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                value = self.probe()
            except Exception:
                self.errors += 1
                value = None
            if value is not None:
                self.samples.append((time.time(), value))
            if self.interval_s:
                self.stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(30)


class Spy:
    """``py-spy record`` (raw collapsed stacks) of one process, until ``stop()`` or ``seconds``."""

    def __init__(self, pid: int, path: str, seconds: float | None = None) -> None:
        exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
        cmd = [exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "100", "--threads", "--nonblocking",
               "--output", path]
        if seconds:
            cmd += ["--duration", str(max(1, round(seconds)))]
        self.path = path
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        log(f"py-spy stacks in {self.path}")


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by the nearest-rank rule (0.0 when empty)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]
