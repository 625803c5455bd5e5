"""Transactions across shards (DESIGN §14-15, docs/shards.md "Transactions across shards"), on
real daemons and a real etcd: a transaction over queues of three shards is all or nothing on
every shard, read_committed readers of every shard agree; an abort reaches every participant; a
newer instance fences the older; kill -9 of the coordinator's master after its decision (every
participant ends committed) and of a participant's master when the decision reaches it (it ends
committed after its failover)."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, FailedPrecondition, Message, TransactionAborted
from broker.client.sharded_txn import ShardedTransaction
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from replication.coordination import slots
from tests.failoverutil import Spawn, coordinated, in_sync, status, wait_master
from tests.procs import DaemonProcess
from tests.test_shards import CLUSTER, _etcd_get, _single
from tests.waits import wait_until

SHARDS = ("s1", "s2", "s3")
QUEUES = 6  # two per shard


def _committed(c: BrokerClient, topic: str, queues: int = QUEUES) -> list[bytes]:
    """Every message a read_committed reader sees, over every queue (each pulled from its shard)."""
    out: list[bytes] = []
    for q in range(queues):
        out.extend(m.body for m in c.pull(topic, q, 0, max_messages=10_000))
    return sorted(out)


def _owners(c: BrokerClient, topic: str) -> list[str]:
    return [q["shard"] for q in c.describe_topic(topic)["queues"]]


def _keyed_to_every_queue(c: BrokerClient, topic: str, tag: str) -> list[Message]:
    """One message for each queue (a key that maps there), so every shard is a participant."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < QUEUES:
        key = f"k{i}"
        found.setdefault(c.pick_queue(topic, key), key)
        i += 1
    return [Message(f"{tag}:{q}".encode(), key=k) for q, k in sorted(found.items())]


def _coordinator(etcd: EtcdProcess, tid: str) -> str:
    return str(json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/slots/{slots.slot_of(tid)}") or b"{}").get("shard"))


@pytest.fixture
def singles(spawn: Spawn, etcd: EtcdProcess) -> dict[str, DaemonProcess]:
    return {s: _single(spawn, etcd, s, f"n{s}") for s in SHARDS}


def test_a_transaction_over_three_shards_is_all_or_nothing(singles: dict[str, DaemonProcess],
                                                           etcd: EtcdProcess) -> None:
    with BrokerClient(singles["s1"].address) as c, BrokerClient(singles["s3"].address) as other:
        c.create_topic("orders", queues=QUEUES)
        assert sorted(_owners(c, "orders")) == sorted(SHARDS * 2)
        with c.transaction("tx-1") as tx:
            assert isinstance(tx, ShardedTransaction)
            tx.send("orders", _keyed_to_every_queue(c, "orders", "a"))
            assert len(tx.send("orders", [])) == 0, "an empty send sends nothing"
            assert _committed(other, "orders") == [], "nothing visible before the commit"
        assert tx.state == "committed"
        want = sorted(m.body for m in _keyed_to_every_queue(c, "orders", "a"))
        assert _committed(other, "orders") == want, "every shard's reader sees every message once committed"
        assert tx.coordinator == _coordinator(etcd, "tx-1")
        described = c.describe_transaction("tx-1")  # routed to the coordinator
        assert described["state"] == "committed"

        tx2 = c.begin_transaction("tx-1")
        tx2.send("orders", _keyed_to_every_queue(c, "orders", "b"))
        listed = other.list_transactions()
        assert sorted(t["shard"] for t in listed) == list(SHARDS), "open on every shard it spans, listed from any node"
        tx2.abort()
        assert tx2.state == "aborted"
        wait_until(lambda: not other.list_transactions(), 10, "the abort reached every participant: nothing open")
        assert _committed(other, "orders") == want, "nothing of the aborted one is visible on any shard"
        c.send("orders", [Message(b"after", key="k0")])
        assert len(_committed(other, "orders")) == len(want) + 1, "readers move past the aborted range"


def test_a_newer_instance_fences_the_older_on_every_shard(singles: dict[str, DaemonProcess]) -> None:
    with BrokerClient(singles["s2"].address) as c:
        c.create_topic("orders", queues=QUEUES)
        old = c.begin_transaction("tx-f")
        old.send("orders", _keyed_to_every_queue(c, "orders", "old"))
        new = c.begin_transaction("tx-f", fence=True)
        with pytest.raises(Exception):  # noqa: B017 - fenced: refused (not open) or aborted
            old.commit()
        new.send("orders", _keyed_to_every_queue(c, "orders", "new"))
        new.commit()
        got = _committed(c, "orders")
        assert got == sorted(m.body for m in _keyed_to_every_queue(c, "orders", "new")), "only the newer one"


def test_an_operators_abort_from_any_node_reaches_every_participant(singles: dict[str, DaemonProcess]) -> None:
    with BrokerClient(singles["s1"].address) as c, BrokerClient(singles["s2"].address) as operator:
        c.create_topic("orders", queues=QUEUES)
        tx = c.begin_transaction("tx-op")
        tx.send("orders", _keyed_to_every_queue(c, "orders", "o"))
        assert operator.describe_transaction("tx-op")["state"] == "open"
        assert operator.abort_transaction("tx-op")["state"] == "aborted"
        wait_until(lambda: not operator.list_transactions(), 10, "the abort reached every participant")
        with pytest.raises(TransactionAborted):
            tx.commit()
        assert _committed(c, "orders") == []


def test_a_late_participant_of_a_fenced_instance_never_fences_the_newer_one(singles: dict[str, DaemonProcess]) -> None:
    """A zombie (an older instance of the id, fenced on the coordinator) whose first send to a
    shard arrives after the newer instance's: refused there, the newer one's participant stays."""
    with BrokerClient(singles["s1"].address) as c:
        c.create_topic("orders", queues=QUEUES)
        old = c.begin_transaction("tx-z", fence=True)
        assert isinstance(old, ShardedTransaction)
        owners = _owners(c, "orders")
        messages = _keyed_to_every_queue(c, "orders", "new")
        late_shard = next(s for s in SHARDS if s != old.coordinator)
        late = [Message(b"zombie", key=m.key) for m in messages if owners[c.pick_queue("orders", m.key)] == late_shard]
        new = c.begin_transaction("tx-z", fence=True)
        new.send("orders", messages)
        with pytest.raises(FailedPrecondition, match="fenced"):
            old.send("orders", late)  # its participant's begin there: epoch 1 after epoch 2
        new.commit()
        assert _committed(c, "orders") == sorted(m.body for m in messages), "the newer instance whole, no zombie"


def test_a_participant_missing_messages_aborts_the_whole(singles: dict[str, DaemonProcess]) -> None:
    """A participant whose log lacks a counted message cannot prepare: the coordinator aborts."""
    with BrokerClient(singles["s1"].address) as c:
        c.create_topic("orders", queues=QUEUES)
        tx = c.begin_transaction("tx-short")
        assert isinstance(tx, ShardedTransaction)
        tx.send("orders", _keyed_to_every_queue(c, "orders", "x"))
        other = next(s for s in tx._parts if s != tx.coordinator)
        tx._parts[other].messages_sent += 1  # as if an answered send had been lost with a failed master
        with pytest.raises(TransactionAborted):
            tx.commit()
        wait_until(lambda: not c.list_transactions(), 10, "every participant ended")
        assert _committed(c, "orders") == []


def test_consumer_offsets_commit_with_the_transaction_on_the_groups_shard(singles: dict[str, DaemonProcess],
                                                                         etcd: EtcdProcess) -> None:
    """Consume-transform-produce over shards: the offsets of a group coordinated by another shard
    than the transaction's commit with it (that shard becomes a participant) or not at all."""
    with BrokerClient(singles["s1"].address) as c:
        c.create_topics({"in": QUEUES, "out": QUEUES})
        tx = c.begin_transaction("tx-o", fence=True)
        assert isinstance(tx, ShardedTransaction)
        group = next(g for g in (f"g{i}" for i in range(64))
                     if c.committed_offset(g, "in", 0) is None and _coordinator(etcd, g) != tx.coordinator)
        c.send("in", [Message(f"in-{q}".encode(), key=m.key) for q, m in enumerate(_keyed_to_every_queue(c, "in", "x"))])
        tx.send("out", [Message(b"out-1", key="k1")])
        tx.commit_offsets(group, "in", {0: 1, 1: 1})
        tx.abort()
        assert [c.committed_offset(group, "in", q) for q in (0, 1)] == [None, None], "aborted: no offset moved"

        tx = c.begin_transaction("tx-o")
        tx.send("out", [Message(b"out-2", key="k1")])
        tx.commit_offsets(group, "in", {0: 1, 1: 1})
        tx.commit()
        assert [c.committed_offset(group, "in", q) for q in (0, 1)] == [1, 1], "committed with the transaction"
        assert _committed(c, "out") == [b"out-2"]
        assert isinstance(tx, ShardedTransaction) and len(tx._parts) >= 2, "the group's shard was a participant"


def test_delayed_messages_fire_on_their_shards_once_the_transaction_commits(singles: dict[str, DaemonProcess]) -> None:
    """Timer messages of a transaction over shards are scheduled by each shard when the decision
    reaches it: an aborted one's never fire, a committed one's fire once, not before their time."""
    with BrokerClient(singles["s3"].address) as c:
        c.create_topic("later", queues=QUEUES)
        at_ms = int(time.time() * 1000) + 1500
        aborted = c.begin_transaction("tx-t")
        aborted.send("later", [Message(b"never" + m.body, key=m.key, deliver_at_ms=at_ms)
                               for m in _keyed_to_every_queue(c, "later", "")])
        aborted.abort()
        with c.transaction("tx-t") as tx:
            tx.send("later", [Message(m.body, key=m.key, deliver_at_ms=at_ms)
                              for m in _keyed_to_every_queue(c, "later", "t")])
        assert _committed(c, "later", QUEUES) == [], "not before their time"
        want = sorted(m.body for m in _keyed_to_every_queue(c, "later", "t"))
        wait_until(lambda: _committed(c, "later") == want, 20, "each fired on its own shard")
        assert time.time() * 1000 >= at_ms
        time.sleep(1.0)
        assert _committed(c, "later") == want, "once each, and none of the aborted transaction's"


def test_a_participant_down_holds_up_only_itself_and_gets_the_decision_on_restart(
        singles: dict[str, DaemonProcess]) -> None:
    """One participant (a single node) dies as the commit decision reaches it: the other
    participant gets the decision all the same (its part visible), and the dead one, restarted,
    recovers its prepared transaction from its log and ends committed when the decision is
    delivered again."""
    with BrokerClient(singles["s1"].address) as c:
        c.create_topic("orders", queues=QUEUES)
        tx = c.begin_transaction("tx-down", fence=True)
        assert isinstance(tx, ShardedTransaction)
        dying = next(s for s in SHARDS if s != tx.coordinator)
        node = singles[dying]
        node.kill9()
        node.env = {"TIDEMARK_FAILPOINTS": "txn_before_decide=exit"}
        node.start()
        wait_master([node])
        messages = _keyed_to_every_queue(c, "orders", "d")
        tx.send("orders", messages)
        tx.commit()
        node.wait_exit(10)  # died at the failpoint, its part prepared
        owners = _owners(c, "orders")
        theirs = sorted(m.body for m in messages if owners[c.pick_queue("orders", m.key)] != dying)
        wait_until(lambda: sorted(b for q in range(QUEUES) if owners[q] != dying
                                  for b in (m.body for m in c.pull("orders", q, 0))) == theirs, 10,
                   "the living participant and the coordinator have it while the other is down")
        node.env = {}
        node.start()
        wait_master([node])
        wait_until(lambda: _all_committed(c, sorted(m.body for m in messages)), 30,
                   "the restarted participant recovered its prepared transaction and got the decision")
        assert c.list_transactions() == []


def test_one_pair_transaction_calls_are_refused_over_shards(singles: dict[str, DaemonProcess]) -> None:
    """A raw client following the one-pair protocol cannot begin or commit a transaction by its
    send in a cluster of shards, nor end a participant transaction, nor register a bogus participant."""
    with BrokerClient(singles["s1"].address) as c:
        c.create_topic("orders", queues=QUEUES)
        tx = c.begin_transaction("tx-raw")
        tx.send("orders", _keyed_to_every_queue(c, "orders", "r"))
        assert isinstance(tx, ShardedTransaction)
        participant = next(s for s in tx._parts if s != tx.coordinator)
        with grpc.insecure_channel(singles[participant].address) as ch:
            stub = pb_grpc.BrokerStub(ch)
            begin = pb.BeginTransactionRequest(transactional_id="tx-raw", count_messages=True)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Send(pb.SendRequest(begin=begin, transaction=1 << 63, messages=[
                    pb.PlainMessage(topic="orders", queue_id=0, body=b"x")]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.RpcError) as refused:
                stub.EndTransaction(pb.EndTransactionRequest(transactional_id="tx-raw",
                                                             producer_id=tx._parts[participant].pid, commit=True,
                                                             messages_sent=2), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, "only its coordinator ends it"
        with grpc.insecure_channel(singles[tx.coordinator].address) as ch:
            stub = pb_grpc.BrokerStub(ch)
            bogus = pb.TransactionParticipant(shard=tx.coordinator, producer_id=(1 << 63) | 5)
            with pytest.raises(grpc.RpcError) as refused:
                stub.AddTransactionParticipant(pb.AddTransactionParticipantRequest(
                    transactional_id="tx-raw", producer_id=tx.producer_id, participant=bogus), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            unregistered = pb.TransactionParticipant(shard=participant, producer_id=(1 << 63) | 7, messages_sent=0)
            with pytest.raises(grpc.RpcError) as refused:
                stub.EndTransaction(pb.EndTransactionRequest(
                    transactional_id="tx-raw", producer_id=tx.producer_id, commit=True, participants=[unregistered]),
                    timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, "not its registered participants"
        tx.commit()
        assert len(_committed(c, "orders")) == QUEUES, "the refusals changed nothing"


def _pairs_armed(spawn: Spawn, etcd: EtcdProcess, failpoint: str) -> dict[str, tuple[DaemonProcess, DaemonProcess]]:
    """Three pairs whose first masters carry ``failpoint`` (their slaves, promoted, do not)."""
    settled: dict[str, tuple[DaemonProcess, DaemonProcess]] = {}
    for i, shard in enumerate(SHARDS):
        config = coordinated(etcd.endpoint, **{"coordinator.cluster": CLUSTER, "coordinator.shard": shard})
        master = spawn(f"a{i}", config=config, env={"TIDEMARK_FAILPOINTS": f"{failpoint}=exit"})
        wait_master([master])
        slave = spawn(f"b{i}", config=config)
        wait_until(lambda m=master, s=slave: in_sync(m, s), 30, "the slave in sync")  # type: ignore[misc]
        settled[shard] = (master, slave)
    return settled


def _all_committed(c: BrokerClient, want: list[bytes]) -> bool:
    try:
        return _committed(c, "orders") == want
    except Exception:  # a shard failing over
        return False


def test_the_coordinators_master_killed_after_its_decision(spawn: Spawn, etcd: EtcdProcess) -> None:
    """kill -9 (a failpoint) of the coordinator shard's master right after its commit decision is
    replicated, before any participant has it: its promoted slave delivers the decision, every
    participant ends committed, and the producer's retried commit answers committed."""
    settled = _pairs_armed(spawn, etcd, "txn_after_global_decision")
    with BrokerClient([settled["s1"][0].address, settled["s2"][1].address]) as c:
        c.create_topic("orders", queues=QUEUES)
        messages = _keyed_to_every_queue(c, "orders", "c")
        tx = c.begin_transaction("tx-crash-c", fence=True)
        assert isinstance(tx, ShardedTransaction)
        master, slave = settled[tx.coordinator]
        tx.send("orders", messages, ack="replica")
        tx.commit()  # the master dies at its decision; the call is retried on the promoted slave
        assert tx.state == "committed"
        master.wait_exit(10)  # the coordinator's master died at the failpoint
        assert status(slave)["role"] == "master"
        wait_until(lambda: _all_committed(c, sorted(m.body for m in messages)), 30,
                   "every participant ends committed")
        wait_until(lambda: not c.list_transactions(), 20, "nothing left open on any shard")


def test_a_participants_master_killed_when_the_decision_reaches_it(spawn: Spawn, etcd: EtcdProcess) -> None:
    """kill -9 (a failpoint) of each participant's master as the commit decision reaches it: the
    coordinator retries the delivery on the promoted slaves, which end committed."""
    settled = _pairs_armed(spawn, etcd, "txn_before_decide")
    with BrokerClient([settled["s3"][0].address]) as c:
        c.create_topic("orders", queues=QUEUES)
        messages = _keyed_to_every_queue(c, "orders", "p")
        with c.transaction("tx-crash-p") as tx:
            tx.send("orders", messages)
        assert tx.state == "committed"
        assert isinstance(tx, ShardedTransaction)
        for shard, (master, slave) in settled.items():
            if shard != tx.coordinator:
                master.wait_exit(20)  # it died as the decision reached it
                wait_master([slave], 30)
        wait_until(lambda: _all_committed(c, sorted(m.body for m in messages)), 40,
                   "every participant ends committed after its failover")
