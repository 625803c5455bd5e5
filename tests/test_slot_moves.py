"""Moving a group slot between shards (docs/shards.md "Moving a group slot"): its groups' committed
offsets go to the new coordinator, members follow, commits meanwhile are retried, never lost or
put back; a transaction open on the slot delays the hand-over; a drain moves slots too, so a
drained shard can be removed. Real daemons, a real etcd."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import grpc
import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, DeadlineExceeded, Message
from broker.group_slots import slot_of
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.failoverutil import Spawn, sent_once_placed, wait_master
from tests.moveutil import shard_node
from tests.test_shards import CLUSTER, _etcd_get
from tests.waits import wait_until


def _coordinator(etcd: EtcdProcess, slot: int) -> dict[str, str]:
    return dict(json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/slots/{slot}") or b"{}"))


def _two_shards(spawn: Spawn, etcd: EtcdProcess, env_s1: dict[str, str] | None = None) -> dict[str, object]:
    return {"s1": shard_node(spawn, etcd, "s1", "a", env=env_s1), "s2": shard_node(spawn, etcd, "s2", "b")}


def _topic(c: BrokerClient, name: str, queues: int) -> None:
    c.create_topic(name, queues=queues)
    wait_until(lambda: sent_once_placed(c, name, [Message(f"m{k}".encode(), key=f"k{k}") for k in range(40)]), 30,
               f"{name} writable on both shards")


def test_a_slot_moves_with_its_offsets_and_a_consumer_follows(spawn: Spawn, etcd: EtcdProcess) -> None:
    nodes = _two_shards(spawn, etcd)
    with BrokerClient([n.address for n in nodes.values()]) as c:  # type: ignore[attr-defined]
        _topic(c, "t", 4)
        ends = {q: c.describe_topic("t")["queues"][q]["max_offset"] for q in range(4)}
        c.commit_offsets("gm", {("t", q): 1 + q for q in range(4)})
        slot = slot_of("gm")
        source = _coordinator(etcd, slot)["shard"]
        target = "s2" if source == "s1" else "s1"
        consumed: list[bytes] = []
        with c.consumer("gm", ["t"], auto_offset_reset="earliest", session_timeout_ms=6000) as member:
            wait_until(lambda: consumed.extend(m.body for m in member.poll(0.2)) or len(consumed) >= 10, 20,
                       "the member consumes from its committed offsets")
            member.commit()
            assert c.move_slot(slot, target, timeout_ms=30_000) == target
            assert _coordinator(etcd, slot) == {"shard": target, "v": 1}
            c.send("t", [Message(f"after{k}".encode(), key=f"k{k}") for k in range(8)], ack="replica")
            total = sum(ends.values()) - sum(1 + q for q in range(4)) + 8

            def drained() -> bool:
                consumed.extend(m.body for m in member.poll(0.2))
                member.commit()
                return len(consumed) >= total
            wait_until(drained, 40, "the member, rejoined at the new coordinator, consumes the rest")
        member_total = len(consumed)
        assert member_total == total, f"each message once across the move: {member_total} consumed, {total} sent"
        final = c.describe_topic("t")["queues"]
        assert [c.committed_offset("gm", "t", q) for q in range(4)] == [final[q]["max_offset"] for q in range(4)]
        assert c.describe_group("gm")["shard"] == target
        listed = [g for g in c.list_groups() if g["name"] == "gm"]
        assert [(g["lag"], g["topics"]) for g in listed] == [(0, ["t"])], "listed once, by its new coordinator only"
        assert c.move_slot(slot, target) == target, "moving it where it is: nothing to do"


def test_commits_during_the_hand_over_are_retried_and_kept(spawn: Spawn, etcd: EtcdProcess) -> None:
    """The source pauses 3 s after the import: a commit meanwhile is refused UNAVAILABLE (moving) by
    the source, retried by the client, and lands on the target after the switch; the import never
    puts an older offset back."""
    nodes = _two_shards(spawn, etcd, env_s1={"TIDEMARK_FAILPOINTS": "slot_after_import=sleep:3000"})
    with BrokerClient([n.address for n in nodes.values()]) as c:  # type: ignore[attr-defined]
        _topic(c, "t", 2)
        group = next(g for g in (f"g{i}" for i in range(1000)) if _slot_free_on(etcd, slot_of(g)))
        c.move_slot(slot_of(group), "s1")  # a slot with no shard yet: given to s1 at once
        c.commit_offsets(group, {("t", 0): 2, ("t", 1): 3})
        slot = slot_of(group)
        mover = BrokerClient(nodes["s2"].address)  # type: ignore[attr-defined]
        moved: list[str] = []
        thread = threading.Thread(target=lambda: moved.append(mover.move_slot(slot, "s2", timeout_ms=30_000)))
        thread.start()
        wait_until(lambda: _coordinator(etcd, slot).get("to") == "s2", 10, "the slot marked moving")
        refusal = wait_until(lambda: _commit_refused(nodes["s1"], group), 10, "s1 refuses commits of the slot")
        assert refusal.code() == grpc.StatusCode.UNAVAILABLE
        assert ("tidemark-retry", "moving") in tuple(refusal.trailing_metadata() or ())
        started = time.monotonic()
        c.commit_offsets(group, {("t", 0): 6})  # retried until the slot is on s2
        assert time.monotonic() - started > 0.5, "it waited for the move"
        thread.join(30)
        mover.close()
        assert moved == ["s2"]
        assert c.committed_offset(group, "t", 0) == 6 and c.committed_offset(group, "t", 1) == 3
        nodes["s1"].kill9()  # type: ignore[attr-defined]
        assert c.committed_offset(group, "t", 0) == 6, "the offsets are in s2's log"


def _commit_refused(node: object, group: str) -> grpc.RpcError | None:
    """A commit straight to ``node``: its refusal, None while it takes it (before its copy shows the move)."""
    with grpc.insecure_channel(node.address) as ch:  # type: ignore[attr-defined]
        try:
            pb_grpc.BrokerStub(ch).CommitOffset(pb.CommitOffsetRequest(offsets=[
                pb.CommittedOffset(group=group, topic="t", queue_id=0, offset=5)]), timeout=10)
        except grpc.RpcError as exc:
            return exc
    return None


def _slot_free_on(etcd: EtcdProcess, slot: int) -> bool:
    return _etcd_get(etcd, f"/tidemark/{CLUSTER}/slots/{slot}") is None


def test_an_open_transaction_delays_the_hand_over_and_commits(spawn: Spawn, etcd: EtcdProcess) -> None:
    nodes = _two_shards(spawn, etcd)
    with BrokerClient([n.address for n in nodes.values()]) as c:  # type: ignore[attr-defined]
        _topic(c, "t", 2)
        tid = next(g for g in (f"tx{i}" for i in range(1000)) if _slot_free_on(etcd, slot_of(g)))
        slot = slot_of(tid)
        c.move_slot(slot, "s1")
        tx = c.begin_transaction(tid)
        tx.send("t", [Message(b"in-tx", key="k1")])
        with pytest.raises(DeadlineExceeded):
            c.move_slot(slot, "s2", timeout_ms=1500)  # the transaction is open: the move waits
        assert _coordinator(etcd, slot) == {"shard": "s1", "to": "s2", "v": 1}
        with grpc.insecure_channel(nodes["s1"].address) as ch, \
                pytest.raises(grpc.RpcError) as refused:  # type: ignore[attr-defined]  # nothing new begins on it
            pb_grpc.BrokerStub(ch).BeginTransaction(pb.BeginTransactionRequest(transactional_id=tid), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        assert c.move_slot(slot, "s1") == "s1", "called off: moved to its own shard"
        assert _coordinator(etcd, slot) == {"shard": "s1", "v": 1}
        c.commit_offsets(tid, {("t", 0): 1})  # the source takes its commits again (the id as a group: same slot)
        with pytest.raises(DeadlineExceeded):
            c.move_slot(slot, "s2", timeout_ms=1000)  # asked again: still waiting for the transaction
        tx.commit_offsets(tid, "t", {1: 1})  # a transaction the move waits for: its offsets are let in, and go along
        tx.commit()
        shown = subprocess.run([sys.executable, "-m", "broker.cli", "cluster", "move-slot", "--group", tid, "--to", "s2",
                                "--broker", nodes["s2"].address], capture_output=True, text=True, timeout=60,  # type: ignore[attr-defined]
                               check=False)
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout) == {"moved": {"slot": slot, "to": "s2"}}
        assert _coordinator(etcd, slot) == {"shard": "s2", "v": 1}
        assert c.committed_offset(tid, "t", 0) == 1 and c.committed_offset(tid, "t", 1) == 1
        again = c.begin_transaction(tid)  # begun on the new coordinator
        again.send("t", [Message(b"second", key="k1")])
        again.commit()
        bodies = [m.body for q in range(2) for r in c.iter_pull("t", q, 0) for m in r]
        assert bodies.count(b"in-tx") == 1 and bodies.count(b"second") == 1


def test_a_drain_moves_the_shards_slots_so_it_can_be_removed(spawn: Spawn, etcd: EtcdProcess) -> None:
    nodes = _two_shards(spawn, etcd)
    with BrokerClient([n.address for n in nodes.values()]) as c:  # type: ignore[attr-defined]
        _topic(c, "t", 4)
        groups = [f"grp{i}" for i in range(12)]
        ends = [q["max_offset"] for q in c.describe_topic("t")["queues"]]
        want = {g: [min(i + q, ends[q]) for q in range(4)] for i, g in enumerate(groups)}
        for g in groups:
            c.commit_offsets(g, {("t", q): o for q, o in enumerate(want[g])})
        on_s1 = [g for g in groups if _coordinator(etcd, slot_of(g))["shard"] == "s1"]
        assert on_s1, "some groups coordinated by s1"
        done = c.rebalance(drain="s1")
        assert [m["error"] for m in done] == [""] * len(done)
        assert len([m for m in done if not m["topic"]]) == len({slot_of(g) for g in on_s1}), "each slot of s1 moved"
        s1 = wait_until(lambda: next(s for s in c.cluster_status()["shards"] if s["shard"] == "s1"), 10,
                        "s1 drained as the asked node's copy shows it", accept=lambda s: s["drained"])
        assert s1["slots"] == 0 and s1["queues"] == 0
        nodes["s1"].kill9()  # type: ignore[attr-defined]
        for g in groups:
            assert [c.committed_offset(g, "t", q) for q in range(4)] == want[g], g
        wait_master([nodes["s2"]])  # type: ignore[list-item]
        c.commit_offsets(on_s1[0], {("t", 0): 1})
        assert c.committed_offset(on_s1[0], "t", 0) == 1


def test_a_source_master_killed_mid_hand_over_finishes_it_after_restart(spawn: Spawn, etcd: EtcdProcess) -> None:
    """kill -9 of the source's master after the import, before the switch: its next term reads the
    offsets again, imports them again (the same values) and switches; nothing committed is lost."""
    nodes = _two_shards(spawn, etcd, env_s1={"TIDEMARK_FAILPOINTS": "slot_after_import=exit"})
    with BrokerClient([n.address for n in nodes.values()]) as c:  # type: ignore[attr-defined]
        _topic(c, "t", 2)
        group = next(g for g in (f"k{i}" for i in range(1000)) if _slot_free_on(etcd, slot_of(g)))
        slot = slot_of(group)
        c.move_slot(slot, "s1")
        c.commit_offsets(group, {("t", 0): 2, ("t", 1): 1})
        with pytest.raises(DeadlineExceeded):
            c.move_slot(slot, "s2", timeout_ms=3000)
        s1 = nodes["s1"]
        assert s1.wait_exit(10) is not None, "killed at slot_after_import"  # type: ignore[attr-defined]
        assert _coordinator(etcd, slot) == {"shard": "s1", "to": "s2", "v": 1}, "not switched before the kill"
        s1.env.pop("TIDEMARK_FAILPOINTS")  # type: ignore[attr-defined]
        s1.start()  # type: ignore[attr-defined]
        wait_master([s1])  # type: ignore[list-item]
        assert c.move_slot(slot, "s2", timeout_ms=30_000) == "s2"
        assert [c.committed_offset(group, "t", q) for q in range(2)] == [2, 1]
        c.commit_offsets(group, {("t", 0): 3})
        assert c.committed_offset(group, "t", 0) == 3
