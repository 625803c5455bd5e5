"""``tidemark log quarantine``: what a real store cut and kept, read back by the CLI as a separate process."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import crc32c

from broker.logformat import batch as bf
from broker.storage.quarantine import keep_log_range
from broker.store import IncomingBatch, Store
from tests.storeutil import create_topic, open_store, wait_views_applied


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", "log", "quarantine", *args],
                          capture_output=True, text=True, timeout=60, check=False)


def _send(s: Store, topic: str, queue: int, records: list[tuple[bytes, bytes, bytes]]) -> int:
    encoded, _ = bf.encode_records(records)
    _, end = s.appender.append([IncomingBatch(topic, queue, encoded, len(records), crc32c.crc32c(encoded))])
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
    assert head == f"{path}: diverged, offsets [{start}, {end}), {end - start} bytes; 2 whole batches, 5 records"
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
    assert shown.returncode == 0, shown.stderr
    head = shown.stdout.splitlines()[0]
    assert f"torn, offsets [{end}, {end + 30}), 30 bytes; 0 whole batches, 0 records; valid up to offset {end}" in head
    assert _cli(str(tmp_path), "--records").stdout == ""


def test_nothing_cut_and_bad_arguments(tmp_path: Path) -> None:
    """No quarantine yet: one line, exit 0. Not a directory: one line, exit 2. A stray file: named, exit 1."""
    none = _cli(str(tmp_path))
    assert none.returncode == 0 and none.stdout.strip().endswith("none (nothing was ever cut from this node's log)")
    missing = _cli(str(tmp_path / "absent"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1 and "not a directory" in missing.stderr
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "notes.txt").write_text("x")
    stray = _cli(str(tmp_path))
    assert stray.returncode == 1 and "notes.txt: not a cut log range" in stray.stderr
    assert stray.stdout.strip().endswith(": 0 cut log ranges, 0 bytes")
