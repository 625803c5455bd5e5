"""sd_notify against a real NOTIFY_SOCKET: READY after recovery, STATUS, watchdog, reload, STOPPING."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker.client import BrokerClient, Message
from broker.daemon.liveness import FlushProgress
from broker.daemon.sdnotify import Notifier
from tests.notifyutil import NotifySocket
from tests.procs import DaemonProcess
from tests.waits import holds_for, wait_until

Spawn = Callable[..., DaemonProcess]
WATCHDOG_USEC = 600_000  # pings expected every 0.3 s


@pytest.fixture
def notify() -> Iterator[NotifySocket]:
    sock = NotifySocket.abstract()
    yield sock
    sock.close()


def _signal(d: DaemonProcess, sig: signal.Signals) -> None:
    assert d.proc is not None
    d.proc.send_signal(sig)


# -- the module alone --------------------------------------------------------------------------------
def test_notifier_sends_to_a_path_socket(tmp_path: Path) -> None:
    """A filesystem NOTIFY_SOCKET gets one datagram of KEY=VALUE lines per call."""
    sock = NotifySocket(str(tmp_path / "notify"))
    try:
        n = Notifier({"NOTIFY_SOCKET": sock.address})
        assert n.ready("up")
        i = sock.wait_for("READY", "1", timeout_s=5)
        assert sock.messages[i].fields == {"READY": "1", "STATUS": "up"}
        assert n.reloading()
        j = sock.wait_for("RELOADING", "1", timeout_s=5)
        sent_usec = int(sock.messages[j].fields["MONOTONIC_USEC"])
        assert abs(time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000 - sent_usec) < 5_000_000
    finally:
        sock.close()


def test_notifier_without_systemd_is_silent() -> None:
    """No NOTIFY_SOCKET: every call is a no-op returning False; no watchdog."""
    n = Notifier({})
    assert not n.enabled and not n.ready("x") and not n.watchdog() and n.watchdog_interval_s() is None


def test_watchdog_only_for_our_pid() -> None:
    """WATCHDOG_USEC applies when WATCHDOG_PID is absent or ours; the ping interval is half the timeout."""
    assert Notifier({"WATCHDOG_USEC": "4000000"}).watchdog_interval_s() == 2.0
    assert Notifier({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}).watchdog_interval_s() == 2.0
    assert Notifier({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}).watchdog_interval_s() is None
    assert Notifier({"WATCHDOG_USEC": "junk"}).watchdog_interval_s() is None


def test_flush_progress_withholds_the_ping_only_when_stuck() -> None:
    """Unflushed bytes whose flushed offset does not move for longer than the limit make the daemon unhealthy."""
    p = FlushProgress(stall_s=2.0)
    assert p.check(100, 100, 0.0) is None  # nothing pending
    assert p.check(200, 100, 1.0) is None  # pending, just noticed
    assert p.check(300, 150, 2.5) is None  # moved
    assert p.check(300, 150, 4.0) is None  # 1.5 s without progress
    reason = p.check(300, 150, 5.0)
    assert reason is not None and "stuck at 150" in reason
    assert p.check(300, 300, 5.1) is None  # caught up: healthy again


# -- a real daemon ----------------------------------------------------------------------------------
def test_ready_only_after_recovery_then_watchdog_then_stopping(spawn: Spawn, notify: NotifySocket) -> None:
    """After a crash, STATUS lines come first, READY=1 only once recovery is logged and health serves,
    WATCHDOG=1 follows at half the timeout, and SIGTERM sends STOPPING=1 and exits 0."""
    d = spawn("node")
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=2)
        for _ in range(5):
            c.send("t", [Message(body=b"x" * 1000) for _ in range(200)], ack="flush")
    d.kill9()  # the next start must scan and replay
    d.env.update(notify.env(WATCHDOG_USEC))
    t0 = time.monotonic()
    d.start(wait=False)
    ready = notify.wait_for("READY", "1")
    log = Path(d.log_path).read_text().split("recovery_done")[-1]  # this run's part
    assert "clean=False" in log and "serving" in log, log  # recovery finished before READY was sent
    with grpc.insecure_channel(d.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    statuses = [m.fields["STATUS"] for m in notify.messages[:ready] if "STATUS" in m.fields]
    assert any(s.startswith("recovering ") for s in statuses), statuses
    assert "as master" in notify.messages[ready].fields["STATUS"]
    assert notify.messages[ready].at > t0
    pings = [ready]
    for _ in range(6):
        pings.append(notify.wait_for("WATCHDOG", "1", after=pings[-1] + 1, timeout_s=10))
    gap_s = (notify.messages[pings[-1]].at - notify.messages[pings[1]].at) / 5
    assert 0.2 <= gap_s <= 0.53, gap_s  # every 0.3 s (3 to 8 pings in 1.6 s)
    _signal(d, signal.SIGTERM)
    stopping = notify.wait_for("STOPPING", "1", after=ready)
    assert "stopping" in notify.messages[stopping].fields["STATUS"]
    assert d.wait_exit(60) == 0
    assert notify.count("READY", after=stopping) == 0


def _write_config(path: Path, body: str) -> None:
    path.write_text(body)


def test_sighup_reloads_reloadable_keys_and_refuses_the_rest(spawn: Spawn, notify: NotifySocket, tmp_path: Path) -> None:
    """SIGHUP: RELOADING=1 (with MONOTONIC_USEC) then READY=1; a new pull limit and log level apply; an
    invalid file or a changed non-reloadable key is refused whole, and the daemon keeps serving."""
    conf = tmp_path / "node.toml"
    _write_config(conf, '[log]\nlevel = "info"\n[limits]\npull_messages_max = 100000\n')
    d = spawn("node", config_file=str(conf), env=notify.env())
    first_ready = notify.wait_for("READY", "1")
    log_path = Path(d.log_path)
    with BrokerClient(d.address) as c:
        c.create_topic("before")
        c.send("before", [Message(body=b"%d" % i) for i in range(20)], ack="flush")
        wait_until(lambda: len(c.pull("before", 0, 0, max_messages=1000)) == 20, 5,  # once the views applied them
                   "all 20 messages in one pull")
        assert "topic=before" in log_path.read_text()  # info lines are logged

        _write_config(conf, '[log]\nlevel = "warning"\n[limits]\npull_messages_max = 5\n')
        _signal(d, signal.SIGHUP)
        reloading = notify.wait_for("RELOADING", "1", after=first_ready + 1)
        assert int(notify.messages[reloading].fields["MONOTONIC_USEC"]) > 0
        ready = notify.wait_for("READY", "1", after=reloading)
        assert notify.messages[ready].fields["STATUS"].startswith("reloaded (2 changed)")
        assert len(c.pull("before", 0, 0, max_messages=1000)) == 5
        c.create_topic("after")
        holds_for(lambda: "topic=after" not in log_path.read_text(), 0.2, "info lines staying out of the log")
        text = log_path.read_text()
        assert "reloaded" in text and "pull_messages_max" in text
        assert "topic=after" not in text  # info is below the new level

        _write_config(conf, '[limits\npull_messages_max = 7\n')  # not TOML
        _signal(d, signal.SIGHUP)
        ready = notify.wait_for("READY", "1", after=ready + 1)
        assert notify.messages[ready].fields["STATUS"].startswith("reload refused: ")
        assert len(c.pull("before", 0, 0, max_messages=1000)) == 5

        _write_config(conf, '[limits]\npull_messages_max = 7\n[commitlog]\nsegment_bytes = 1048576\n')
        _signal(d, signal.SIGHUP)
        ready = notify.wait_for("READY", "1", after=ready + 1)
        status = notify.messages[ready].fields["STATUS"]
        assert "commitlog.segment_bytes" in status and "restart" in status, status
        assert len(c.pull("before", 0, 0, max_messages=1000)) == 5  # nothing of that file applied
        assert c.status()["role"] == "master"
    text = log_path.read_text()
    assert text.count("reload_refused") == 2 and "not valid TOML" in text
    assert d.stop() == 0


def test_watchdog_pings_stop_while_the_disk_hangs(spawn: Spawn, notify: NotifySocket) -> None:
    """A 3 s fsync (failpoint) with bytes waiting: no WATCHDOG=1 past the 1 s stall limit, an
    "unhealthy" STATUS instead, and pings resume once the flush completes."""
    d = spawn("node", env={**notify.env(1_000_000), "TIDEMARK_FAILPOINTS": "commitlog_before_fsync=sleep:3000"})
    ready = notify.wait_for("READY", "1")
    notify.wait_for("WATCHDOG", "1", after=ready)
    with BrokerClient(d.address) as c:
        c.create_topic("t")  # waits for its own (slow) flushes; then the disk is idle again
        mark = len(notify.messages)
        c.send("t", [Message(body=b"x")], ack="leader")  # returns at once; the flusher hangs in fsync
    sent = time.monotonic()
    bad = notify.wait_for("STATUS", after=mark, timeout_s=10)
    while not notify.messages[bad].fields["STATUS"].startswith("unhealthy: "):
        bad = notify.wait_for("STATUS", after=bad + 1, timeout_s=10)
    assert "flushed offset stuck" in notify.messages[bad].fields["STATUS"]
    resumed = notify.wait_for("STATUS", after=bad + 1, timeout_s=10)
    assert notify.messages[resumed].fields["STATUS"].startswith("serving ")
    pings = [m.at for m in notify.messages[mark:resumed] if "WATCHDOG" in m.fields]
    # the first check that sees the stall is ≤ 0.5 s late, the limit is 1 s: no ping after ~1.5 s
    assert pings and all(at < sent + 2.0 for at in pings), [round(at - sent, 2) for at in pings]
    assert notify.messages[resumed].at - max(pings) >= 1.0  # a real gap, not merely slow pings
    assert notify.messages[resumed].at - sent >= 2.5  # the fsync took 3 s
    notify.wait_for("WATCHDOG", "1", after=resumed)
    assert "watchdog_withheld" in Path(d.log_path).read_text()
