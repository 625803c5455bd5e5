"""Start-up recovery passes on a real store: torn tails, corruption, lost checkpoints, bounded replay."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import crc32c
import lmdb
import pytest

from broker.client import BrokerClient, Message
from broker.invariant import StartupRefused
from broker.logformat import batch as bf
from broker.storage import atomic_file
from broker.store import IncomingBatch, Store
from broker.views import producer_state
from tests.procs import DaemonProcess
from tests.storeutil import create_topic, open_store, read_all, send, wait_views_applied


def _segment(path: Path) -> Path:
    return sorted((path / "log").glob("*.log"))[-1]


def _flip_byte(seg: Path, at: int) -> None:
    """Invert one byte of a segment file in place (``at`` < 0 counts from the end)."""
    data = bytearray(seg.read_bytes())
    data[at] ^= 0xFF
    seg.write_bytes(bytes(data))


def _refused_cutting_nothing(tmp_path: Path, seg: Path, match: str) -> None:
    """Start-up is refused with a reason matching ``match``, and the damaged segment keeps every byte."""
    size = seg.stat().st_size
    with pytest.raises(StartupRefused, match=match):
        open_store(str(tmp_path))
    assert seg.stat().st_size == size


def _crashed_store(tmp_path: Path, body: bytes, sends: int, per_send: int) -> list[int]:
    """Topic t takes ``sends`` sends of ``per_send`` copies of ``body``, then the store crashes, its view
    checkpoints removed (recovery scans from the start). Returns the log end after each send."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    ends = [send(s, "t", [body] * per_send) for _ in range(sends)]
    s.crash_close()
    for p in (tmp_path / "checkpoints").iterdir():
        p.unlink()
    return ends


def _applied_store(tmp_path: Path, sends: list[list[bytes]], **overrides: object) -> Store:
    """A store whose topic t took each of ``sends`` (one send each), every view applied up to the end."""
    s = open_store(str(tmp_path), **overrides)
    create_topic(s, "t")
    for bodies in sends:
        end = send(s, "t", bodies)
    wait_views_applied(s, end)
    return s


def _store_over_retention(tmp_path: Path, retention_bytes: int) -> Store:
    """A store of 64 KiB segments holding about 400 KiB, all applied: far over ``retention_bytes``."""
    return _applied_store(tmp_path, [[b"y" * 1000] * 20] * 20,
                          **{"commitlog.segment_bytes": 64 * 1024, "retention.local_bytes": retention_bytes})


def test_clean_restart_replays_nothing(tmp_path: Path) -> None:
    """After a clean stop the marker lets recovery skip the scan and the replay."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    send(s, "t", [b"a", b"b"])
    s.stop()
    s = open_store(str(tmp_path))
    assert s.recovery_report["clean"] is True and s.recovery_report["replayed_bytes"] == 0
    assert read_all(s, "t") == [b"a", b"b"]
    s.stop()


@pytest.mark.parametrize("tail", ["zeros", "partial", "garbage_last"])
def test_torn_tail_is_truncated_and_kept(tmp_path: Path, tail: str) -> None:
    """A torn last batch is cut, saved under quarantine/, and every whole batch survives."""
    s = _applied_store(tmp_path, [[b"m%d" % i] * 10 for i in range(5)])
    s.crash_close()
    seg = _segment(tmp_path)
    with open(seg, "ab") as f:
        if tail == "zeros":
            f.write(b"\0" * 4096)
        elif tail == "partial":
            f.write(seg.read_bytes()[-300:-100])  # the start of a batch copy, cut short
    if tail == "garbage_last":  # flip a byte inside the last whole batch's body
        _flip_byte(seg, -3)
    s = open_store(str(tmp_path))
    assert s.recovery_report["truncated_bytes"] > 0
    assert list((tmp_path / "quarantine").iterdir())
    expected = 40 if tail == "garbage_last" else 50
    assert len(read_all(s, "t")) == expected
    s.stop()


def test_mid_log_corruption_refuses_start_naming_segment_and_offset(tmp_path: Path) -> None:
    """A CRC mismatch followed by valid batches is corruption: refuse and say where."""
    ends = _crashed_store(tmp_path, b"x" * 100, 5, 10)
    seg = _segment(tmp_path)
    _flip_byte(seg, ends[1] + 200)  # inside the third data batch
    _refused_cutting_nothing(tmp_path, seg, rf"{seg.name} at offset {ends[1]}")


def test_missing_identity_refuses_non_new_dir(tmp_path: Path) -> None:
    """A data directory with data but no identity is not silently started as new."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    s.stop()
    for suffix in ("", ".bak"):
        p = tmp_path / f"identity{suffix}"
        if p.exists():
            p.write_bytes(b"garbage")
    with pytest.raises(StartupRefused, match="identity"):
        open_store(str(tmp_path))
    assert (tmp_path / "identity.broken").exists()


def test_lost_view_checkpoints_rebuild_from_log(tmp_path: Path) -> None:
    """With every view checkpoint gone and the log complete, views are rebuilt from offset 0."""
    s = open_store(str(tmp_path))
    create_topic(s, "t", queues=2)
    send(s, "t", [b"q0"] * 3, queue=0)
    send(s, "t", [b"q1"] * 4, queue=1)
    s.stop()
    for p in (tmp_path / "checkpoints").iterdir():
        p.write_bytes(b"\0" * 10)
    os.unlink(tmp_path / "clean_shutdown")
    s = open_store(str(tmp_path))
    assert read_all(s, "t", 0) == [b"q0"] * 3 and read_all(s, "t", 1) == [b"q1"] * 4
    s.stop()


def test_lost_checkpoint_after_retention_refuses(tmp_path: Path) -> None:
    """Without a checkpoint and with the log head deleted, start-up is refused with the reason."""
    s = _store_over_retention(tmp_path, 128 * 1024)
    s.dispatcher.checkpoint_views()
    s.dispatcher.checkpoint_views()
    assert s.retention.enforce()
    assert s.log.min_offset > 0
    s.stop()
    for p in (tmp_path / "checkpoints").glob("consume_queue.ckpt*"):
        p.unlink()
    with pytest.raises(StartupRefused, match="cannot be rebuilt"):
        open_store(str(tmp_path))


def test_replay_starts_at_each_views_checkpoint(tmp_path: Path) -> None:
    """An unclean restart replays only what lies above the views' checkpoints."""
    s = _applied_store(tmp_path, [[b"z" * 1000] * 50] * 10)
    s.dispatcher.checkpoint_views()
    checkpointed = s.watermarks.applied_offset
    tail_end = send(s, "t", [b"tail"] * 5)
    wait_views_applied(s, tail_end)
    s.crash_close()
    s = open_store(str(tmp_path))
    assert s.recovery_report["clean"] is False
    assert s.recovery_report["replayed_bytes"] == tail_end - checkpointed
    assert s.recovery_report["scanned_bytes"] == tail_end - checkpointed
    assert len(read_all(s, "t")) == 505
    s.stop()


def test_retention_never_deletes_what_views_need(tmp_path: Path) -> None:
    """Segments above the lowest view checkpoint stay, however far over the size limit."""
    s = _store_over_retention(tmp_path, 64 * 1024)
    assert s.retention.enforce() == []  # nothing checkpointed yet: the views need everything
    s.dispatcher.checkpoint_views()
    assert s.retention.enforce() == []  # recovery may still fall back to the previous (.bak) checkpoint
    s.dispatcher.checkpoint_views()
    removed = s.retention.enforce()
    assert removed and s.log.min_offset <= s.retention.local_floor()
    low, high = s.reads.queue_bounds("t", 0)
    assert low > 0 and high == 400
    assert len(read_all(s, "t")) == high - low
    s.stop()


def test_segments_roll_and_reads_span_them(tmp_path: Path) -> None:
    """Small segments: batches never span two files, reads and recovery cross them."""
    s = open_store(str(tmp_path), **{"commitlog.segment_bytes": 64 * 1024})
    create_topic(s, "t")
    for i in range(30):
        send(s, "t", [b"%d" % i + b"." * 2000] * 5)
    assert len(list((tmp_path / "log").glob("*.log"))) >= 4
    s.crash_close()
    s = open_store(str(tmp_path), **{"commitlog.segment_bytes": 64 * 1024})
    got = read_all(s, "t")
    assert len(got) == 150 and got[-1].startswith(b"29.")
    s.stop()


def test_zeroed_length_followed_by_data_is_corruption(tmp_path: Path) -> None:
    """A zero length field with valid batches after it is not a torn tail: refuse, cut nothing."""
    ends = _crashed_store(tmp_path, b"v" * 100, 4, 5)
    seg = _segment(tmp_path)
    data = bytearray(seg.read_bytes())
    data[ends[0] : ends[0] + 4] = b"\0\0\0\0"
    seg.write_bytes(bytes(data))
    _refused_cutting_nothing(tmp_path, seg, "zeroed batch length is followed by data")


def test_damage_below_applied_views_is_never_truncated(tmp_path: Path) -> None:
    """A torn-looking tail below what views already applied refuses start-up instead of cutting."""
    s = _applied_store(tmp_path, [[b"w" * 100] * 5] * 3)
    s.dispatcher.checkpoint_views()
    s.crash_close()
    for p in (tmp_path / "checkpoints").glob("producer_state.ckpt*"):
        p.unlink()  # one view rebuilds from 0, so the scan covers the damaged batch
    seg = _segment(tmp_path)
    _flip_byte(seg, -3)  # the last batch: looks torn, but the consume queues have applied it
    _refused_cutting_nothing(tmp_path, seg, "refusing to truncate")


def test_bad_producer_checkpoint_rebuilds_dedup_state(tmp_path: Path) -> None:
    """A validly framed but unusable producer checkpoint is rebuilt from the log, keeping dedup."""
    _dedup_survives_a_checkpoint_of(tmp_path, b'{"applied_offset": 350}')


def test_producer_checkpoint_of_the_wrong_shape_rebuilds_dedup_state(tmp_path: Path) -> None:
    """A checkpoint whose fields have the wrong types (a TypeError, not a ValueError) is rebuilt too."""
    _dedup_survives_a_checkpoint_of(tmp_path, b'{"applied_offset": 350, "producers": 5}')


def _dedup_survives_a_checkpoint_of(tmp_path: Path, payload: bytes) -> None:
    """A producer's batch, then the producer-state checkpoint replaced by ``payload``: the retried
    batch is still answered as a duplicate after the restart."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    records, _ = bf.encode_records([(b"once", b"", b"")])
    batch = IncomingBatch("t", 0, records, 1, crc32c.crc32c(records), producer_id=5, base_sequence=0)
    first, end = s.appender.append([batch])
    s.watermarks.wait_ack(end, "flush", 5000)
    s.stop()
    ckpt = str(tmp_path / "checkpoints" / "producer_state.ckpt")
    for suffix in ("", ".bak"):
        if Path(ckpt + suffix).exists():
            Path(ckpt + suffix).unlink()
    atomic_file.persist(ckpt, producer_state.CHECKPOINT_MAGIC, producer_state.CHECKPOINT_VERSION, payload)
    s = open_store(str(tmp_path))
    again, _ = s.appender.append([batch])
    assert again[0].duplicate and again[0].commit_offset == first[0].commit_offset
    assert read_all(s, "t") == [b"once"]
    s.stop()
    ckpt = str(tmp_path / "checkpoints" / "producer_state.ckpt")
    for suffix in ("", ".bak"):
        if Path(ckpt + suffix).exists():
            Path(ckpt + suffix).unlink()
    atomic_file.persist(ckpt, producer_state.CHECKPOINT_MAGIC, producer_state.CHECKPOINT_VERSION,
                        b'{"applied_offset": 350}')
    s = open_store(str(tmp_path))
    again, _ = s.appender.append([batch])
    assert again[0].duplicate and again[0].commit_offset == first[0].commit_offset
    assert read_all(s, "t") == [b"once"]
    s.stop()


def test_an_unusable_metadata_database_that_cannot_be_rebuilt_is_left_intact(tmp_path: Path) -> None:
    """A malformed LMDB value when retention already removed the log's head: start-up is refused, and
    the database (topics, consumer offsets) is still all there for the operator, not wiped first."""
    s = _store_over_retention(tmp_path, 64 * 1024)
    s.offsets.commit([("g", "t", 0, 7)])
    s.offsets.flush()
    s.dispatcher.checkpoint_views()
    s.dispatcher.checkpoint_views()
    assert s.retention.enforce() and s.log.min_offset > 0
    s.stop()
    env = lmdb.open(str(tmp_path / "metadata"), max_dbs=8, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"t", b"{not json", db=env.open_db(b"topics", txn=txn))
    env.close()
    with pytest.raises(StartupRefused, match="metadata: checkpoint unusable"):
        open_store(str(tmp_path))
    env = lmdb.open(str(tmp_path / "metadata"), max_dbs=8, subdir=True, readonly=True)
    with env.begin() as txn:
        offsets = list(txn.cursor(db=env.open_db(b"offsets", txn=txn)))
        topics = list(txn.cursor(db=env.open_db(b"topics", txn=txn)))
    env.close()
    assert len(offsets) == 1 and len(topics) == 1


def test_killed_between_keeping_a_torn_tail_and_cutting_it(spawn: Callable[..., DaemonProcess]) -> None:
    """kill -9 at ``recovery_before_truncate`` (the torn tail saved to quarantine/, the log not cut):
    the next start cuts it, keeps it in quarantine once, and every whole batch is read back."""
    d = spawn("node")
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        for i in range(5):
            c.send("t", [Message(b"m%d" % i)] * 10, ack="flush")
    d.kill9()
    seg = _segment(Path(d.data_dir))
    with open(seg, "ab") as f:
        f.write(seg.read_bytes()[-300:-100])  # the start of a batch copy, cut short
    d.env["TIDEMARK_FAILPOINTS"] = "recovery_before_truncate=exit"
    d.start(wait=False)
    assert d.wait_exit(60) == -9
    kept = list((Path(d.data_dir) / "quarantine").iterdir())
    assert len(kept) == 1 and kept[0].stat().st_size == 200
    d.env.pop("TIDEMARK_FAILPOINTS")
    d.start()
    assert [p.name for p in (Path(d.data_dir) / "quarantine").iterdir()] == [kept[0].name]
    with BrokerClient(d.address) as c:
        assert len(c.pull("t", 0, 0)) == 50
        assert c.status()["recovery"]["truncated_bytes"] == 200
    assert d.stop() == 0
