"""Crash safety, tested by crashing: arm a failpoint, let the daemon SIGKILL itself under load,
restart, and check what survives against what was acknowledged (ack=flush).

The power-loss variant also drops every byte that was not fsynced (the fsync journal), because
kill -9 alone keeps the page cache.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.client import BrokerClient
from tests.crashutil import Producer, check_history, drop_unsynced_bytes, read_everything
from tests.procs import DaemonProcess

FAILPOINTS = [
    "commitlog_before_write=exit@150",
    "commitlog_after_write=exit@150",
    "commitlog_before_fsync=exit@100",
    "commitlog_after_fsync=exit@100",
    "views_before_checkpoint=exit@10",
    "views_after_checkpoint=exit@10",
    "cq_before_checkpoint=exit@10",
    "cq_after_checkpoint=exit@10",
    "metadata_before_commit=exit@10",
    "atomicfile_before_fsync=exit@20",
    "atomicfile_before_rename=exit@20",
    "atomicfile_after_rename=exit@20",
]
CONFIG = {"checkpoint.interval_ms": 50, "commitlog.segment_bytes": 64 * 1024}  # rolls all the time
QUEUES = 3


def _crash_and_check(spawn: Callable[..., DaemonProcess], tmp_path: Path, failpoint: str, power_loss: bool) -> None:
    journal = str(tmp_path / "fsync.journal")
    d = spawn("node", config=CONFIG, env={"TIDEMARK_FSYNC_JOURNAL": journal})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=QUEUES)
    d.stop()
    # restart with the failpoint armed: it fires after its N-th hit under load
    d.env["TIDEMARK_FAILPOINTS"] = failpoint
    d.start()
    producers = [Producer(d.address, "t", f"p{i}") for i in range(2)]
    committer_stop = threading.Event()

    def commit_offsets() -> None:
        with BrokerClient(d.address, timeout_s=2) as c:
            n = 0
            while not committer_stop.is_set():
                try:
                    c.commit_offset("g", "t", 0, 0)
                    n += 1
                except Exception:  # the daemon is expected to die
                    return
                committer_stop.wait(0.01)

    committer = threading.Thread(target=commit_offsets, daemon=True)
    committer.start()
    for p in producers:
        p.start()
    assert d.proc is not None
    code = d.proc.wait(60)
    committer_stop.set()
    for p in producers:
        p.join(30)
    assert code == -9, f"daemon should die at {failpoint}, exit code {code}"
    acked = [b for p in producers for b in p.acked]
    assert acked, "no load was acknowledged before the crash"
    if power_loss:
        dropped = drop_unsynced_bytes(journal)
        if failpoint.startswith(("commitlog_after_write", "commitlog_before_fsync")):
            assert dropped > 0, "the crash left written-but-unsynced log bytes; the simulation must drop them"
    d.env.pop("TIDEMARK_FAILPOINTS")
    d.start()
    check_history(acked, read_everything(d.address, "t", QUEUES))
    with BrokerClient(d.address) as c:  # the daemon takes writes again
        c.send("t", [], ack="flush")
        assert c.status()["recovery"]["clean"] is False
    assert d.stop() == 0
    verify = subprocess.run([sys.executable, "-m", "broker.cli", "log", "verify", d.data_dir],
                            check=False, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_kill9_at_failpoint(spawn: Callable[..., DaemonProcess], tmp_path: Path, failpoint: str) -> None:
    """kill -9 at each named point: every ack=flush message survives, none twice, order kept."""
    _crash_and_check(spawn, tmp_path, failpoint, power_loss=False)


@pytest.mark.parametrize("failpoint", FAILPOINTS)
def test_power_loss_at_failpoint(spawn: Callable[..., DaemonProcess], tmp_path: Path, failpoint: str) -> None:
    """Same, after also dropping every byte no fsync covered (simulated power cut)."""
    _crash_and_check(spawn, tmp_path, failpoint, power_loss=True)
