"""Consumer groups across shards (DESIGN §15, docs/shards.md "Groups across shards"), on real
daemons and a real etcd: a group's coordinator is its slot's shard; members bootstrapped from
nodes of different shards share the topic's queues of every shard, never one queue twice; commits,
describe, lag and resets work from any node; a coordinator holding none of a topic's queues keeps
its commits; pop leases and dead letters stay with each queue's shard; the group survives a kill
-9 of its coordinator's master."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, Consumer, Message
from broker.errors import OWNER_SHARD_KEY
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from replication.coordination import slots
from tests.failoverutil import Spawn, coordinated, sent_once_placed, status, wait_master
from tests.test_shards import CLUSTER, _etcd_get, _pair, _settled, _single
from tests.waits import wait_until

KEYS = [f"k{i}" for i in range(64)]


def _placed(c: BrokerClient, topic: str, queues: int) -> list[str]:
    c.create_topic(topic, queues=queues)
    wait_until(lambda: sent_once_placed(c, topic, [Message(b"probe", key=k) for k in KEYS]), 15, "every queue created")
    return [q["shard"] for q in c.describe_topic(topic)["queues"]]


def _drain(consumers: list[Consumer], want: int, timeout_s: float = 30) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        for m in consumers:
            got += [msg.body for msg in m.poll(100)]
    return got


def _assignments_settled(consumers: list[Consumer], queues: int) -> bool:
    held = [m.assignment for m in consumers]
    return all(held) and sum(len(h) for h in held) == queues and len(set().union(*held)) == queues


def _settle(members: list[Consumer], queues: int, what: str) -> list[bytes]:
    """Wait until ``members`` share the ``queues``, polling meanwhile (a member gives up queues in
    its poll: one that is never polled keeps them); what they read while settling."""
    early: list[bytes] = []

    def settled() -> bool:
        for m in members:
            early.extend(msg.body for msg in m.poll(0))
        return _assignments_settled(members, queues)

    wait_until(settled, 20, what, observe=lambda: [m.assignment for m in members])
    return early


def test_a_group_spans_the_shards_and_is_seen_from_any_node(spawn: Spawn, etcd: EtcdProcess) -> None:
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s2"].address) as c2, BrokerClient(nodes["s1"].address) as c1:
        owners = _placed(c2, "orders", 8)
        assert sorted(set(owners)) == ["s1", "s2"]
        c2.send("orders", [Message(f"{k}:{n}".encode(), key=k) for n in range(3) for k in KEYS], ack="replica")
        total = len(KEYS) * 4  # the probes and three per key
        members = [client.consumer("g", "orders", auto_offset_reset="earliest", session_timeout_ms=6000)
                   for client in (c2, c2, c1, c1)]  # bootstrapped from both shards' nodes
        try:
            early = _settle(members, 8, "the 8 queues of both shards shared by 4 members")
            got = early + _drain(members, total - len(early))
            assert sorted(got) == sorted([b"probe"] * len(KEYS) + [f"{k}:{n}".encode() for n in range(3) for k in KEYS])
            for m in members:
                m.commit()
            coordinator = json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/slots/{slots.slot_of('g')}") or b"{}")
            assert coordinator.get("shard") in ("s1", "s2"), "the group's slot was given a shard in etcd"
            ends = [q["max_offset"] for q in c1.describe_topic("orders")["queues"]]
            for client in (c1, c2):  # from a node of either shard, every queue with its own shard's end
                d = client.describe_group("g")
                assert len(d["members"]) == 4
                assert [(q["queue_id"], q["committed_offset"], q["end_offset"], q["lag"], q["shard"])
                        for q in d["queues"]] == [(q, ends[q], ends[q], 0, "") for q in range(8)]
                assert [client.committed_offset("g", "orders", q) for q in range(8)] == ends
                listed = {g["name"]: g for g in client.list_groups()}
                assert listed["g"]["members"] == 4 and listed["g"]["topics"] == ["orders"]
            wrong = nodes["s1" if coordinator["shard"] == "s2" else "s2"]
            with grpc.insecure_channel(wrong.address) as ch, pytest.raises(grpc.RpcError) as refused:
                pb_grpc.BrokerStub(ch).GetOffset(pb.GetOffsetRequest(group="g", topic="orders", queue_id=0), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (OWNER_SHARD_KEY, coordinator["shard"]) in (refused.value.trailing_metadata() or ())
        finally:
            for m in members:
                m.close()
        c2.send("orders", [Message(b"later", key=k) for k in KEYS[:16]], ack="replica")
        assert c1.reset_offsets("g", "orders", "earliest") == dict.fromkeys(range(8), 0)
        d = c2.describe_group("g")
        ends = [q["max_offset"] for q in c2.describe_topic("orders")["queues"]]
        assert [(q["committed_offset"], q["lag"]) for q in d["queues"]] == [(0, e) for e in ends]
        for client in (c1, c2):  # the lag of every queue, whichever shard coordinates the group
            assert {g["name"]: g["lag"] for g in client.list_groups()}["g"] == sum(ends)
        assert c2.reset_offsets("g", "orders", "latest") == dict(enumerate(ends))
        assert [q["lag"] for q in c1.describe_group("g")["queues"]] == [0] * 8
        with c1.consumer("g", "orders", auto_offset_reset="earliest") as again:  # resumes where the reset put it
            assert again.wait_assignment(10)
            assert _drain([again], 1, timeout_s=2) == [], "nothing before the reset's offsets delivered again"


def test_pop_leases_stay_with_each_queues_shard(spawn: Spawn, etcd: EtcdProcess) -> None:
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c:
        owners = _placed(c, "jobs", 4)
        assert sorted(set(owners)) == ["s1", "s2"]
        c.send("jobs", [Message(f"job-{k}".encode(), key=k) for k in KEYS], ack="replica")
        seen: list[bytes] = []
        shards_leased: set[str] = set()
        deadline = time.monotonic() + 20
        while len(seen) < len(KEYS) and time.monotonic() < deadline:
            got = c.pop("pg", "jobs", max_messages=10, invisible_ms=60_000, max_wait_ms=200, start="earliest")
            seen += [m.body for m in got if m.body != b"probe"]
            shards_leased |= {owners[r.queue_id] for r in got.runs}
            assert c.ack("pg", got) == {}, "each lease ends on its own queue's shard"
        assert sorted(seen) == sorted(f"job-{k}".encode() for k in KEYS), "each message leased once"
        assert shards_leased == {"s1", "s2"}
        assert len(c.pop("pg", "jobs", max_messages=10, invisible_ms=1000, max_wait_ms=300)) == 0
        d = c.describe_group("pg")
        assert sorted(q["queue_id"] for q in d["queues"]) == [0, 1, 2, 3]
        assert all(q["in_flight"] == 0 and q["lag"] == 0 and q["shard"] == "" for q in d["queues"])
        late = c.send("jobs", [Message(b"late", key=KEYS[0])], ack="replica")[0]
        got = c.pop("pg", "jobs", max_messages=5, invisible_ms=60_000, max_wait_ms=3000)
        assert [m.body for m in got] == [b"late"] and got.runs[0].queue_id == late.queue_id
        extended = c.change_invisible("pg", got[0], 30_000)  # on the queue's shard
        assert extended and c.ack("pg", [extended]) == {}


def test_a_shard_down_when_its_routes_were_learnt_is_popped_once_it_is_back(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A client that learns a topic's routes while one of its shards has no master passes that
    shard over; the pops it answers from the other shard never fail, so no refusal names the new
    master. The client asks for it again now and then: the shard's queues are popped once it is
    back, and keyless sends (which pass it over as well) go there again. (Chaos seed 1637989843:
    both of s2's nodes lost power right after the topic's creation, while the popper learnt its
    routes, and s2's queue of it was never popped for the whole run.)"""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c:
        owners = _placed(c, "jobs", 4)
    assert sorted(set(owners)) == ["s1", "s2"]
    nodes["s2"].kill9()
    with BrokerClient(nodes["s1"].address) as c:
        wait_until(lambda: {s["shard"]: s["master"] for s in c.cluster_status()["shards"]}.get("s2") == "", 20,
                   "s2 without a master in etcd")
    with BrokerClient(nodes["s1"].address) as popper, BrokerClient(nodes["s1"].address) as keyless:
        assert popper.pop("pg", "jobs", max_messages=100, max_wait_ms=0, start="earliest") is not None
        assert owners[keyless.send("jobs", [Message(b"while-down")])[0].queue_id] == "s1"
        nodes["s2"].start()
        wait_master([nodes["s2"]])
        with BrokerClient(nodes["s1"].address) as producer:
            producer.send("jobs", [Message(f"job-{k}".encode(), key=k) for k in KEYS], ack="replica")
        want = {f"job-{k}".encode() for k in KEYS}
        seen: set[bytes] = set()
        shards_leased: set[str] = set()
        deadline = time.monotonic() + 20
        while not want <= seen and time.monotonic() < deadline:
            got = popper.pop("pg", "jobs", max_messages=32, invisible_ms=60_000, max_wait_ms=200, start="earliest")
            seen |= {m.body for m in got}
            shards_leased |= {owners[r.queue_id] for r in got.runs}
            assert popper.ack("pg", got) == {}
        assert want <= seen, f"{len(want - seen)} messages never popped; leased from {sorted(shards_leased)}"
        assert shards_leased == {"s1", "s2"}
        deadline = time.monotonic() + 10  # keyless sends pass s2 over no longer either
        while time.monotonic() < deadline and owners[keyless.send("jobs", [Message(b"back")])[0].queue_id] != "s2":
            time.sleep(0.05)
        assert time.monotonic() < deadline, "keyless sends never went to s2 again"


def test_a_coordinator_without_the_topics_queues_keeps_its_commits(spawn: Spawn, etcd: EtcdProcess) -> None:
    """The group's coordinator holds no queue of the topic: its commits survive a restart (its log
    holds every placed topic, and offsets are kept only of topics the log holds)."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s2"].address) as c:
        c.create_topic("pad", queues=1)  # s1 (the lowest of two empty shards)
        c.commit_offset("gx", "pad", 0, 0)  # gx's slot: the first given, so s1's
        assert _coordinator_of(etcd, "gx") == "s1"
        owners = _placed(c, "solo", 1)
        assert owners == ["s2"], "solo's one queue on the shard that does not coordinate gx"
        c.send("solo", [Message(f"m{i}".encode()) for i in range(10)], ack="replica")
        c.commit_offset("gx", "solo", 0, 7)
        assert c.committed_offset("gx", "solo", 0) == 7
    nodes["s1"].kill9()
    nodes["s1"].start()
    wait_master([nodes["s1"]], 30)
    with BrokerClient(nodes["s2"].address) as c:
        assert wait_until(lambda: c.committed_offset("gx", "solo", 0), 15, "the commit read back") == 7
        assert [(q["committed_offset"], q["end_offset"], q["lag"]) for q in c.describe_group("gx")["queues"]
                if q["topic"] == "solo"] == [(7, 74, 67)]  # 64 probes and 10


def test_dead_letters_of_each_shard_go_to_its_own_dlq_queue(spawn: Spawn, etcd: EtcdProcess) -> None:
    nodes = [spawn(n, config=coordinated(etcd.endpoint, **{"coordinator.cluster": CLUSTER, "coordinator.shard": s,
                                                             "groups.max_deliveries": 2}))
             for n, s in (("a", "s1"), ("b", "s2"))]
    for node in nodes:
        wait_master([node])
    with BrokerClient(nodes[0].address) as c:
        owners = _placed(c, "jobs", 4)
        c.send("jobs", [Message(f"job-{k}".encode(), key=k) for k in KEYS], ack="replica")
        want = sorted([b"probe"] * len(KEYS) + [f"job-{k}".encode() for k in KEYS])

        def dead_letters() -> list[bytes] | None:
            c.pop("dq", "jobs", max_messages=200, invisible_ms=1000, start="earliest")  # never acked
            if c.sharded and c._routes.queues("dq.dlq") is None:
                c._learn_routes(["dq.dlq"])
            dlq = c._routes.queues("dq.dlq")
            if dlq is None:
                return None
            got = sorted(m.body for q in range(len(dlq)) for r in c.iter_pull("dq.dlq", q, 0) for m in r)
            return got if got == want else None

        wait_until(dead_letters, 40, "every message, never acked, moved to dq.dlq after 2 deliveries")
        dlq = c.describe_topic("dq.dlq")["queues"]
        assert sorted(q["shard"] for q in dlq) == ["s1", "s2"], "one dead-letter queue per shard"
        ends = [q["max_offset"] for q in c.describe_topic("jobs")["queues"]]
        per_shard = {shard: sum(e for e, o in zip(ends, owners, strict=True) if o == shard) for shard in ("s1", "s2")}
        assert {q["shard"]: q["max_offset"] for q in dlq} == per_shard, "each shard's dead letters in its own queue"


def _coordinator_of(etcd: EtcdProcess, group: str) -> str:
    return str(json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/slots/{slots.slot_of(group)}") or b"{}").get("shard"))


def test_a_group_outlives_a_kill_of_its_coordinators_master(spawn: Spawn, etcd: EtcdProcess) -> None:
    """Members heartbeat to the coordinator shard's master; after a kill -9 of it they rejoin its
    new master, the committed offsets (ack=replica) are there, and no queue is held twice."""
    pairs = {"s1": _pair(spawn, etcd, "s1", ("a", "b")), "s2": _pair(spawn, etcd, "s2", ("c", "d"))}
    settled = {shard: _settled(nodes) for shard, nodes in pairs.items()}
    with BrokerClient([settled["s2"][0].address, settled["s1"][0].address]) as c:
        _placed(c, "orders", 8)
        c.send("orders", [Message(f"{k}:a".encode(), key=k) for k in KEYS], ack="replica")
        members = [c.consumer("g", "orders", auto_offset_reset="earliest", session_timeout_ms=6000) for _ in range(3)]
        try:
            early = _settle(members, 8, "the queues shared")
            first = early + _drain(members, len(KEYS) * 2 - len(early))
            assert len(first) == len(KEYS) * 2
            for m in members:
                m.commit()
            shard = _coordinator_of(etcd, "g")
            master, slave = settled[shard]
            committed = [c.committed_offset("g", "orders", q) for q in range(8)]
            master.kill9()
            wait_master(pairs[shard], 30, among=[slave])
            c.send("orders", [Message(f"{k}:b".encode(), key=k) for k in KEYS], ack="replica")
            after = _drain(members, len(KEYS), timeout_s=40)
            assert sorted(after) == sorted(f"{k}:b".encode() for k in KEYS), "nothing lost, nothing twice"
            late = _settle(members, 8, "the queues shared again, none twice")
            assert not late, f"read again after everything was read once: {late[:5]}"
            assert status(slave)["role"] == "master"
            described = c.describe_group("g")
            assert len(described["members"]) == 3
            assert all(q["committed_offset"] is not None and q["committed_offset"] >= committed[q["queue_id"]]
                       for q in described["queues"]), "the commits survived on the new coordinator"
        finally:
            for m in members:
                m.close()
