"""A consumer-offset commit answered ok is durable (found by the chaos harness, seed 2026).

Before, CommitOffset put the commit into the buffer and answered at once; the buffer wrote it up
to ``offsets.flush_interval_ms`` later and the record needed time to be confirmed. Both nodes
losing power 238 ms after an ok commit took it back: two members restarted a second of messages
below it. Now a commit is answered once a confirmed record holds it (Kafka's commitSync).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from broker.client import BrokerClient, Message
from broker.errors import BrokerError
from broker.store.offset_buffer import OffsetBuffer
from tests.procs import DaemonProcess
from tests.waits import wait_until


def _commit_in_thread(buffer: OffsetBuffer, entries: list[tuple[str, str, int, int]]) -> tuple[threading.Thread, list[BrokerError]]:
    """A durable commit (``wait_s=10``) started in a thread of its own; the error it raised lands in the list."""
    outcome: list[BrokerError] = []

    def commit() -> None:
        try:
            buffer.commit(entries, wait_s=10)
        except BrokerError as exc:
            outcome.append(exc)

    t = threading.Thread(target=commit)
    t.start()
    return t, outcome


def test_an_ok_commit_survives_kill9_right_after_it(spawn: Callable[..., DaemonProcess]) -> None:
    """With a flush interval of a minute, a buffered commit would be lost by kill -9 right after its
    answer (and a commit waiting for the interval would time out after 10 s): neither happens."""
    d = spawn("n", config={"offsets.flush_interval_ms": 60_000})
    with BrokerClient(d.address, timeout_s=10) as c:
        c.create_topic("t", queues=2)
        for _ in range(2):  # keyless sends rotate over the queues: 100 messages in each
            c.send("t", [Message(b"m%d" % i) for i in range(100)], ack="flush")
        c.commit_offsets("g", {("t", 0): 40, ("t", 1): 60})
    d.kill9()
    d.start()
    with BrokerClient(d.address) as c:
        assert c.committed_offset("g", "t", 0) == 40
        assert c.committed_offset("g", "t", 1) == 60


def test_durable_commits_share_records_and_report_a_failed_write() -> None:
    written: list[list[tuple[str, str, int, int]]] = []
    gate = threading.Event()
    failing = [False]

    def write(entries: list[tuple[str, str, int, int]]) -> None:
        gate.wait(10)
        if failing[0]:
            raise OSError(28, "No space left on device")
        written.append(entries)

    buffer = OffsetBuffer(60_000, 1000, write)
    buffer.start()
    try:
        # eight committers while the first flush is held: at most two records (the held one, then the rest)
        threads = [threading.Thread(target=buffer.commit, args=([("g", "t", i, i + 1)],), kwargs={"wait_s": 10})
                   for i in range(8)]
        for t in threads:
            t.start()
        wait_until(lambda: len(buffer.buffered()) == 8, 10, what="every commit buffered")
        gate.set()
        for t in threads:
            t.join(10)
        assert sorted(e for rec in written for e in rec) == [("g", "t", i, i + 1) for i in range(8)]
        assert 1 <= len(written) <= 2

        gate.clear()
        failing[0] = True
        t, outcome = _commit_in_thread(buffer, [("g", "t", 0, 99)])
        gate.set()
        t.join(10)
        assert [e.code for e in outcome] == ["UNAVAILABLE"]  # type: ignore[attr-defined]
        assert buffer.get("g", "t", 0) == 99  # kept: written by a later flush
        failing[0] = False
        buffer.commit([("g", "t", 1, 7)], wait_s=10)
        assert ("g", "t", 0, 99) in written[-1] and ("g", "t", 1, 7) in written[-1]
        with pytest.raises(BrokerError, match="not written in time"):
            gate.clear()
            buffer.commit([("g", "t", 2, 5)], wait_s=0.2)
    finally:
        gate.set()
        buffer.stop()


def test_a_node_that_stops_being_the_master_forgets_its_buffered_commits() -> None:
    """Chaos seed 448474327: a slave answered a committed offset from a buffer left from its time
    as master (6,938 messages behind the logs) and retried writing it for good. On becoming a
    slave the buffer is dropped: reads fall through to the view, a waiting commit is told
    UNAVAILABLE, and a write that fails afterwards does not bring the old values back."""
    gate = threading.Event()
    written: list[list[tuple[str, str, int, int]]] = []

    def write(entries: list[tuple[str, str, int, int]]) -> None:
        gate.wait(10)
        raise BrokerError("FAILED_PRECONDITION", "this node is a slave")

    buffer = OffsetBuffer(60_000, 1000, write)
    buffer.start()
    try:
        buffer.commit([("g", "t", 1, 37_129)])
        t, outcome = _commit_in_thread(buffer, [("g", "t", 2, 5)])
        wait_until(lambda: buffer._flushing != {}, 10, what="the flush to start")  # held in write()
        buffer.on_role("master")  # staying master changes nothing
        assert buffer.get("g", "t", 1) == 37_129
        buffer.on_role("slave")
        assert buffer.get("g", "t", 1) is None and buffer.buffered() == {}
        t.join(10)
        assert outcome and "stopped being the master" in str(outcome[0])
        gate.set()  # the held write fails now: nothing comes back
        wait_until(lambda: buffer._failed[1].startswith("BrokerError"), 10, what="the held write to fail")
        assert buffer.buffered() == {} and written == []
    finally:
        gate.set()
        buffer.stop()
