"""Transactions on one node (DESIGN §14): atomic over topics and queues, aborts that leave offset
gaps, fencing, timeouts, check-back, retried and late ends, offsets committed with a transaction,
readers that start in the middle. Real daemons on loopback, through our client and raw stubs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

import grpc
import pytest

from broker.client import BrokerClient, BrokerError, CheckQuestion, FailedPrecondition, Message, TransactionAborted
from broker.logformat.txn_records import TXN_PID_BIT
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.procs import DaemonProcess, free_port
from tests.waits import wait_until

Spawn = Callable[..., DaemonProcess]
FAST = {"checkpoint.interval_ms": 100, "transactions.check_interval_ms": 100}


def _bodies(c: BrokerClient, topic: str, queue: int = 0, start: int = 0, isolation: str = "read_committed") -> list[bytes]:
    return [m.body for r in c.iter_pull(topic, queue, start, isolation=isolation) for m in r]


def _all_bodies(c: BrokerClient, topic: str, queues: int, isolation: str = "read_committed") -> set[bytes]:
    return {b for q in range(queues) for b in _bodies(c, topic, q, isolation=isolation)}


@pytest.fixture
def node(spawn: Spawn) -> DaemonProcess:
    return spawn("node", config=FAST)


def test_atomic_over_two_topics_and_several_queues(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c:
        c.create_topic("orders", queues=3)
        c.create_topic("audit", queues=1)
        tx = c.begin_transaction("billing-1")
        sent = [Message(f"o{i}".encode(), key=f"k{i}") for i in range(12)]
        tx.send("orders", sent)
        tx.send("audit", [Message(b"a0")])
        c.send("audit", [Message(b"plain-after")])  # behind the LSO until the transaction ends
        listed = wait_until(lambda: (t := c.list_transactions()) and len(t[0]["topics"]) == 2 and t, 10,
                            "the transactions view to apply the sends")
        used = {m["queue_id"] for m in listed[0]["queues"] if m["topic"] == "orders"}
        assert len(used) > 1, "the keys spread the transaction over several queues"
        assert _all_bodies(c, "orders", 3) == set()
        assert _bodies(c, "audit") == []
        assert _all_bodies(c, "orders", 3, "read_uncommitted") == {m.body for m in sent}
        assert _bodies(c, "audit", isolation="read_uncommitted") == [b"a0", b"plain-after"]
        high = c.pull("audit", 0, 0).max_offset
        assert high == 0, "a read_committed pull reports the LSO as the end"
        tx.commit()
        assert _all_bodies(c, "orders", 3) == {m.body for m in sent}
        assert _bodies(c, "audit") == [b"a0", b"plain-after"]
        assert c.list_transactions() == []
        st = c.status()["transactions"]
        assert st["committed"] == 1 and st["open"] == 0


def test_abort_leaves_gaps_and_its_offsets_are_not_applied(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        c.create_topic("in", queues=1)
        c.send("in", [Message(b"i0"), Message(b"i1")])
        c.send("t", [Message(b"before")])
        tx = c.begin_transaction("etl")
        tx.send("t", [Message(b"x1"), Message(b"x2")])
        tx.send("t", [Message(b"x3")])
        tx.commit_offsets("g", "in", {0: 2})
        tx.abort()
        c.send("t", [Message(b"after")])
        msgs = [(m.queue_offset, m.body) for r in c.iter_pull("t", 0, 0) for m in r]
        assert msgs == [(0, b"before"), (4, b"after")], "aborted offsets 1-3 are a gap"
        assert c.committed_offset("g", "in", 0) is None
        # a reader that starts inside the aborted range goes on past it
        r = c.pull("t", 0, 2)
        assert [m.body for m in r] == [b"after"] and r.next_offset == 5
        assert c.describe_transaction("etl")["state"] == "aborted"
        assert [m.body for m in c.pull("t", 0, 0, isolation="read_uncommitted")] == [b"before", b"x1", b"x2", b"x3",
                                                                                        b"after"]


def test_a_batch_that_is_all_aborted_and_a_queue_that_ends_in_one(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        tx = c.begin_transaction("a")
        tx.send("t", [Message(b"gone")] * 5)
        tx.abort()
        r = c.pull("t", 0, 0)
        assert len(r) == 0 and r.next_offset == 5, "the pull moves past what it skipped"
        assert list(c.iter_pull("t", 0, 0)) == [], "iter_pull passes the gap and stops at the end"
        # a long-poll from inside the gap answers at once, not at its timeout
        t0 = time.monotonic()
        r = c.pull("t", 0, 1, max_wait_ms=5000)
        assert r.next_offset == 5 and time.monotonic() - t0 < 2.0


def test_commit_offsets_apply_with_the_commit(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c:
        c.create_topic("in", queues=2)
        c.create_topic("out", queues=1)
        c.send("in", [Message(b"a")] * 3)  # keyless calls rotate over the queues
        c.send("in", [Message(b"b")] * 2)
        offsets = wait_until(lambda: {q["queue_id"]: q["max_offset"] for q in c.describe_topic("in")["queues"]}, 10,
                             "the sends in describe_topic (it reads the applied views)",
                             accept=lambda o: sorted(o.values()) == [2, 3])
        with c.transaction("pipe") as tx:
            tx.send("out", [Message(b"transformed")])
            tx.commit_offsets("g", "in", offsets)
            assert c.committed_offset("g", "in", 0) is None
        assert {q: c.committed_offset("g", "in", q) for q in offsets} == offsets
        assert _bodies(c, "out") == [b"transformed"]


def test_an_exception_in_the_block_aborts(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        with pytest.raises(RuntimeError), c.transaction("x") as tx:
            tx.send("t", [Message(b"never")])
            raise RuntimeError("the local step failed")
        c.send("t", [Message(b"later")])
        assert _bodies(c, "t") == [b"later"]
        assert c.describe_transaction("x")["state"] == "aborted"


def test_a_second_instance_fences_the_first(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c1, BrokerClient(node.address) as c2:
        c1.create_topic("t", queues=1)
        old = c1.begin_transaction("shop")
        old.send("t", [Message(b"zombie")])
        new = c2.begin_transaction("shop")
        assert new.epoch == 0, "a transaction begins on the master with its first send"
        old.send("t", [Message(b"zombie-1")])  # not fenced yet
        new.send("t", [Message(b"fresh")])
        assert new.epoch == old.epoch + 1
        with pytest.raises(FailedPrecondition, match="not open"):
            old.send("t", [Message(b"zombie-2")])
        with pytest.raises(FailedPrecondition, match="fenced"):
            old._end(True, [])  # the first instance's commit (its send failing is ignored here)
        third = c1.begin_transaction("shop", fence=True)  # fenced at once: before it reads its inputs
        assert third.epoch == new.epoch + 1
        with pytest.raises(FailedPrecondition, match="fenced"):
            new.commit()
        third.send("t", [Message(b"third")])
        third.commit()
        assert _bodies(c1, "t") == [b"third"]


def test_timeout_without_callback_aborts_and_the_lso_moves_on(spawn: Spawn) -> None:
    d = spawn("node", config=FAST)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        tx = c.begin_transaction("slow", timeout_ms=400)
        tx.send("t", [Message(b"late")])
        c.send("t", [Message(b"plain")])
        assert _bodies(c, "t") == []
        wait_until(lambda: _bodies(c, "t") == [b"plain"], 10, "the LSO to move past the timed-out transaction")
        info = c.describe_transaction("slow")
        assert info["state"] == "aborted" and info["reason"] == "timeout"
        with pytest.raises(TransactionAborted) as exc:
            tx.commit()
        assert exc.value.reason == "timeout"
        assert c.status()["transactions"]["timed_out"] == 1


@pytest.mark.parametrize("answers,state", [(["commit"], "committed"), (["abort"], "aborted"),
                                           (["unknown", "unknown", "commit"], "committed")])
def test_check_back_decides_past_the_timeout(node: DaemonProcess, answers: list[str], state: str) -> None:
    asked: list[CheckQuestion] = []

    def check(q: CheckQuestion) -> str:
        asked.append(q)
        return answers[min(len(asked), len(answers)) - 1]

    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        tx = c.begin_transaction("half", timeout_ms=300, check=check)
        tx.send("t", [Message(b"half-message")])
        wait_until(lambda: c.describe_transaction("half")["state"] != "open", 15, "the check-back to decide")
        info = c.describe_transaction("half")
        assert info["state"] == state and info["reason"] == "check"
        assert [q.attempt for q in asked] == list(range(1, len(answers) + 1))
        assert all(q.producer_id == tx.producer_id for q in asked)
        assert _bodies(c, "t") == ([b"half-message"] if state == "committed" else [])


def test_check_back_without_an_answer_aborts_after_check_max(spawn: Spawn) -> None:
    d = spawn("node", config={**FAST, "transactions.check_max": 3})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        stub = pb_grpc.BrokerStub(grpc.insecure_channel(d.address))
        begun = stub.BeginTransaction(pb.BeginTransactionRequest(transactional_id="mute", timeout_ms=200,
                                                                 check_back=True))
        stub.Send(pb.SendRequest(transaction=begun.producer_id, messages=[pb.PlainMessage(topic="t", body=b"m")]))
        wait_until(lambda: c.describe_transaction("mute")["state"] == "aborted", 15, "the abort after 3 checks")
        assert c.describe_transaction("mute")["reason"] == "timeout"


def test_a_retried_end_answers_the_first_outcome_and_a_late_send_is_refused(node: DaemonProcess) -> None:
    stub = pb_grpc.BrokerStub(grpc.insecure_channel(node.address))
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        tx = c.begin_transaction("retry")
        tx.send("t", [Message(b"m")])
        tx.commit()
        again = pb.EndTransactionRequest(transactional_id="retry", producer_id=tx.producer_id, commit=True)
        assert stub.EndTransaction(again).outcome == pb.TRANSACTION_OUTCOME_COMMITTED
        abort = pb.EndTransactionRequest(transactional_id="retry", producer_id=tx.producer_id, commit=False)
        assert stub.EndTransaction(abort).outcome == pb.TRANSACTION_OUTCOME_COMMITTED, "the first outcome stands"
        # a send of the ended transaction (a retry that arrives late) is refused, and never joins the next one
        nxt = c.begin_transaction("retry")
        late = pb.SendRequest(transaction=tx.producer_id, messages=[pb.PlainMessage(topic="t", body=b"late")])
        with pytest.raises(grpc.RpcError) as exc:
            stub.Send(late)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        nxt.send("t", [Message(b"next")])
        nxt.commit()
        assert _bodies(c, "t", isolation="read_uncommitted") == [b"m", b"next"]


def test_bad_transaction_requests_are_refused(node: DaemonProcess) -> None:
    stub = pb_grpc.BrokerStub(grpc.insecure_channel(node.address))
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
    cases: list[tuple[Callable[[], object], grpc.StatusCode]] = [
        (lambda: stub.BeginTransaction(pb.BeginTransactionRequest(transactional_id="")), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.BeginTransaction(pb.BeginTransactionRequest(transactional_id="x" * 300)),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.BeginTransaction(pb.BeginTransactionRequest(transactional_id="t", timeout_ms=10**9)),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.EndTransaction(pb.EndTransactionRequest(transactional_id="t", producer_id=5, commit=True)),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.Send(pb.SendRequest(transaction=7, messages=[pb.PlainMessage(topic="t", body=b"x")])),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.Send(pb.SendRequest(transaction=TXN_PID_BIT | 999, messages=[pb.PlainMessage(topic="t", body=b"x")])),
         grpc.StatusCode.FAILED_PRECONDITION),
        # what a node that ignores SendRequest.begin sees of a beginning send: refused, never stored plain
        (lambda: stub.Send(pb.SendRequest(transaction=TXN_PID_BIT, messages=[pb.PlainMessage(topic="t", body=b"x")])),
         grpc.StatusCode.FAILED_PRECONDITION),
        (lambda: stub.AbortTransaction(pb.AbortTransactionRequest(transactional_id="nobody")), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.DescribeTransaction(pb.DescribeTransactionRequest(transactional_id="nobody")),
         grpc.StatusCode.NOT_FOUND),
    ]
    for call, code in cases:
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == code, exc.value.details()
    never = stub.EndTransaction(pb.EndTransactionRequest(transactional_id="t", producer_id=TXN_PID_BIT | 12345,
                                                         commit=True))
    assert (never.outcome, never.reason) == (pb.TRANSACTION_OUTCOME_ABORTED, "lost"), "a begin this log never held"
    begun = stub.BeginTransaction(pb.BeginTransactionRequest(transactional_id="d"))
    delayed = pb.SendRequest(transaction=begun.producer_id,
                             messages=[pb.PlainMessage(topic="t", body=b"x", deliver_at_ms=int(time.time() * 1000) + 60_000)])
    assert stub.Send(delayed).message_receipts[0].timer_offset > 0, "a delayed plain message in a transaction"
    stub.EndTransaction(pb.EndTransactionRequest(transactional_id="d", producer_id=begun.producer_id, commit=False))
    with pytest.raises(grpc.RpcError) as exc:
        stub.Send(delayed)
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION, "a send after the end is refused"


def test_open_transactions_are_bounded(spawn: Spawn) -> None:
    d = spawn("node", config={**FAST, "transactions.open_max": 3})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        txs = [c.begin_transaction(f"b{i}") for i in range(3)]
        for tx in txs:
            tx.send("t", [Message(b"m")])  # begun on the master with its first send
        with pytest.raises(Exception) as exc:
            c.begin_transaction("b3").send("t", [Message(b"one too many")])
        assert "transactions.open_max" in str(exc.value)
        with pytest.raises(Exception) as exc:  # a transaction that sent nothing begins at its commit
            c.begin_transaction("b3").commit()
        assert "transactions.open_max" in str(exc.value)
        again = c.begin_transaction("b0")  # a new instance of an open id replaces it: not one more
        again.send("t", [Message(b"m")])
        assert again.epoch == 2
        for tx in txs[1:]:
            tx.abort()
        again.commit()
        assert _bodies(c, "t") == [b"m"]


def test_cli_lists_describes_and_aborts(node: DaemonProcess) -> None:
    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "broker.cli", "txn", *args, "--broker", node.address],
                             check=False, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        tx = c.begin_transaction("ops-1")
        tx.send("t", [Message(b"stuck")])
        listed = wait_until(lambda: (rows := [json.loads(line) for line in cli("list", "--json").splitlines()])
                            and rows[0]["queues"] and rows, 20, "the transaction's send in the list")
        assert [t["transactional_id"] for t in listed] == ["ops-1"]
        assert listed[0]["queues"] == [{"topic": "t", "queue_id": 0, "first_offset": 0}]
        assert "ops-1 open" in cli("describe", "ops-1")
        aborted = json.loads(cli("abort", "ops-1", "--json"))
        assert aborted["state"] == "aborted" and aborted["reason"] == "operator"
        with pytest.raises(TransactionAborted):
            tx.commit()


def test_read_committed_consumers_and_consume(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        with c.transaction("p") as tx:
            tx.send("t", [Message(b"c1"), Message(b"c2")])
        tx2 = c.begin_transaction("q")
        tx2.send("t", [Message(b"aborted")])
        tx2.abort()
        c.send("t", [Message(b"c3")])
        with c.consumer("g", "t", auto_offset_reset="earliest") as cons:
            got: list[bytes] = []
            wait_until(lambda: got.extend(m.body for m in cons.poll(timeout_ms=200)) or len(got) >= 3, 20,
                       "the consumer to read every committed message")
        assert got == [b"c1", b"c2", b"c3"]
    out = subprocess.run([sys.executable, "-m", "broker.cli", "consume", "t", "--broker", node.address],
                         check=True, capture_output=True, text=True, timeout=60)
    assert [json.loads(line)["queue_offset"] for line in out.stdout.splitlines()] == [0, 1, 3]
    out = subprocess.run([sys.executable, "-m", "broker.cli", "consume", "t", "--isolation", "read_uncommitted",
                          "--broker", node.address], check=True, capture_output=True, text=True, timeout=60)
    assert [json.loads(line)["queue_offset"] for line in out.stdout.splitlines()] == [0, 1, 2, 3]


def test_a_parked_read_committed_pull_wakes_at_the_commit(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        tx = c.begin_transaction("w")
        tx.send("t", [Message(b"m")])
        woke: list[float] = []

        def pull() -> None:
            with BrokerClient(node.address) as reader:
                r = reader.pull("t", 0, 0, max_wait_ms=10_000)
                woke.append(time.monotonic())
                assert [m.body for m in r] == [b"m"]

        t = threading.Thread(target=pull)
        t.start()
        time.sleep(0.5)  # the pull is parked behind the LSO (nothing else wakes it)
        committed = time.monotonic()
        tx.commit()
        t.join(15)
        assert woke and woke[0] - committed < 3.0


def test_pop_leases_committed_messages_only(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(b"m0")])
        open_tx = c.begin_transaction("a")
        open_tx.send("t", [Message(b"a1")])
        aborted = c.begin_transaction("b")
        aborted.send("t", [Message(b"b1"), Message(b"b2")])
        aborted.abort()
        c.send("t", [Message(b"m1")])
        first = c.pop("g", "t", max_messages=100, start="earliest")
        assert [m.body for m in first] == [b"m0"], "a pop leased past the LSO"
        raw = c.pop("u", "t", max_messages=100, start="earliest", isolation="read_uncommitted")
        assert [m.body for m in raw] == [b"m0", b"a1", b"b1", b"b2", b"m1"]
        assert not c.pop("g", "t", max_messages=100)
        assert {q["queue_id"]: q["lag"] for q in c.describe_group("g")["queues"]} == {0: 1}, "lag runs to the LSO"
        open_tx.commit()
        second = c.pop("g", "t", max_messages=100, max_wait_ms=5000)
        assert [(m.body, m.queue_offset) for m in second] == [(b"a1", 1), (b"m1", 4)], "aborted messages leased"
        assert c.ack("g", first) == {} and c.ack("g", second) == {}
        assert not c.pop("g", "t", max_messages=100)
        described = c.describe_group("g")["queues"][0]
        assert (described["lag"], described["in_flight"]) == (0, 0), described


def test_lso_metrics_and_group_lag(spawn: Spawn) -> None:
    port = free_port()
    node = spawn("node", config={**FAST, "node.metrics_listen": f"127.0.0.1:{port}"})

    def scrape() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return {m[0]: float(m[1]) for m in re.findall(r"^(tidemark_(?:lso|transaction)\S*) (\S+)$", text, re.M)}

    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(b"before")])
        tx = c.begin_transaction("hang")
        tx.send("t", [Message(b"h1"), Message(b"h2")])
        c.send("t", [Message(b"w1"), Message(b"w2"), Message(b"w3")])  # waits behind the open transaction
        c.reset_offsets("s", "t", "earliest")
        assert c.describe_group("s")["queues"][0]["lag"] == 1, "a group's lag runs to the LSO, not the end"
        held = wait_until(scrape, 20, "the LSO metrics exported",
                          accept=lambda m: m.get('tidemark_lso_lag_messages{topic="t"}') == 5
                          and m.get("tidemark_lso_stalled_seconds", 0) > 0
                          and m.get("tidemark_transaction_oldest_open_seconds", 0) > 0)  # one tick sets these apart
        assert held["tidemark_transactions_open"] == 1
        tx.abort()
        done = wait_until(scrape, 20, "the LSO metrics after the abort",
                          accept=lambda m: m.get("tidemark_transactions_open") == 0)
        assert done["tidemark_lso_stalled_seconds"] == 0 and 'tidemark_lso_lag_messages{topic="t"}' not in done
        assert done['tidemark_transactions_ended{outcome="aborted"}'] == 1
        assert c.describe_group("s")["queues"][0]["lag"] == 6, "after the abort: to the end (offsets, gaps counted)"


def test_delayed_messages_fire_at_commit_and_never_when_aborted(node: DaemonProcess) -> None:
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        due_ms = int(time.time() * 1000) + 300
        kept = c.begin_transaction("d-commit")
        kept.send("t", [Message(b"due, then committed", deliver_at_ms=due_ms)])
        dropped = c.begin_transaction("d-abort")
        dropped.send("t", [Message(b"due, then aborted", deliver_at_ms=due_ms)])
        later = c.begin_transaction("d-later")
        later.send("t", [Message(b"committed, due later", deliver_at_ms=due_ms + 2500)])
        later.commit()
        time.sleep(1.5)  # both due while their transactions are open: neither fires
        assert _bodies(c, "t", isolation="read_uncommitted") == []
        dropped.abort()
        kept.commit()
        wait_until(lambda: _bodies(c, "t") == [b"due, then committed"], 10, "the committed one delivered at its commit")
        wait_until(lambda: _bodies(c, "t") == [b"due, then committed", b"committed, due later"], 10,
                   "the one committed before its time delivered at its time")
        wait_until(lambda: c.status()["timer_pending"] == 0, 10, "the aborted one ended (dropped), not pending")
        assert _bodies(c, "t", isolation="read_uncommitted") == [b"due, then committed", b"committed, due later"]


def test_a_pull_never_reads_past_the_end_it_saw(spawn: Spawn) -> None:
    """The race the chaos run found: a pull reads the queue's end, a transaction's batch is published
    before the pull reads the entries; the entries stay bounded by that end (a failpoint holds the
    pull between the two for 400 ms)."""
    node = spawn("node", config=FAST, env={"TIDEMARK_FAILPOINTS": "reads_after_bounds=sleep:400"})
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(b"plain")])
        got: list[list[bytes]] = []
        reader = threading.Thread(target=lambda: got.append([m.body for m in c.pull("t", 0, 0)]))
        reader.start()
        time.sleep(0.1)  # the pull read end 1 and sleeps
        tx = c.begin_transaction("racer")
        tx.send("t", [Message(b"open")])
        reader.join(10)
        assert got == [[b"plain"]], "a read_committed pull returned an open transaction's message"
        tx.abort()


def test_what_a_commit_decided_is_read_at_once_while_the_views_lag(spawn: Spawn) -> None:
    """A begin and a commit are answered once durable, not once the transactions view applied them
    (issue 37's throughput): a read_committed pull, a pop, list_topics' stable offsets, describe
    and list that begin after the answer wait for the view instead (``store/decisions.py``). Each
    dispatcher round here sleeps 300 ms before it applies, so without that wait the pull finds the
    queue still held back and describe finds it open."""
    node = spawn("node", config=FAST, env={"TIDEMARK_FAILPOINTS": "views_before_apply=sleep:300"})
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        for i, one_call in ((0, False), (1, True), (2, False)):
            body = f"m{i}".encode()
            tx = c.begin_transaction("lag")
            if one_call:
                tx.send("t", [Message(body)], commit=True)
            else:
                tx.send("t", [Message(body)])
                assert [t["transactional_id"] for t in c.list_transactions()] == ["lag"]
                # the queue view holds the message: the pull's own read-your-writes wait is not taken
                assert _bodies(c, "t", isolation="read_uncommitted")[-1] == body
                assert body not in _bodies(c, "t")
                tx.commit()
            assert _bodies(c, "t")[-1] == body, "the commit's message is in the next read_committed pull"
            assert c.list_topics()["t"]["stable_offsets"] == [i + 1], "the LSO a Spark batch plans from"
            assert [m.body for m in c.pop("g", "t", max_messages=10, start="earliest")] == [body], \
                "a pop that does not wait leases it"
            assert c.describe_transaction("lag")["state"] == "committed"
            assert c.list_transactions() == []


def test_a_counted_commit_is_checked_against_the_log_and_its_sends_keep_their_ack(spawn: Spawn) -> None:
    """A counted transaction (count_messages, no check-back): its sends are answered at the ack they
    ask for, and a commit whose count the log does not hold aborts (reason "incomplete"); delayed
    messages count; an uncounted or check-back transaction's sends are answered as ack=replica."""
    port = free_port()
    node = spawn("node", config={**FAST, "node.metrics_listen": f"127.0.0.1:{port}"})
    stub = pb_grpc.BrokerStub(grpc.insecure_channel(node.address))

    def answered_as() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        return {m[0]: float(m[1]) for m in re.findall(r'^tidemark_send_seconds_count\{ack="(\w+)"\} (\S+)$', text, re.M)}

    def begin(tid: str, **kw: bool) -> pb.BeginTransactionResponse:
        return stub.BeginTransaction(pb.BeginTransactionRequest(transactional_id=tid, **kw))

    sequences: dict[int, int] = {}

    def send(pid: int, *bodies: bytes, deliver_at_ms: int = 0) -> None:
        """Idempotent plain messages (a counted transaction takes no other), queue 0."""
        first = sequences.get(pid, 0)
        sequences[pid] = first + len(bodies)
        stub.Send(pb.SendRequest(transaction=pid, ack=pb.ACK_LEADER, messages=[
            pb.PlainMessage(topic="t", queue_id=0, sequence=first + i, body=b, deliver_at_ms=deliver_at_ms)
            for i, b in enumerate(bodies)]))

    def end(tid: str, pid: int, sent: int) -> tuple[int, str]:
        r = stub.EndTransaction(pb.EndTransactionRequest(transactional_id=tid, producer_id=pid, commit=True,
                                                         messages_sent=sent))
        return r.outcome, r.reason

    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        short = begin("short", count_messages=True)
        assert short.counted
        before = answered_as()
        send(short.producer_id, b"s1", b"s2")
        assert answered_as().get("leader", 0) == before.get("leader", 0) + 1, "a counted send keeps its ack"
        with pytest.raises(grpc.RpcError) as exc:  # a retry stored twice could make up for a send lost
            stub.Send(pb.SendRequest(transaction=short.producer_id, messages=[pb.PlainMessage(topic="t", body=b"x")]))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "idempotent" in (exc.value.details() or "")
        assert end("short", short.producer_id, 3) == (pb.TRANSACTION_OUTCOME_ABORTED, "incomplete")
        assert end("short", short.producer_id, 2) == (pb.TRANSACTION_OUTCOME_ABORTED, "incomplete"), "first outcome"
        whole = begin("whole", count_messages=True)
        send(whole.producer_id, b"w1", b"w2")
        send(whole.producer_id, b"w3", deliver_at_ms=int(time.time() * 1000) + 600_000)
        assert end("whole", whole.producer_id, 3) == (pb.TRANSACTION_OUTCOME_COMMITTED, "client")
        assert _bodies(c, "t") == [b"w1", b"w2"]
        for tid, kw in (("plain", {}), ("checked", {"count_messages": True, "check_back": True})):
            t = begin(tid, **kw)
            assert not t.counted, "a check-back's commit has no count: its transaction is not counted"
            before = answered_as()
            send(t.producer_id, b"u")
            assert answered_as().get("replica", 0) == before.get("replica", 0) + 1, "upgraded to ack=replica"
            assert end(tid, t.producer_id, 0) == (pb.TRANSACTION_OUTCOME_COMMITTED, "client"), "not counted"
        assert _bodies(c, "t") == [b"w1", b"w2", b"u", b"u"]
        with c.transaction("client") as tx:  # our client counts for itself
            tx.send("t", [Message(b"c1"), Message(b"c2")])
            tx.send("t", [Message(b"c3")])
        assert tx.counted and tx.messages_sent == 3 and tx.state == "committed"
        assert _bodies(c, "t")[-3:] == [b"c1", b"c2", b"c3"]


def test_a_transaction_begins_with_its_first_send(node: DaemonProcess) -> None:
    """SendRequest.begin: the begin and the first batches in one call. A retried beginning send
    begins again and fences the first attempt's transaction; a refused one begins nothing; a
    transaction that sent nothing begins at its commit; an abort after a failed beginning send
    leaves nothing open."""
    stub = pb_grpc.BrokerStub(grpc.insecure_channel(node.address))
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        first = pb.SendRequest(ack=pb.ACK_LEADER, transaction=TXN_PID_BIT,
                               messages=[pb.PlainMessage(topic="t", queue_id=0, sequence=0, body=b"once")],
                               begin=pb.BeginTransactionRequest(transactional_id="r", count_messages=True))
        a, b = stub.Send(first).begun, stub.Send(first).begun  # the second: a retry whose first answer was lost
        assert a.counted and b.epoch == a.epoch + 1 and b.producer_id != a.producer_id
        wait_until(lambda: c.describe_transaction("r")["producer_id"] == f"{b.producer_id:#x}", 10,
                   "the view to apply the second begin (it applies what is confirmed)",
                   transient=lambda e: isinstance(e, BrokerError))
        with pytest.raises(grpc.RpcError) as exc:
            stub.EndTransaction(pb.EndTransactionRequest(transactional_id="r", producer_id=a.producer_id, commit=True,
                                                         messages_sent=1))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "fenced" in (exc.value.details() or "")
        ended = stub.EndTransaction(pb.EndTransactionRequest(transactional_id="r", producer_id=b.producer_id,
                                                             commit=True, messages_sent=1))
        assert ended.outcome == pb.TRANSACTION_OUTCOME_COMMITTED
        assert _bodies(c, "t") == [b"once"]
        with pytest.raises(grpc.RpcError) as exc:
            stub.Send(pb.SendRequest(messages=[pb.PlainMessage(topic="nowhere", body=b"x")],
                                     begin=pb.BeginTransactionRequest(transactional_id="n")))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as exc:
            stub.Send(pb.SendRequest(transaction=b.producer_id, messages=[pb.PlainMessage(topic="t", body=b"x")],
                                     begin=pb.BeginTransactionRequest(transactional_id="n")))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert c.list_transactions() == [], "a refused beginning send begins nothing"
        tx = c.begin_transaction("offsets-only")
        tx.commit_offsets("g", "t", {0: 1})
        tx.commit()
        assert tx.producer_id and c.committed_offset("g", "t", 0) == 1
        broken = c.begin_transaction("broken")
        with pytest.raises(BrokerError):
            broken.send("nowhere", [Message(b"x")])  # refused before anything is stored
        broken.abort()  # a definite refusal: nothing begun, nothing to end
        assert broken.state == "aborted" and c.list_transactions() == []
        with pytest.raises(BrokerError, match="no transaction"):
            c.describe_transaction("broken")


def test_a_send_can_carry_the_commit(node: DaemonProcess) -> None:
    """SendRequest.commit: the last send's batches and the decision in one call, answered once
    both are applied (readable at once). A count short of the log aborts it (incomplete); a retry
    of a committed call stores nothing and answers the first outcome; a refused one decides
    nothing; a commit that is not one, or names another transaction, is refused."""
    stub = pb_grpc.BrokerStub(grpc.insecure_channel(node.address))
    with BrokerClient(node.address) as c:
        c.create_topic("a", queues=2)
        c.create_topic("b", queues=1)
        tx = c.begin_transaction("two-topics")
        tx.send("a", [Message(b"a1", key="x"), Message(b"a2", key="y")])
        receipts = tx.send("b", [Message(b"b1")], commit=True)
        assert tx.state == "committed" and len(receipts) == 1 and receipts[0].queue_offset == 0
        assert _all_bodies(c, "a", 2) == {b"a1", b"a2"} and _bodies(c, "b") == [b"b1"]  # no wait: applied
        assert c.list_transactions() == []
        once = c.begin_transaction("one-call")
        once.send("b", [Message(b"b2"), Message(b"b3")], commit=True)  # begin, batches, commit: one call
        assert once.state == "committed" and once.producer_id and _bodies(c, "b") == [b"b1", b"b2", b"b3"]

        short = stub.Send(pb.SendRequest(
            ack=pb.ACK_LEADER, transaction=TXN_PID_BIT, messages=[pb.PlainMessage(topic="b", queue_id=0, sequence=0,
                                                                                   body=b"short")],
            begin=pb.BeginTransactionRequest(transactional_id="short", count_messages=True),
            commit=pb.EndTransactionRequest(transactional_id="short", commit=True, messages_sent=2)))
        assert short.ended.outcome == pb.TRANSACTION_OUTCOME_ABORTED and short.ended.reason == "incomplete"
        assert short.begun.producer_id and len(short.message_receipts) == 1
        assert _bodies(c, "b") == [b"b1", b"b2", b"b3"]

        pid = stub.Send(pb.SendRequest(ack=pb.ACK_LEADER, transaction=TXN_PID_BIT,
                                       messages=[pb.PlainMessage(topic="b", queue_id=0, sequence=0, body=b"r0")],
                                       begin=pb.BeginTransactionRequest(transactional_id="retry", count_messages=True))
                        ).begun.producer_id
        last = pb.SendRequest(ack=pb.ACK_LEADER, transaction=pid,
                              messages=[pb.PlainMessage(topic="b", queue_id=0, sequence=1, body=b"r1")],
                              commit=pb.EndTransactionRequest(transactional_id="retry", producer_id=pid, commit=True,
                                                              messages_sent=2))
        first, again = stub.Send(last), stub.Send(last)  # the second: a retry whose first answer was lost
        assert first.ended.outcome == again.ended.outcome == pb.TRANSACTION_OUTCOME_COMMITTED
        assert len(first.message_receipts) == 1 and not again.message_receipts
        assert _bodies(c, "b")[3:] == [b"r0", b"r1"], "the retry stored nothing"

        open_tx = c.begin_transaction("refused")
        open_tx.send("b", [Message(b"kept")])
        with pytest.raises(BrokerError) as refused:
            open_tx.send("nowhere", [Message(b"x")], commit=True)
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
        wait_until(lambda: [t["transactional_id"] for t in c.list_transactions()] == ["refused"], 10,
                   "the view to apply the begin (it applies what is confirmed): a refused send decides nothing")
        open_tx.abort()
        assert open_tx.state == "aborted" and b"kept" not in _bodies(c, "b", isolation="read_committed")

        opened = stub.Send(pb.SendRequest(ack=pb.ACK_LEADER, transaction=TXN_PID_BIT,
                                          messages=[pb.PlainMessage(topic="b", queue_id=0, sequence=0, body=b"z")],
                                          begin=pb.BeginTransactionRequest(transactional_id="bad", count_messages=True))
                           ).begun.producer_id
        for commit, transaction in ((pb.EndTransactionRequest(transactional_id="bad", producer_id=opened), opened),
                                    (pb.EndTransactionRequest(transactional_id="bad", producer_id=opened, commit=True,
                                                              offsets=[pb.CommittedOffset(group="g", topic="b")]),
                                     opened),
                                    (pb.EndTransactionRequest(transactional_id="bad", producer_id=opened + 1,
                                                              commit=True), opened),
                                    (pb.EndTransactionRequest(transactional_id="bad", commit=True), 0)):
            with pytest.raises(grpc.RpcError) as exc:
                stub.Send(pb.SendRequest(transaction=transaction, commit=commit,
                                         messages=[pb.PlainMessage(topic="b", queue_id=0, sequence=1, body=b"z")]))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, commit
        with pytest.raises(grpc.RpcError) as exc:  # refused by the append: nothing stored, nothing decided
            stub.Send(pb.SendRequest(transaction=opened, messages=[pb.PlainMessage(topic="nowhere", body=b"z")],
                                     commit=pb.EndTransactionRequest(transactional_id="bad", producer_id=opened,
                                                                     commit=True, messages_sent=2)))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        wait_until(lambda: [t["transactional_id"] for t in c.list_transactions()] == ["bad"], 10, "'bad' still open")

        with_offsets = c.begin_transaction("with-offsets")
        with_offsets.commit_offsets("g", "b", {0: 2})
        with_offsets.send("b", [Message(b"o")], commit=True)  # a send, then EndTransaction with the offsets
        assert with_offsets.state == "committed" and c.committed_offset("g", "b", 0) == 2


def test_a_retried_beginning_call_joins_what_its_first_attempt_began(node: DaemonProcess) -> None:
    """BeginTransactionRequest.begin_id: a retry of the call that began a transaction joins it (no
    fence, its batches found again by their sequences); once it has ended, a retried beginning
    send that does not commit is refused and stores nothing. Without a begin id a retry begins
    again (test_a_transaction_begins_with_its_first_send)."""
    stub = pb_grpc.BrokerStub(grpc.insecure_channel(node.address))
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        first = pb.SendRequest(ack=pb.ACK_LEADER, transaction=TXN_PID_BIT,
                               messages=[pb.PlainMessage(topic="t", queue_id=0, sequence=0, body=b"j")],
                               begin=pb.BeginTransactionRequest(transactional_id="j", count_messages=True, begin_id=5))
        a, b = stub.Send(first), stub.Send(first)
        assert a.begun.producer_id == b.begun.producer_id and a.begun.epoch == b.begun.epoch == 1
        assert b.message_receipts[0].duplicate and b.message_receipts[0].queue_offset == a.message_receipts[0].queue_offset
        pid = a.begun.producer_id
        again = stub.BeginTransaction(first.begin)  # a BeginTransaction with the same id joins it too
        assert again.producer_id == pid
        ended = stub.EndTransaction(pb.EndTransactionRequest(transactional_id="j", producer_id=pid, commit=True,
                                                             messages_sent=1))
        assert ended.outcome == pb.TRANSACTION_OUTCOME_COMMITTED and _bodies(c, "t") == [b"j"]
        with pytest.raises(grpc.RpcError) as exc:
            stub.Send(first)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not open" in (exc.value.details() or "")
        assert stub.BeginTransaction(first.begin).producer_id == pid, "answers the id it began"
        newer = pb.BeginTransactionRequest(transactional_id="j", count_messages=True, begin_id=6)
        fresh = stub.BeginTransaction(newer)
        assert fresh.producer_id != pid and fresh.epoch == 2
        stub.EndTransaction(pb.EndTransactionRequest(transactional_id="j", producer_id=fresh.producer_id))
        assert _bodies(c, "t", isolation="read_uncommitted") == [b"j"], "the refused retry stored nothing"
