"""Safe by default (DESIGN §10): what an operator can mistype or a stranger can send loses nothing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from broker.client import BrokerClient, Message
from tests.procs import DaemonProcess


def _cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def test_a_second_daemon_on_a_locked_directory_exits_with_one_line(spawn: Callable[..., DaemonProcess]) -> None:
    """Two daemons on one directory: the second refuses (exit 1, one line naming the holder's pid);
    the first keeps serving, and what it acknowledged is all there after a restart."""
    first = spawn("n")
    with BrokerClient(first.address) as c:
        c.create_topic("t")
        c.send("t", [Message(b"%d" % i) for i in range(200)], ack="flush")
    second = spawn("n", start=False, log_path=first.log_path + ".second")  # the same directory, another port
    second.start(wait=False)
    code = second.wait_exit(30)
    lines = [line for line in second.tail_log(50).splitlines() if line.strip()]
    assert code == 1
    assert lines[-1] == f"tidemark: refusing to start: data directory {first.data_dir} is in use by pid {first.proc.pid}"  # type: ignore[union-attr]
    assert not any("Traceback" in line for line in lines)
    with BrokerClient(first.address) as c:
        c.send("t", [Message(b"after")], ack="flush")
    first.kill9()
    first.start()
    with BrokerClient(first.address) as c:
        assert len(c.pull("t", 0, 0, max_messages=1000)) == 201


def test_log_verify_reads_a_live_directory_and_says_so(spawn: Callable[..., DaemonProcess]) -> None:
    """``log verify`` on a directory a daemon holds: no write, a note naming the pid, a clean check."""
    d = spawn("n")
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        c.send("t", [Message(b"x" * 100)] * 50, ack="flush")
    r = _cli("log", "verify", d.data_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"in use by pid {d.proc.pid}" in r.stderr  # type: ignore[union-attr]
    assert "0 problems" in r.stdout
