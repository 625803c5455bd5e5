"""Append semantics of the store: idempotent sequences within and across requests."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import crc32c
import pytest

from broker.errors import BrokerError
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.store import IncomingBatch
from broker.store.waiters import OffsetWaiters
from broker.views.consume_queue import ENTRY_BYTES
from tests.storeutil import create_topic, open_store, read_all, send
from tests.waits import wait_until


def _batch(seq: int, bodies: list[bytes], pid: int = 11) -> IncomingBatch:
    records, _ = bf.encode_records([(b, b"", b"") for b in bodies])
    return IncomingBatch("t", 0, records, len(bodies), crc32c.crc32c(records), producer_id=pid, base_sequence=seq)


def test_sequences_within_one_request(tmp_path: Path) -> None:
    """Consecutive batches of one producer in one request are accepted; a repeated one is a duplicate."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    receipts, end = s.appender.append([_batch(0, [b"a", b"b"]), _batch(2, [b"c"]), _batch(0, [b"a", b"b"])])
    s.watermarks.wait_ack(end, "flush", 5000)
    assert [r.duplicate for r in receipts] == [False, False, True]
    assert receipts[2].commit_offset == receipts[0].commit_offset
    assert read_all(s, "t") == [b"a", b"b", b"c"]
    s.stop()


def test_rejected_request_leaves_no_sequence_behind(tmp_path: Path) -> None:
    """A request refused for an out-of-order batch records none of its batches."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    with pytest.raises(BrokerError, match="out-of-order"):
        s.appender.append([_batch(0, [b"x"]), _batch(5, [b"y"])])
    receipts, end = s.appender.append([_batch(0, [b"x"])])
    s.watermarks.wait_ack(end, "flush", 5000)
    assert not receipts[0].duplicate
    assert read_all(s, "t") == [b"x"]
    s.stop()


def test_request_with_more_batches_than_iov_max(tmp_path: Path) -> None:
    """A request of 1500 batches (3000 buffers for writev) is written completely."""
    s = open_store(str(tmp_path))
    create_topic(s, "wide", queues=1024)
    batches = []
    for i in range(1500):
        records, _ = bf.encode_records([(b"%d" % i, b"", b"")])
        batches.append(IncomingBatch("wide", i % 1024, records, 1, crc32c.crc32c(records)))
    receipts, end = s.appender.append(batches)
    s.watermarks.wait_ack(end, "flush", 5000)
    assert len(receipts) == 1500 and s.log.max_offset == end
    assert read_all(s, "wide", 5) == [b"5", b"1029"]
    s.stop()


def test_pull_respects_its_byte_budget(tmp_path: Path) -> None:
    """A pull returns whole batches within max_bytes (one oversized first batch is still served)."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    for _ in range(5):
        records, _ = bf.encode_records([(b"b" * 10_000, b"", b"")])
        _, end = s.appender.append([IncomingBatch("t", 0, records, 1, crc32c.crc32c(records))])
    s.watermarks.wait_ack(end, "flush", 5000)
    read_all(s, "t")
    r = s.reads.pull("t", 0, 0, 100, 25_000, 0)  # adjacent batches come back as one run
    assert sum(len(b) for b in r.batches) <= 25_000 and r.count == 2
    r = s.reads.pull("t", 0, 0, 100, 100, 0)
    assert sum(len(b) for b in r.batches) > 100 and r.count == 1
    s.stop()


def test_send_after_unapplied_delete_is_refused(tmp_path: Path) -> None:
    """Once a topic delete is appended, sends to it fail even before the views applied it."""

    s = open_store(str(tmp_path))
    create_topic(s, "t")
    s.appender.append_system([(system_records.TOPIC_DELETE, {"topic": "t"})])
    records, _ = bf.encode_records([(b"late", b"", b"")])
    with pytest.raises(BrokerError) as info:
        s.appender.append([IncomingBatch("t", 0, records, 1, crc32c.crc32c(records))])
    assert info.value.code == "NOT_FOUND"
    with pytest.raises(BrokerError) as again:
        s.appender.append_system([(system_records.TOPIC_DELETE, {"topic": "t"})])
    assert again.value.code == "NOT_FOUND"
    s.stop()


def test_offset_waiters_wake_only_at_their_offset() -> None:
    """A waiter parked for offset 10 stays parked when the offset reaches 5 and goes on at 10."""

    waiters = OffsetWaiters()
    offset = [0]
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(waiters.wait(lambda: offset[0] >= 10, 10, 30.0)))
    t.start()
    wait_until(lambda: waiters.parked == 1, 10, "the waiter to park", poll_s=0.001)
    offset[0] = 5
    waiters.wake(5)
    assert waiters.parked == 1 and not result
    offset[0] = 10
    waiters.wake(10)
    t.join()
    assert result == [True] and waiters.parked == 0
    assert waiters.wait(lambda: False, 20, 0.0) is False and waiters.parked == 0  # a timeout leaves nothing behind


def test_a_coroutine_waits_for_its_offset_without_a_thread() -> None:
    """``wait_async``: a waiter on an event loop is released by a ``wake`` from another thread at its
    offset (not before), times out leaving nothing behind, and ``wake_all`` releases it to re-check."""

    waiters = OffsetWaiters()
    offset = [0]

    async def scenario() -> None:
        task = asyncio.ensure_future(waiters.wait_async(lambda: offset[0] >= 10, 10, 30.0))
        while waiters.parked != 1:
            await asyncio.sleep(0.001)

        def advance(value: int) -> None:
            offset[0] = value
            waiters.wake(value)

        await asyncio.to_thread(advance, 5)  # the dispatcher's thread, say
        await asyncio.sleep(0.05)
        assert not task.done() and waiters.parked == 1
        await asyncio.to_thread(advance, 10)
        assert await asyncio.wait_for(task, 5) is True and waiters.parked == 0
        assert await waiters.wait_async(lambda: False, 20, 0.01) is False and waiters.parked == 0
        stopped = [False]
        task = asyncio.ensure_future(waiters.wait_async(lambda: stopped[0], 30, 30.0))
        while waiters.parked != 1:
            await asyncio.sleep(0.001)
        stopped[0] = True
        await asyncio.to_thread(waiters.wake_all)
        assert await asyncio.wait_for(task, 5) is True

    asyncio.run(scenario())


def test_one_wake_releases_many_coroutines_with_one_call_into_their_loop() -> None:
    """Twenty coroutines parked at offsets 1..20 and a thread waiting at 5: ``wake(12)`` releases the
    thread and the twelve coroutines at or below 12 with one ``call_soon_threadsafe`` (one wake-up of
    the loop, not one per waiter); the rest stay parked, and a timed-out waiter leaves nothing."""

    waiters = OffsetWaiters()
    offset = [0]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        calls = [0]
        plain = loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return plain(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        tasks = [asyncio.ensure_future(waiters.wait_async(lambda t=t: offset[0] >= t, t, 30.0)) for t in range(1, 21)]
        thread_result: list[bool] = []
        thread = threading.Thread(target=lambda: thread_result.append(waiters.wait(lambda: offset[0] >= 5, 5, 30.0)))
        thread.start()
        while waiters.parked != 21:
            await asyncio.sleep(0.001)

        def advance(value: int) -> None:
            offset[0] = value
            waiters.wake(value)

        waker = threading.Thread(target=advance, args=(12,))  # the dispatcher's thread, say
        waker.start()
        while sum(t.done() for t in tasks) < 12 or thread.is_alive() or waker.is_alive():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        done = [t for t in tasks if t.done()]
        pending = [t for t in tasks if not t.done()]
        assert done == tasks[:12] and all(t.result() is True for t in done) and calls[0] == 1
        assert thread_result == [True] and waiters.parked == 8
        for t in pending:
            t.cancel()
        await asyncio.wait(pending)
        assert waiters.parked == 0  # cancelled calls leave nothing parked
        assert await waiters.wait_async(lambda: False, 99, 0.02) is False and waiters.parked == 0

    asyncio.run(scenario())


def test_topic_creates_touch_no_queue_files_until_the_first_entry(tmp_path: Path) -> None:
    """A created topic has no queue files (nor a directory) until a queue gets its first entry; a
    restart keeps such topics, and their queues take sends after it."""

    s = open_store(str(tmp_path), **{"checkpoint.interval_ms": 10})
    for i in range(20):
        create_topic(s, f"t{i}", queues=4)
    cq = tmp_path / "cq"
    assert not [p for p in cq.iterdir() if p.name.startswith("t")]
    send(s, "t3", [b"a"], queue=2)
    assert read_all(s, "t3", 2) == [b"a"]
    assert sorted(p.name for p in cq.glob("t3.*/*")) == ["2.cq"]
    s.stop()
    s = open_store(str(tmp_path))
    assert sorted(s.views.metadata.list_topics()) == sorted(f"t{i}" for i in range(20))
    assert read_all(s, "t3", 2) == [b"a"] and read_all(s, "t7", 1) == []
    send(s, "t7", [b"b"], queue=1)
    assert read_all(s, "t7", 1) == [b"b"]
    s.crash_close()
    s = open_store(str(tmp_path))  # after a crash: the view replays from its checkpoint
    assert read_all(s, "t7", 1) == [b"b"] and read_all(s, "t9", 0) == []
    s.stop()


def _checkpointed_queue(tmp_path: Path, bodies: list[bytes], after: list[bytes]) -> Path:
    """Topic ``t``: ``bodies`` sent and checkpointed, ``after`` sent after the checkpoint, then a crash."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    for body in bodies:
        send(s, "t", [body])
    assert read_all(s, "t") == bodies
    with s.dispatcher.lock:
        s.dispatcher.checkpoint_views()
    for body in after:
        send(s, "t", [body])
    assert read_all(s, "t") == bodies + after
    s.crash_close()
    return next((tmp_path / "cq").glob("t.*/0.cq"))


def test_a_queue_file_longer_than_its_checkpoint_is_cut_back_and_replayed(tmp_path: Path) -> None:
    """Entries written after the last checkpoint (and a torn one after them) are cut at start, then
    written again by the replay: the queue reads as sent and takes new entries in place."""

    qfile = _checkpointed_queue(tmp_path, [b"a", b"b"], [b"c"])
    assert qfile.stat().st_size == 3 * ENTRY_BYTES
    with qfile.open("ab") as f:
        f.write(b"\xff" * (ENTRY_BYTES + 5))
    s = open_store(str(tmp_path))
    assert read_all(s, "t") == [b"a", b"b", b"c"]
    assert qfile.stat().st_size == 3 * ENTRY_BYTES
    qf = s.views.queues.queue("t", 0)
    assert qf is not None and qf.next_queue_offset == 3
    send(s, "t", [b"d"])
    assert read_all(s, "t") == [b"a", b"b", b"c", b"d"]
    s.stop()


def test_a_queue_file_shorter_than_its_checkpoint_is_rebuilt_from_the_log(tmp_path: Path) -> None:
    """A queue file that lost checkpointed entries is not trusted: the view is rebuilt from the log."""

    qfile = _checkpointed_queue(tmp_path, [b"a", b"b"], [])
    os.truncate(qfile, ENTRY_BYTES)
    s = open_store(str(tmp_path))
    assert read_all(s, "t") == [b"a", b"b"]
    s.stop()


def test_created_topics_reach_lmdb_with_the_next_commit_and_survive_a_crash_before_it(tmp_path: Path) -> None:
    """A round of topic creates alone leaves LMDB alone (readers see topics in memory); a crash
    before the next commit replays the creates from the log; a checkpoint writes them."""

    s = open_store(str(tmp_path))
    create_topic(s, "a")
    assert "a" in s.views.metadata.list_topics()
    s.crash_close()
    s = open_store(str(tmp_path))
    assert "a" in s.views.metadata.list_topics()
    create_topic(s, "b", queues=3)
    with s.dispatcher.lock:
        s.dispatcher.checkpoint_views()
    with s.views.metadata.env.begin() as txn:
        stored = {bytes(k).decode() for k, _ in txn.cursor(db=s.views.metadata._topics_db)}
    assert stored >= {"a", "b"}
    s.crash_close()
    s = open_store(str(tmp_path))
    info = s.views.metadata.topic("b")
    assert info is not None and info["queues"] == 3
    send(s, "b", [b"x"], queue=2)
    assert read_all(s, "b", 2) == [b"x"]
    s.stop()


def test_a_cancelled_coroutine_waiter_leaves_nothing_parked() -> None:
    waiters = OffsetWaiters()

    async def scenario() -> None:
        task = asyncio.ensure_future(waiters.wait_async(lambda: False, 10, 30.0))
        while waiters.parked != 1:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert waiters.parked == 0

    asyncio.run(scenario())
