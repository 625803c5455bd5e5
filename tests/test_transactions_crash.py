"""Transactions under kill -9 and failover (DESIGN §14): open transactions, decisions and the
aborted index are views of the log. A restart keeps every reader's view (LSO, gaps) exactly; a
crash between the index's append and its checkpoint replays the abort once; a crash between a
decision and its answer is answered by the retry with the first outcome; a new master finishes
what was decided, goes on with open transactions and times out the rest."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, BrokerError, Message, TransactionAborted
from broker.logformat.txn_records import TXN_PID_BIT
from broker.views.aborted_index import ENTRY_HEAD
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.crashutil import drop_unsynced_bytes
from tests.failoverutil import TOPIC, Pair, create_topic, in_sync, status, wait_master
from tests.procs import DaemonProcess
from tests.waits import wait_until

Spawn = Callable[..., DaemonProcess]
FAST = {"checkpoint.interval_ms": 100, "transactions.check_interval_ms": 100}


# keys: crc32c("a") % 2 == 0 and crc32c("c") % 2 == 1 (BrokerClient.pick_queue)
def _view(c: BrokerClient, topic: str, queues: int) -> dict[int, tuple[list[int], list[bytes], int]]:
    """Per queue: the read_committed offsets and bodies, and the LSO (a pull's max_offset)."""
    out = {}
    for q in range(queues):
        msgs = [m for r in c.iter_pull(topic, q, 0) for m in r]
        out[q] = ([m.queue_offset for m in msgs], [m.body for m in msgs], c.pull(topic, q, 0).max_offset)
    return out


def _reconnected(c: BrokerClient) -> None:
    """Wait until ``c`` reaches its restarted node again (gRPC's reconnect backoff)."""
    wait_until(c.status, 60, "the client's channel connected again", transient=lambda e: isinstance(e, BrokerError))


def _checkpointed(d: DaemonProcess, aborted_runs: int) -> None:
    """Wait until the aborted index on disk holds ``aborted_runs`` entries (topic ``TOPIC``)."""
    path = os.path.join(d.data_dir, "txn", "aborted.idx")
    size = aborted_runs * (ENTRY_HEAD.size + len(TOPIC))
    wait_until(lambda: os.path.exists(path) and os.path.getsize(path) >= size, 20, "the aborts checkpointed")


def test_restart_after_kill9_keeps_lso_gaps_and_open_transactions(spawn: Spawn) -> None:
    d = spawn("node", config=FAST)
    with BrokerClient(d.address) as c:
        c.create_topic(TOPIC, queues=2)
        with c.transaction("ok") as tx:
            tx.send(TOPIC, [Message(b"c0", key="a"), Message(b"c1", key="c")])
        early = c.begin_transaction("early-abort")
        early.send(TOPIC, [Message(b"x0", key="a"), Message(b"x1", key="c")])
        early.abort()
        _checkpointed(d, 2)  # these two ranges come from the index file at restart
        hanging = c.begin_transaction("hanging", timeout_ms=600_000)
        hanging.send(TOPIC, [Message(b"h0", key="c")])
        late = c.begin_transaction("late-abort")
        late.send(TOPIC, [Message(b"y0", key="a")])
        c.send(TOPIC, [Message(b"p0", key="a"), Message(b"p1", key="c")], ack="flush")
        late.abort()  # this one may be replayed from the log
        before = _view(c, TOPIC, 2)
        listed = [t["transactional_id"] for t in c.list_transactions()]
        counts = {k: c.status()["transactions"][k] for k in ("committed", "aborted", "open")}
        assert listed == ["hanging"] and counts == {"committed": 1, "aborted": 2, "open": 1}
        assert b"p1" not in before[1][1] and before[1][2] < c.pull(TOPIC, 1, 0, isolation="read_uncommitted").max_offset
        d.kill9()
        d.start()
        assert _view(c, TOPIC, 2) == before, "a restart changed what read_committed readers see"
        assert [t["transactional_id"] for t in c.list_transactions()] == listed
        assert {k: c.status()["transactions"][k] for k in ("committed", "aborted", "open")} == counts
        hanging.commit()  # the transaction goes on across the restart
        after = _view(c, TOPIC, 2)
        assert after[1][1] == [*before[1][1], b"h0", b"p1"]
        assert after[0] == before[0]


def test_a_crash_between_the_index_append_and_the_checkpoint_replays_the_abort_once(spawn: Spawn) -> None:
    d = spawn("node", config=FAST, env={"TIDEMARK_FAILPOINTS": "txn_after_index_append=exit"})
    with BrokerClient(d.address) as c:
        c.create_topic(TOPIC, queues=1)
        tx = c.begin_transaction("t")
        tx.send(TOPIC, [Message(b"gone")])
        c.send(TOPIC, [Message(b"kept")], ack="flush")
        with contextlib.suppress(BrokerError):  # the crash may come before the answer: the decision is logged
            tx.abort()
        assert d.wait_exit(30) != 0, "the failpoint did not stop the daemon"
        idx = os.path.join(d.data_dir, "txn", "aborted.idx")
        assert os.path.getsize(idx) == ENTRY_HEAD.size + len(TOPIC), "the entry was appended before the crash"
        d.env = {}
        d.start()
        assert _view(c, TOPIC, 1)[0][:2] == ([1], [b"kept"])
        assert c.status()["transactions"]["aborted_ranges"] == 1
        tx2 = c.begin_transaction("t")
        tx2.send(TOPIC, [Message(b"gone too")])
        tx2.abort()
        _checkpointed(d, 2)
        assert os.path.getsize(idx) == 2 * (ENTRY_HEAD.size + len(TOPIC)), "the replayed entry was appended twice"
        assert c.status()["transactions"]["aborted_ranges"] == 2
        assert _view(c, TOPIC, 1)[0][:2] == ([1], [b"kept"])


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "abort"])
def test_a_crash_after_the_decision_is_answered_by_the_retry(spawn: Spawn, commit: bool) -> None:
    d = spawn("node", config=FAST, env={"TIDEMARK_FAILPOINTS": "txn_after_decision=exit"})
    with BrokerClient(d.address, timeout_s=3) as c:
        c.create_topic(TOPIC, queues=1)
        tx = c.begin_transaction("t")
        tx.send(TOPIC, [Message(b"m")])
        with pytest.raises(BrokerError):
            tx.commit() if commit else tx.abort()
        assert d.wait_exit(30) != 0
        assert tx.state == "open", "an end that was not answered leaves the transaction to retry"
        d.env = {}
        d.start()
        _reconnected(c)
        if commit:
            tx.commit()  # answered "committed" from the decision in the log
        else:
            with pytest.raises(TransactionAborted):
                tx.commit()  # the first outcome was abort
        assert _view(c, TOPIC, 1)[0][1] == ([b"m"] if commit else [])


def test_a_crash_after_a_one_call_transaction_is_answered_by_the_retry_once(spawn: Spawn) -> None:
    """A send that begins and commits its transaction, killed after the decision and before the
    answer: a retry of the same call (same begin id, same sequences) finds the transaction its
    first attempt began, ended, and answers committed without storing anything; our client, after
    such a failure, learns the outcome with ``commit()`` (its count covers the failed send)."""
    d = spawn("node", config=FAST, env={"TIDEMARK_FAILPOINTS": "txn_after_decision=exit"})
    one_call = pb.SendRequest(
        ack=pb.ACK_LEADER, transaction=TXN_PID_BIT,
        messages=[pb.PlainMessage(topic=TOPIC, queue_id=0, sequence=i, body=f"once-{i}".encode()) for i in range(2)],
        begin=pb.BeginTransactionRequest(transactional_id="raw", count_messages=True, begin_id=77),
        commit=pb.EndTransactionRequest(transactional_id="raw", commit=True, messages_sent=2))
    with BrokerClient(d.address, timeout_s=3) as c:
        c.create_topic(TOPIC, queues=1)
        with pytest.raises(grpc.RpcError):
            pb_grpc.BrokerStub(grpc.insecure_channel(d.address)).Send(one_call, timeout=10)
        assert d.wait_exit(30) != 0
        d.env = {}
        d.start()
        _reconnected(c)
        again = pb_grpc.BrokerStub(grpc.insecure_channel(d.address)).Send(one_call, timeout=10)
        assert again.ended.outcome == pb.TRANSACTION_OUTCOME_COMMITTED and not again.message_receipts
        assert again.begun.producer_id and again.begun.epoch == 1, "joined, not begun again"
        assert _view(c, TOPIC, 1)[0][1] == [b"once-0", b"once-1"], "stored and committed once"

        d.kill9()
        d.env = {"TIDEMARK_FAILPOINTS": "txn_after_decision=exit"}
        d.start()
        _reconnected(c)
        tx = c.begin_transaction("client")
        with pytest.raises(BrokerError):
            tx.send(TOPIC, [Message(b"client-a"), Message(b"client-b")], commit=True)
        assert d.wait_exit(30) != 0
        d.env = {}
        d.start()
        _reconnected(c)
        tx.commit()  # joins what the failed call began (its begin id): committed, counted 2
        assert tx.state == "committed"
        assert _view(c, TOPIC, 1)[0][1] == [b"once-0", b"once-1", b"client-a", b"client-b"]
        assert c.status()["transactions"]["committed"] == 2


def test_a_new_master_finishes_goes_on_and_times_out(spawn: Spawn, etcd: EtcdProcess) -> None:
    pair = Pair(spawn, etcd, **FAST)
    master = wait_master(pair.nodes)
    slave = pair.other(master)
    create_topic(master, pair.nodes, 1)
    wait_until(lambda: in_sync(master, slave), 30, "the slave in sync")
    with BrokerClient([pair.a.address, pair.b.address], timeout_s=30) as c:
        with c.transaction("done") as tx:
            tx.send(TOPIC, [Message(b"d0")], ack="replica")
        going_on = c.begin_transaction("going-on", timeout_ms=600_000)
        going_on.send(TOPIC, [Message(b"g0")], ack="replica")
        abandoned = c.begin_transaction("abandoned", timeout_ms=4_000)
        abandoned.send(TOPIC, [Message(b"a0")], ack="replica")
        c.send(TOPIC, [Message(b"p0")], ack="replica")
        assert _view(c, TOPIC, 1)[0][1] == [b"d0"]
        master.kill9()
        new = wait_master(pair.nodes, 30, among=[slave])
        assert sorted(t["transactional_id"] for t in c.list_transactions()) == ["abandoned", "going-on"]
        going_on.send(TOPIC, [Message(b"g1")], ack="replica")  # its producer id and sequences carry over
        wait_until(lambda: status(new)["transactions"]["timed_out"] == 1, 30, "the new master times out 'abandoned'")
        with pytest.raises(TransactionAborted):
            abandoned.commit()
        going_on.commit()
        offsets, bodies, lso = _view(c, TOPIC, 1)[0]
        assert bodies == [b"d0", b"g0", b"p0", b"g1"]
        assert offsets == [0, 1, 3, 4], "the abandoned transaction's offset is a gap"
        assert lso == 5


def test_a_delayed_message_of_an_open_transaction_waits_across_kill9(spawn: Spawn) -> None:
    d = spawn("node", config=FAST)
    with BrokerClient(d.address) as c:
        c.create_topic(TOPIC, queues=1)
        tx = c.begin_transaction("delayed", timeout_ms=600_000)
        tx.send(TOPIC, [Message(b"at commit", deliver_at_ms=int(time.time() * 1000) + 200)])
        gone = c.begin_transaction("delayed-aborted")
        gone.send(TOPIC, [Message(b"never", deliver_at_ms=int(time.time() * 1000) + 200)])
        gone.abort()
        d.kill9()
        d.start()
        _reconnected(c)
        time.sleep(1.0)  # due: held while open, dropped when aborted, also after the restart
        assert c.status()["timer_pending"] == 1
        assert [m.body for r in c.iter_pull(TOPIC, 0, 0, isolation="read_uncommitted") for m in r] == []
        tx.commit()
        wait_until(lambda: [m.body for r in c.iter_pull(TOPIC, 0, 0) for m in r] == [b"at commit"], 10,
                   "the delayed message delivered at the commit")


def test_a_torn_tail_inside_a_transaction(spawn: Spawn, tmp_path: Path) -> None:
    """Power loss while a transaction's second batch was written but not synced, half of it left
    on disk: recovery cuts the torn batch; the transaction is still open with its durable batch
    alone; its producer (whose send failed) aborts it; the queue goes on from the cut."""
    journal = str(tmp_path / "fsync.journal")
    d = spawn("node", config=FAST, env={"TIDEMARK_FSYNC_JOURNAL": journal})
    c = BrokerClient(d.address, timeout_s=3)
    try:
        c.create_topic(TOPIC, queues=1)
        tx = c.begin_transaction("torn", timeout_ms=600_000)
        tx.send(TOPIC, [Message(b"durable")], ack="flush")
        d.stop()
        d.env["TIDEMARK_FAILPOINTS"] = "commitlog_before_fsync=exit@2"  # 1: recovery's own sync
        d.start()
        _reconnected(c)
        with contextlib.suppress(BrokerError):
            tx.send(TOPIC, [Message(b"torn " * 200)], ack="leader")
        assert d.wait_exit(30) != 0
        segment = max(Path(d.data_dir, "log").iterdir())
        written = segment.read_bytes()
        assert drop_unsynced_bytes(journal) > 0
        durable = segment.stat().st_size
        with open(segment, "ab") as f:
            f.write(written[durable : durable + (len(written) - durable) // 2])  # a torn batch
        d.env = {}
        d.start()
        _reconnected(c)
        assert c.status()["recovery"]["truncated_bytes"] > 0
        assert [t["transactional_id"] for t in c.list_transactions()] == ["torn"]
        assert [m.body for r in c.iter_pull(TOPIC, 0, 0, isolation="read_uncommitted") for m in r] == [b"durable"]
        with pytest.raises(BrokerError):
            tx.commit()  # its second send failed (the crash): the client lets it only abort
        tx.abort()
        c.send(TOPIC, [Message(b"after")], ack="flush")
        assert [(m.queue_offset, m.body) for r in c.iter_pull(TOPIC, 0, 0) for m in r] == [(1, b"after")]
        raw = [(m.queue_offset, m.body) for r in c.iter_pull(TOPIC, 0, 0, isolation="read_uncommitted") for m in r]
        assert raw == [(0, b"durable"), (1, b"after")], "the queue goes on from the cut"
    finally:
        c.close()


def _unsynced_node(spawn: Spawn, tmp_path: Path) -> tuple[DaemonProcess, str]:
    """A node whose writes stay unsynced until an ack=flush asks (for ``drop_unsynced_bytes``)."""
    journal = str(tmp_path / "fsync.journal")
    return spawn("node", config={**FAST, "commitlog.flush_interval_ms": 60_000},
                 env={"TIDEMARK_FSYNC_JOURNAL": journal}), journal


def test_a_send_lost_by_a_power_cut_makes_the_commit_abort(spawn: Spawn, tmp_path: Path) -> None:
    """A counted transaction's ack=leader send answered, then lost (power cut before the fsync): the
    commit after the restart finds the log short of the producer's count and aborts the whole
    transaction (reason "incomplete"), so its durable part never becomes visible alone. The
    other transaction, whose messages all survived, commits with its count rebuilt by recovery."""
    d, journal = _unsynced_node(spawn, tmp_path)
    c = BrokerClient(d.address, timeout_s=3)
    try:
        c.create_topic(TOPIC, queues=1)
        kept = c.begin_transaction("kept", timeout_ms=600_000)
        kept.send(TOPIC, [Message(b"k0"), Message(b"k1")])
        torn = c.begin_transaction("torn", timeout_ms=600_000)
        torn.send(TOPIC, [Message(b"durable")])
        c.send(TOPIC, [Message(b"flushed")], ack="flush")  # everything so far is on disk
        torn.send(TOPIC, [Message(b"lost")], ack="leader")
        assert torn.counted and torn.messages_sent == 2
        d.kill9()
        assert drop_unsynced_bytes(journal) > 0
        d.start()
        _reconnected(c)
        assert sorted(t["transactional_id"] for t in c.list_transactions()) == ["kept", "torn"]
        with pytest.raises(TransactionAborted) as aborted:
            torn.commit()
        assert aborted.value.reason == "incomplete"
        kept.commit()
        assert _view(c, TOPIC, 1)[0][1] == [b"k0", b"k1", b"flushed"], "the torn transaction is all gaps"
    finally:
        c.close()


def test_a_producer_id_lost_with_the_tail_never_joins_a_later_transaction(spawn: Spawn, tmp_path: Path) -> None:
    """A counted transaction begun by an ack=leader send, then lost whole (a power cut before the
    fsync). After the restart the next begin lands at the very offset the lost one had; its producer
    id differs all the same (new_pid's random bits), so the first producer's next send is refused
    instead of joining the other transaction, and the other commits only its own message."""
    d, journal = _unsynced_node(spawn, tmp_path)
    c = BrokerClient(d.address, timeout_s=3)
    try:
        c.create_topic(TOPIC, queues=1)
        c.send(TOPIC, [Message(b"flushed")], ack="flush")
        lost = c.begin_transaction("lost", timeout_ms=600_000)
        lost.send(TOPIC, [Message(b"l0")], ack="leader")
        lost_at = lost.producer_id & ((1 << 48) - 1)
        d.kill9()
        assert drop_unsynced_bytes(journal) > 0
        d.start()
        _reconnected(c)
        assert c.status()["max_offset"] == lost_at, "the lost begin's batch was the log's end"
        other = c.begin_transaction("other", timeout_ms=600_000)
        other.send(TOPIC, [Message(b"o0")], ack="flush")
        assert other.producer_id & ((1 << 48) - 1) == lost_at and other.producer_id != lost.producer_id
        with pytest.raises(BrokerError, match="not open"):
            lost.send(TOPIC, [Message(b"l1")])
        stub = pb_grpc.BrokerStub(grpc.insecure_channel(d.address))
        ended = stub.EndTransaction(pb.EndTransactionRequest(transactional_id="lost", producer_id=lost.producer_id,
                                                             commit=True, messages_sent=1))
        assert (ended.outcome, ended.reason) == (pb.TRANSACTION_OUTCOME_ABORTED, "lost"), "its begin is not here"
        lost.abort()
        assert lost.state == "aborted"
        other.commit()
        assert _view(c, TOPIC, 1)[0][1] == [b"flushed", b"o0"]
    finally:
        c.close()
