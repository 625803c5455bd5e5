"""The ``tidemark`` command line against a real daemon: topics, send, consume, status, log verify."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.procs import DaemonProcess


def _run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], input=stdin, check=False,
                          capture_output=True, text=True, timeout=120)


def test_topic_send_consume_status(daemon: DaemonProcess) -> None:
    """Lines sent on stdin come back from consume; receipts and status are JSON."""
    b = daemon.address
    assert _run("topic", "create", "logs", "--queues", "2", "--broker", b).returncode == 0
    listed = [json.loads(line) for line in _run("topic", "list", "--broker", b).stdout.splitlines()]
    assert listed == [{"name": "logs", "queues": 2, "max_offsets": [0, 0], "stable_offsets": [0, 0]}]
    sent = _run("send", "logs", "--broker", b, "--ack", "flush", stdin="alpha\nbeta\ngamma\n")
    assert sent.returncode == 0, sent.stderr
    receipts = [json.loads(line) for line in sent.stdout.splitlines()]
    assert len(receipts) == 3 and all({"queue_id", "queue_offset", "commit_offset"} <= r.keys() for r in receipts)
    out = _run("consume", "logs", "--broker", b, "--group", "g", "--timeout-ms", "300")
    assert sorted(json.loads(line)["body"] for line in out.stdout.splitlines()) == ["alpha", "beta", "gamma"]
    _run("send", "logs", "--broker", b, "--key", "k", "--ack", "flush", stdin="delta\n")
    again = _run("consume", "logs", "--broker", b, "--group", "g", "--from", "committed", "--timeout-ms", "300")
    assert [json.loads(line)["body"] for line in again.stdout.splitlines()] == ["delta"]
    limited = _run("consume", "logs", "--broker", b, "--max", "2")
    assert len(limited.stdout.splitlines()) == 2
    popped = _run("consume", "logs", "--broker", b, "--group", "p", "--pop", "--timeout-ms", "300")
    lines = [json.loads(line) for line in popped.stdout.splitlines()]
    assert sorted(m["body"] for m in lines) == ["alpha", "beta", "delta", "gamma"], popped.stderr
    assert {m["delivery_count"] for m in lines} == {1}
    assert _run("consume", "logs", "--broker", b, "--group", "p", "--pop", "--timeout-ms", "300").stdout == ""  # acked
    described = json.loads(_run("group", "describe", "p", "--broker", b, "--json").stdout)
    assert sum(q["in_flight"] for q in described["queues"]) == 0
    st = json.loads(_run("status", "--broker", b, "--json").stdout)
    assert st["role"] == "master" and st["confirm_offset"] > 0
    assert "confirm_offset" in _run("status", "--broker", b).stdout
    assert _run("topic", "delete", "logs", "--broker", b).returncode == 0


def test_cli_errors_have_exit_codes(daemon: DaemonProcess) -> None:
    """Runtime failures exit 1 with one line; bad usage exits 2."""
    r = _run("consume", "nope", "--broker", daemon.address)
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr and r.stderr.count("\n") == 1
    r = _run("topic", "create", "bad name", "--broker", daemon.address)
    assert r.returncode == 2 and "INVALID_ARGUMENT" in r.stderr
    assert _run("send").returncode == 2
    assert _run("consume", "t", "--broker", daemon.address, "--from", "committed").returncode == 2


def test_log_verify_reports_corruption(daemon: DaemonProcess) -> None:
    """`log verify` passes a healthy directory and names the segment and offset of a bad batch."""
    b = daemon.address
    _run("topic", "create", "t", "--broker", b)
    _run("send", "t", "--broker", b, "--ack", "flush", stdin="one\ntwo\n")
    _run("send", "t", "--broker", b, "--ack", "flush", stdin="three\n")
    assert daemon.stop() == 0
    ok = _run("log", "verify", daemon.data_dir)
    assert ok.returncode == 0 and "0 problems" in ok.stdout
    seg = f"{daemon.data_dir}/log/{0:020d}.log"
    with open(seg, "r+b") as f:
        data = bytearray(f.read())
        data[-5] ^= 0xFF
        f.seek(0)
        f.write(data)
    bad = _run("log", "verify", daemon.data_dir)
    assert bad.returncode == 1 and "checksum mismatch" in bad.stdout and seg in bad.stdout
