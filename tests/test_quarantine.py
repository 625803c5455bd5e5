"""The quarantine seen by an operator: ``tidemark log quarantine`` reads back what a real store cut and
kept (the CLI as a separate process), and a real daemon exports its size (``tidemark_quarantine_bytes``)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import crc32c

from broker.cli.node_process import free_port
from broker.client import BrokerClient, Message
from broker.logformat import batch as bf
from broker.storage.quarantine import keep_log_range
from broker.store import IncomingBatch, Store
from tests.procs import DaemonProcess
from tests.storeutil import create_topic, open_store, wait_views_applied
from tests.waits import wait_until


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", "log", "quarantine", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def _send(s: Store, topic: str, queue: int, records: list[tuple[bytes, bytes, bytes]], producer_id: int = 0,
          base_sequence: int = bf.NO_SEQUENCE, *, internal: bool = False) -> int:
    """``internal``: past the send path's contents check (records a log from before it, or a
    peer's, may hold)."""
    encoded, _ = bf.encode_records(records)
    _, end = s.appender.append([IncomingBatch(topic, queue, encoded, len(records), crc32c.crc32c(encoded), producer_id,
                                              base_sequence)], internal=internal)
    s.watermarks.wait_ack(end, "flush", 5000)
    return end


def test_a_cut_range_is_summarised_and_its_records_read_back(tmp_path: Path) -> None:
    """The bytes of the last two sends, kept the way a divergence keeps them, read back record by record."""
    s = open_store(str(tmp_path))
    create_topic(s, "t", queues=2)
    _send(s, "t", 0, [(b"first-%d" % i, b"", b"") for i in range(3)])
    start = s.log.max_offset
    cut = [(b"cut-a-%d" % i, b"key-%d" % i, bf.encode_props({"n": str(i)})) for i in range(4)]
    _send(s, "t", 0, cut)
    end = _send(s, "t", 1, [(b"cut-b", b"", b"")])
    wait_views_applied(s, end)
    path = keep_log_range(str(tmp_path), s.log, start, end, "diverged", ".log")
    s.stop()

    shown = _cli(str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    head, q0, q1, total = shown.stdout.splitlines()
    assert head == f"{path}: diverged, offsets [{start}, {end}), {end - start} bytes; 2 valid batches, 5 records"
    assert q0.startswith("  t/0: 4 records, queue offsets [3, 7), epochs ") and q1.startswith("  t/1: 1 records, queue offsets [0, 1)")
    assert total.endswith(": 1 cut log ranges, " + f"{end - start} bytes")

    listed = _cli(str(tmp_path), "--records")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["topic"], r["queue_id"], r["queue_offset"], base64.b64decode(r["body_b64"])) for r in rows] == (
        [("t", 0, 3 + i, b"cut-a-%d" % i) for i in range(4)] + [("t", 1, 0, b"cut-b")])
    assert [r["key"] for r in rows] == [f"key-{i}" for i in range(4)] + [None]
    assert [r["properties"] for r in rows] == [{"n": str(i)} for i in range(4)] + [{}]


def test_a_torn_tail_says_where_its_valid_batches_end(tmp_path: Path) -> None:
    """Recovery's torn tail (a batch cut short) is listed with what parses and why the rest does not."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    end = _send(s, "t", 0, [(b"whole", b"", b"")])
    s.crash_close()
    seg = sorted((tmp_path / "log").glob("*.log"))[-1]
    data = seg.read_bytes()
    with open(seg, "ab") as f:
        f.write(data[-40:-10])  # the end of a batch where a header belongs: garbage past the log's end
    s = open_store(str(tmp_path))
    assert s.recovery_report["truncated_bytes"] == 30
    s.stop()

    shown = _cli(str(tmp_path))
    assert shown.returncode == 0, shown.stderr  # a torn tail is damaged by nature
    head, problem = shown.stdout.splitlines()[:2]
    assert f"torn, offsets [{end}, {end + 30}), 30 bytes; 0 valid batches, 0 records" in head
    assert problem.startswith(f"  offset {end}: incomplete: ") and problem.endswith("30 bytes from there to the end not read")
    listed = _cli(str(tmp_path), "--records")
    assert listed.returncode == 0 and listed.stdout == "" and f": offset {end}: incomplete: " in listed.stderr


def test_a_damaged_batch_is_named_and_stepped_over(tmp_path: Path) -> None:
    """A diverged file damaged since it was kept: the bad batch is named at its commit offset, the
    batches after it are still read, and the exit says not everything could be."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    start = s.log.max_offset
    ends = [_send(s, "t", 0, [(b"batch-%d-%d" % (n, i), b"", b"") for i in range(3)]) for n in range(3)]
    path = Path(keep_log_range(str(tmp_path), s.log, start, ends[-1], "diverged", ".log"))
    s.stop()
    data = bytearray(path.read_bytes())
    data[ends[1] - start - 2] ^= 0xFF  # inside the second batch's last record
    path.write_bytes(bytes(data))

    shown = _cli(str(tmp_path))
    assert shown.returncode == 1
    lines = shown.stdout.splitlines()
    assert "; 2 valid batches, 6 records" in lines[0]
    assert lines[1].startswith(f"  offset {ends[0]}: invalid: batch body checksum mismatch") and f"at offset {ends[0]})" in lines[1]
    listed = _cli(str(tmp_path), "--records")
    assert listed.returncode == 1 and f"offset {ends[0]}: invalid" in listed.stderr
    bodies = [base64.b64decode(json.loads(line)["body_b64"]) for line in listed.stdout.splitlines()]
    assert bodies == [b"batch-0-%d" % i for i in range(3)] + [b"batch-2-%d" % i for i in range(3)]


def test_records_keep_sequences_and_bytes_that_are_not_text(tmp_path: Path) -> None:
    """Sequences count up from the batch's base; a key or properties that are not UTF-8 come back as base64."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    start = s.log.max_offset
    end = _send(s, "t", 0, [(b"a", b"\xff\xfekey", b""), (b"b", b"k", b"\x01\x00\xff\x01\x00v")], producer_id=7, base_sequence=40,
                internal=True)
    keep_log_range(str(tmp_path), s.log, start, end, "diverged", ".log")
    s.stop()
    listed = _cli(str(tmp_path), "--records")
    assert listed.returncode == 0, listed.stderr
    a, b = (json.loads(line) for line in listed.stdout.splitlines())
    assert (a["producer_id"], a["sequence"], b["sequence"]) == (7, 40, 41)
    assert a["key"] is None and base64.b64decode(a["key_b64"]) == b"\xff\xfekey" and a["properties"] == {}
    assert b["key"] == "k" and b["properties"] is None and base64.b64decode(b["properties_b64"]) == b"\x01\x00\xff\x01\x00v"
    assert a["system"] is False and a["flags"] == 0


def test_nothing_cut_and_bad_arguments(tmp_path: Path) -> None:
    """No quarantine yet: one line, exit 0. Not a directory: one line, exit 2. A stray file, a
    directory under a cut range's name, an unreadable file: each named on one line, exit 1."""
    none = _cli(str(tmp_path))
    assert none.returncode == 0 and none.stdout.strip().endswith("none (nothing was ever cut from this node's log)")
    missing = _cli(str(tmp_path / "absent"))
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [f"tidemark: {tmp_path / 'absent'}: no such directory"]
    (tmp_path / "quarantine").write_text("x")
    not_dir = _cli(str(tmp_path))
    assert not_dir.returncode == 2 and not_dir.stderr.strip().endswith("quarantine: not a directory")
    (tmp_path / "quarantine").unlink()
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "notes.txt").write_text("x")
    (tmp_path / "quarantine" / f"torn-{0:020d}-{10:020d}.broken").mkdir()
    stray = _cli(str(tmp_path))
    assert stray.returncode == 1 and "notes.txt: not a cut log range" in stray.stderr and ".broken: not a cut log range" in stray.stderr
    assert stray.stdout.strip().endswith(": 0 cut log ranges, 0 bytes") and "Traceback" not in stray.stderr
    # a file the operator may not read (kept with mode 0600 by the daemon's user): root runs the
    # command without the capabilities that bypass file modes, so the checkout's own mode (a clone
    # in a 0700 directory) does not matter, as it would for another user
    unreadable = tmp_path / "quarantine" / f"diverged-{0:020d}-{10:020d}.log"
    (tmp_path / "quarantine" / "notes.txt").unlink()
    (tmp_path / "quarantine" / f"torn-{0:020d}-{10:020d}.broken").rmdir()
    unreadable.write_bytes(b"x" * 10)
    unreadable.chmod(0)
    no_bypass = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    shown = subprocess.run([*no_bypass, sys.executable, "-m", "broker.cli", "log", "quarantine", str(tmp_path)],
                           capture_output=True, text=True, timeout=60, check=False, cwd=Path(__file__).resolve().parent.parent)
    assert shown.returncode == 1 and shown.stderr == f"{unreadable}: Permission denied\n", shown.stderr


def test_a_daemon_exports_what_its_quarantine_holds(spawn: Callable[..., DaemonProcess]) -> None:
    """A torn tail cut at start shows in ``tidemark_quarantine_bytes`` at once; the gauge returns
    to 0 within its 5 s refresh once the operator deletes the file."""
    port = free_port()
    node = spawn("node", config={"node.metrics_listen": f"127.0.0.1:{port}"})
    with BrokerClient(node.address) as c:
        c.create_topic("t")
        c.send("t", [Message(body=b"x" * 100)], ack="flush")

    def gauge() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return float(re.search(r"^tidemark_quarantine_bytes (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]

    assert gauge() == 0
    node.kill9()
    seg = sorted(Path(node.data_dir, "log").glob("*.log"))[-1]
    with open(seg, "ab") as f:
        f.write(b"\x01" * 77)  # a torn write past the last whole batch
    node.start()
    kept = list(Path(node.data_dir, "quarantine").iterdir())
    assert [p.stat().st_size for p in kept] == [77]
    assert gauge() == 77
    kept[0].unlink()
    wait_until(lambda: gauge() == 0, 15, "the gauge back to 0 after the file was deleted")
