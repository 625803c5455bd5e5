"""The daemon's threads carry their names to the OS (broker/threads.py)."""

from __future__ import annotations

import os
import threading

from broker.threads import NamedThread
from tests.procs import DaemonProcess
from tests.waits import wait_until


def _os_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # ended meanwhile
            pass
    return names


def test_a_daemons_threads_are_named_in_proc(daemon: DaemonProcess) -> None:
    """``top -H`` and ``/proc/PID/task/*/comm`` tell the flusher from the event loop; before, every
    Python thread of the daemon showed as ``python``."""
    assert daemon.proc is not None
    pid = daemon.proc.pid
    want = {"grpc-loop", "flusher", "dispatcher", "offset-flush", "timer-firing", "lag-metrics"}
    # a thread names itself once it runs, and lag-metrics starts just after the daemon says SERVING
    wait_until(lambda: want <= set(_os_names(pid)), 10, f"threads named {sorted(want)} (seen: {sorted(set(_os_names(pid)))})")


def test_a_long_name_is_cut_to_what_linux_keeps() -> None:
    seen: list[str] = []

    def read_own_name() -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", encoding="utf-8") as f:
            seen.append(f.read().strip())

    t = NamedThread(target=read_own_name, name="a-rather-long-thread-name")
    t.start()
    t.join()
    assert seen == ["a-rather-long-t"]
