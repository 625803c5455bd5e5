"""A queue's segment in one log (moving a queue between shards, docs/shards.md): a ``queue.seal``
ends it and refuses every later write; a ``queue.start`` begins a segment at a logical offset above
0. Both are records of the log, so they hold across a clean stop (checkpoint) and a crash (replay)."""

from __future__ import annotations

from pathlib import Path

import crc32c
import pytest

from broker.errors import BrokerError
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.store import IncomingBatch, Store
from tests.storeutil import create_topic, open_store, read_all, send, wait_views_applied


def _append(s: Store, topic: str, queue: int, bodies: list[bytes]) -> int:
    """The queue offset the batch was given."""
    records, _ = bf.encode_records([(b, b"", b"") for b in bodies])
    receipts, end = s.appender.append([IncomingBatch(topic, queue, records, len(bodies), crc32c.crc32c(records))])
    s.watermarks.wait_ack(end, "flush", 5000)
    return receipts[0].base_queue_offset


def _reopen(s: Store, path: str, crash: bool) -> Store:
    if crash:
        s.crash_close()  # no checkpoint at close: the next start replays the log past the last one
    else:
        s.stop()
    return open_store(path)


@pytest.mark.parametrize("crash", [False, True], ids=["clean-stop", "crash"])
def test_a_sealed_queue_takes_no_write_and_keeps_its_end(tmp_path: Path, crash: bool) -> None:
    path = str(tmp_path / "d")
    s = open_store(path)
    create_topic(s, "t", queues=2)
    send(s, "t", [b"a", b"b", b"c"], queue=0)
    end, at = s.appender.seal_queue("t", 0)
    assert end == 3
    s.watermarks.wait_ack(at, "flush", 5000)
    assert s.appender.seal_queue("t", 0) == (3, s.log.max_offset)  # sealed once: no second record
    with pytest.raises(BrokerError) as exc:
        send(s, "t", [b"d"], queue=0)
    assert exc.value.code == "UNAVAILABLE" and "sealed at offset 3" in exc.value.message
    assert _append(s, "t", 1, [b"x"]) == 0  # the topic's other queue still takes writes
    s = _reopen(s, path, crash)
    try:
        assert s.appender.queue_sealed("t", 0) and not s.appender.queue_sealed("t", 1)
        with pytest.raises(BrokerError):
            send(s, "t", [b"d"], queue=0)
        assert read_all(s, "t", 0) == [b"a", b"b", b"c"]  # the sealed segment stays readable
        wait_views_applied(s, s.log.max_offset)
        assert s.views.queues.sealed == {("t", 0): 3}
    finally:
        s.stop()


@pytest.mark.parametrize("crash", [False, True], ids=["clean-stop", "crash"])
def test_a_started_queue_continues_at_its_logical_offset(tmp_path: Path, crash: bool) -> None:
    path = str(tmp_path / "d")
    s = open_store(path)
    create_topic(s, "t", queues=2)
    end = s.appender.append_system([(system_records.QUEUE_START, {"topic": "t", "queue": 1, "start": 1000})])
    s.watermarks.wait_ack(end, "flush", 5000)
    wait_views_applied(s, end)
    assert s.reads.queue_bounds("t", 1) == (1000, 1000)  # nothing below the segment's start here
    s = _reopen(s, path, crash)  # the start survives while the queue has no entry (no file) yet
    try:
        assert s.appender.queue_end("t", 1) == 1000
        assert _append(s, "t", 1, [b"m0", b"m1"]) == 1000
        assert _append(s, "t", 0, [b"other"]) == 0
        wait_views_applied(s, s.log.max_offset)
        assert s.reads.queue_bounds("t", 1) == (1000, 1002)
        r = s.reads.pull("t", 1, 1001, 10, 1 << 20, 0)
        assert r.count == 1
    finally:
        s.stop()
    s = open_store(path)
    try:
        assert read_all(s, "t", 1) == [b"m0", b"m1"] and s.appender.queue_end("t", 1) == 1002
    finally:
        s.stop()


def test_a_queue_that_comes_back_is_unsealed_at_its_new_start(tmp_path: Path) -> None:
    """Moved away and back again (A -> B -> A): the start lifts the seal and skips what B wrote."""
    s = open_store(str(tmp_path / "d"))
    try:
        create_topic(s, "t")
        send(s, "t", [b"a", b"b"])
        s.appender.seal_queue("t", 0)
        end = s.appender.append_system([(system_records.QUEUE_START, {"topic": "t", "queue": 0, "start": 7})])
        s.watermarks.wait_ack(end, "flush", 5000)
        assert _append(s, "t", 0, [b"h"]) == 7
        wait_views_applied(s, s.log.max_offset)
        assert not s.appender.queue_sealed("t", 0) and s.views.queues.sealed == {}
        assert s.reads.queue_bounds("t", 0) == (0, 8)
    finally:
        s.stop()


def test_seal_and_start_name_an_existing_queue(tmp_path: Path) -> None:
    s = open_store(str(tmp_path / "d"))
    try:
        create_topic(s, "t", queues=2)
        for change, fields in ((system_records.QUEUE_START, {"topic": "t", "queue": 2, "start": 5}),
                               (system_records.QUEUE_START, {"topic": "nope", "queue": 0, "start": 5})):
            with pytest.raises(BrokerError) as exc:
                s.appender.append_system([(change, fields)])
            assert exc.value.code == "NOT_FOUND"
        with pytest.raises(BrokerError):
            s.appender.seal_queue("t", 5)
    finally:
        s.stop()


@pytest.mark.parametrize("crash", [False, True], ids=["clean-stop", "crash"])
def test_a_started_queue_knows_the_producers_it_was_given(tmp_path: Path, crash: bool) -> None:
    """The producers a move carries (their last batch on the shard before) answer a retry of that
    batch as a duplicate, and expect the sequence after it, across a stop or a crash."""
    path = str(tmp_path / "d")
    s = open_store(path)
    create_topic(s, "t")
    end = s.appender.append_system([(system_records.QUEUE_START, {
        "topic": "t", "queue": 0, "start": 40, "producers": [[77, 10, 2, 5000, 38]]})])
    s.watermarks.wait_ack(end, "flush", 5000)
    s = _reopen(s, path, crash)
    try:
        def batch(seq: int) -> IncomingBatch:
            records, _ = bf.encode_records([(b"r", b"", b""), (b"r", b"", b"")])
            return IncomingBatch("t", 0, records, 2, crc32c.crc32c(records), producer_id=77, base_sequence=seq)

        receipts, _ = s.appender.append([batch(10)])
        assert receipts[0].duplicate and receipts[0].base_queue_offset == 38
        assert receipts[0].commit_offset < s.log.max_offset, "the duplicate's offset is one of this log"
        with pytest.raises(BrokerError):
            s.appender.append([batch(13)])
        receipts, end = s.appender.append([batch(12)])
        assert not receipts[0].duplicate and receipts[0].base_queue_offset == 40
        s.watermarks.wait_ack(end, "flush", 5000)
    finally:
        s.stop()
