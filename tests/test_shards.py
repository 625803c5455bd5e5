"""Several pairs under one cluster in a real etcd (DESIGN §15, docs/shards.md): each shard elects
and fails over on its own; a one-pair cluster's data directories and etcd keys upgrade in place
into a shard; a one-pair node is refused in a cluster of shards."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import crc32c
import grpc
import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import (
    AlreadyExists,
    BrokerClient,
    BrokerError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Message,
    NotFound,
)
from broker.errors import OWNER_SHARD_KEY
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from replication.coordination.slots import slot_of
from tests.failoverutil import Spawn, coordinated, in_sync, sent_once_placed, status, wait_master
from tests.procs import DaemonProcess
from tests.waits import wait_until

CLUSTER = "shop"


def _etcd_get(etcd: EtcdProcess, key: str) -> bytes | None:
    """One key through etcd's JSON gateway (the test reads etcd as an operator would)."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    with urllib.request.urlopen(f"{etcd.endpoint}/v3/kv/range", body, timeout=5) as r:
        kvs = json.loads(r.read()).get("kvs", [])
    return base64.b64decode(kvs[0]["value"]) if kvs else None


def _pair(spawn: Spawn, etcd: EtcdProcess, shard: str, names: tuple[str, str]) -> list[DaemonProcess]:
    return [spawn(n, config=coordinated(etcd.endpoint, **{"coordinator.cluster": CLUSTER, "coordinator.shard": shard}))
            for n in names]


def _settled(nodes: list[DaemonProcess]) -> tuple[DaemonProcess, DaemonProcess]:
    master = wait_master(nodes)
    slave = nodes[1] if master is nodes[0] else nodes[0]
    wait_until(lambda: in_sync(master, slave), 30, "the slave in sync", observe=lambda: status(slave))
    return master, slave


def test_two_shards_elect_their_own_masters_and_fail_over_alone(spawn: Spawn, etcd: EtcdProcess) -> None:
    s1 = _pair(spawn, etcd, "s1", ("a", "b"))
    s2 = _pair(spawn, etcd, "s2", ("c", "d"))
    m1, slave1 = _settled(s1)
    m2, _ = _settled(s2)
    for shard, master in (("s1", m1), ("s2", m2)):
        leader = json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/shards/{shard}/leader") or b"{}")
        assert leader.get("node_id") == status(master)["node_id"], f"shard {shard}'s leader key names its master"
    assert _etcd_get(etcd, f"/tidemark/{CLUSTER}/leader") is None, "no one-pair keys at the cluster's root"
    assert json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/sharded") or b"null") is not None
    epoch2 = status(m2)["epoch"]
    m1.kill9()
    new1 = wait_master(s1, 30, among=[slave1])
    assert status(new1)["epoch"] > 1
    assert status(m2)["role"] == "master" and status(m2)["epoch"] == epoch2, "the other shard saw nothing"


def test_a_one_pair_cluster_upgrades_in_place_into_a_shard(spawn: Spawn, etcd: EtcdProcess) -> None:
    pair = _pair(spawn, etcd, "", ("a", "b"))
    master, _ = _settled(pair)
    groups = [f"group-{i}" for i in range(8)]
    with BrokerClient(master.address) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(f"m{i}".encode()) for i in range(20)], ack="replica")
        for i, g in enumerate(groups):
            c.commit_offset(g, "t", 0, i + 1)
    epoch = status(master)["epoch"]
    assert _etcd_get(etcd, f"/tidemark/{CLUSTER}/epoch") == str(epoch).encode()

    newcomer = spawn("n", config=coordinated(etcd.endpoint, **{"coordinator.cluster": CLUSTER,
                                                               "coordinator.shard": "s2"}))
    wait_until(lambda: "restart that pair's nodes" in (status(newcomer).get("coordinator") or {}).get("error", ""),
               15, "a new shard's node waiting for the one-pair keys to be upgraded", observe=lambda: status(newcomer))
    assert status(newcomer)["role"] != "master"

    for d in pair:  # a rolling upgrade: each node restarted with a shard; the pair fails over once
        d.stop()
        d.config = {**d.config, "coordinator.shard": "s1"}
        d.start()
    new_master, _ = _settled(pair)
    assert status(new_master)["epoch"] > epoch, "epochs keep growing across the upgrade"
    assert _etcd_get(etcd, f"/tidemark/{CLUSTER}/epoch") is None
    assert json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/sharded") or b"{}")["upgraded_from_pair"] == "s1"
    with BrokerClient(new_master.address) as c:
        assert [m.body for r in c.iter_pull("t", 0, 0) for m in r] == [f"m{i}".encode() for i in range(20)]
    adopted = wait_until(lambda: _etcd_get(etcd, f"/tidemark/{CLUSTER}/topics/t"), 15,
                         "the upgraded pair's topic placed in etcd (adopted by its shard)")
    assert [q[0]["shard"] for q in json.loads(adopted)["segments"]] == ["s1"]
    wait_master([newcomer], 30)  # the new shard elects once the pair's keys are upgraded
    # the pair's groups keep their coordinator where their offsets are: their slots are claimed for
    # s1 (without that, half of them would be given to s2, the shard with fewer slots)
    for g in groups:
        wait_until(lambda g=g: _etcd_get(etcd, f"/tidemark/{CLUSTER}/slots/{slot_of(g)}"), 15, f"{g}'s slot claimed")
        assert json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/slots/{slot_of(g)}") or b"{}")["shard"] == "s1"
    with BrokerClient(newcomer.address) as c:
        assert [c.committed_offset(g, "t", 0) for g in groups] == list(range(1, 9))

    old = pair[0]  # its data directory belongs to shard s1 now: with shard "" it is refused, in one line
    old.stop()
    old.config = {**old.config, "coordinator.shard": ""}
    old.start(wait=False)
    assert old.wait_exit(60) == 1
    said = old.tail_log(5)
    assert "cluster of shards" in said and "set coordinator.shard = 's1'" in said and "Traceback" not in said


def _single(spawn: Spawn, etcd: EtcdProcess, shard: str, name: str) -> DaemonProcess:
    node = spawn(name, config=coordinated(etcd.endpoint, **{"coordinator.cluster": CLUSTER, "coordinator.shard": shard}))
    wait_master([node])
    return node


def _send_to(node: DaemonProcess, topic: str, queue: int, body: bytes) -> None:
    with grpc.insecure_channel(node.address) as ch:
        pb_grpc.BrokerStub(ch).Send(pb.SendRequest(ack=pb.ACK_REPLICA, messages=[
            pb.PlainMessage(topic=topic, queue_id=queue, body=body)]), timeout=10)


def test_topics_are_placed_over_the_shards_and_each_queue_is_served_by_its_own(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A topic's queues spread over the shards in one etcd transaction (asked of any node); a
    request for a queue of another shard is refused naming that shard and its master."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c1, BrokerClient(nodes["s2"].address) as c2:
        c1.create_topic("orders", queues=4)
        placed = json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/topics/orders") or b"{}")
        owners = [q[0]["shard"] for q in placed["segments"]]
        assert sorted(owners) == ["s1", "s1", "s2", "s2"], "fewest queues first: two each"
        described = c2.describe_topic("orders")["queues"]
        assert [q["shard"] for q in described] == owners
        assert [q["master"] for q in described] == [nodes[s].address for s in owners]
        for q, shard in enumerate(owners):
            other = nodes["s2" if shard == "s1" else "s1"]
            body = f"q{q}".encode()
            wait_until(lambda n=nodes[shard], q=q, body=body: _sent(n, "orders", q, body), 15,
                       f"queue {q} writable on its shard {shard}")
            with pytest.raises(grpc.RpcError) as refused:
                _send_to(other, "orders", q, b"elsewhere")
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"on shard {shard!r} (master {nodes[shard].address})" in (refused.value.details() or "")
            with BrokerClient(nodes[shard].address) as owner:
                assert [m.body for r in owner.iter_pull("orders", q, 0) for m in r] == [body]
            with BrokerClient(other.address, follow_master=False) as routed:  # the client follows the route
                assert [m.body for m in routed.pull("orders", q, 0)] == [body]
        with pytest.raises(AlreadyExists):
            c2.create_topic("orders", queues=2)
        with pytest.raises(AlreadyExists):
            c2.create_topics({"fresh": 2, "orders": 2})
        assert _etcd_get(etcd, f"/tidemark/{CLUSTER}/topics/fresh") is None, "all or none"
        c1.create_topics({f"many-{i}": 1 for i in range(128)})  # one etcd transaction of 128 topics
        assert _etcd_get(etcd, f"/tidemark/{CLUSTER}/topics/many-127") is not None
        with pytest.raises(InvalidArgument, match="at most 128 topics per call"):
            c1.create_topics({f"more-{i}": 1 for i in range(129)})

        c2.delete_topic("orders")  # a tombstone in etcd; each shard's master deletes it from its log
        assert json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/topics/orders") or b"{}").get("deleted") is True
        for node in nodes.values():
            wait_until(lambda n=node: _gone_from_log(n, "orders"), 15, "the topic gone from each shard's log")
        with pytest.raises(NotFound):  # c1's routes still name the owners: they answer that it is gone
            c1.send("orders", [Message(b"late", key=f"k{i}") for i in range(8)])
        with pytest.raises(NotFound):
            c1.delete_topic("orders")
        with pytest.raises(FailedPrecondition, match="was deleted"):
            c1.create_topic("orders", queues=2)


def _held_s1_and_s2(spawn: Spawn, etcd: EtcdProcess, failpoints: str) -> tuple[DaemonProcess, DaemonProcess]:
    """A single-node shard s1 held at ``failpoints`` and a plain single-node shard s2."""
    held = spawn("a", config=coordinated(etcd.endpoint, **{"coordinator.cluster": CLUSTER, "coordinator.shard": "s1"}),
                 env={"TIDEMARK_FAILPOINTS": failpoints})
    wait_master([held], 30)
    return held, _single(spawn, etcd, "s2", "b")


def _placed_over_both(c: BrokerClient, topic: str) -> list[str]:
    """``topic`` created with two queues (one on each shard): the shard of each."""
    c.create_topic(topic, queues=2)
    owners = [q["shard"] for q in c.describe_topic(topic)["queues"]]
    assert sorted(owners) == ["s1", "s2"]
    return owners


def test_a_topic_created_elsewhere_is_never_unknown_to_a_trailing_node(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A node whose copy of etcd trails (its watch paused 3 s per batch) is asked for a topic
    just created through another node: UNAVAILABLE (retry), never NOT_FOUND; a name etcd does not
    hold is NOT_FOUND, confirmed with etcd; once the copy catches up the queue serves."""
    trailing, other = _held_s1_and_s2(spawn, etcd, "cluster_before_apply=sleep:3000")
    with BrokerClient(other.address) as c:
        mine = _placed_over_both(c, "late").index("s1")
        for call in (lambda: _send_to(trailing, "late", mine, b"early"),
                     lambda: list(_pull_raw(trailing, "late", mine)), lambda: _pop_raw(trailing, "late")):
            with pytest.raises(grpc.RpcError) as early:
                call()
            assert early.value.code() == grpc.StatusCode.UNAVAILABLE, early.value.details()
            assert "just created" in (early.value.details() or "") or "being created" in (early.value.details() or "")
        for call in (lambda: _send_to(trailing, "never-made", 0, b"x"), lambda: list(_pull_raw(trailing, "never-made", 0)),
                     lambda: _pop_raw(trailing, "never-made")):
            with pytest.raises(grpc.RpcError) as unknown:
                call()
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND, unknown.value.details()
        wait_until(lambda: _sent(trailing, "late", mine, b"served"), 45, "the queue served once the copy caught up")
        c.commit_offset("gl", "late", mine, 1)  # wherever gl's coordinator is, the topic is known there
        assert c.committed_offset("gl", "late", mine) == 1
        assert [m.body for m in c.pull("late", mine, 0)] == [b"served"]


def test_a_queue_of_another_shard_is_refused_naming_its_owner_before_the_log_holds_the_topic(
        spawn: Spawn, etcd: EtcdProcess) -> None:
    """A shard whose log does not hold a just-placed topic yet (its reconciler held 6 s) refuses
    a plain send for a queue of another shard FAILED_PRECONDITION naming the owner (the client
    follows it at once), and answers UNAVAILABLE (retry) only for its own queues."""
    slow, other = _held_s1_and_s2(spawn, etcd, "shards_before_create_topics=sleep:6000")
    with BrokerClient(other.address) as c:
        owners = _placed_over_both(c, "placed")
        theirs, mine = owners.index("s2"), owners.index("s1")
        with pytest.raises(grpc.RpcError) as refused:
            _send_to(slow, "placed", theirs, b"elsewhere")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
        assert f"on shard 's2' (master {other.address})" in (refused.value.details() or "")
        with pytest.raises(grpc.RpcError) as early:  # the window was open: s1's log did not hold the topic
            _send_to(slow, "placed", mine, b"early")
        assert early.value.code() == grpc.StatusCode.UNAVAILABLE, early.value.details()
        assert "being created on shard 's1'" in (early.value.details() or "")
        wait_until(lambda: _sent(slow, "placed", mine, b"served"), 45, "the queue served once the log holds the topic")
        assert [m.body for m in c.pull("placed", mine, 0)] == [b"served"]


def _pull_raw(node: DaemonProcess, topic: str, queue: int) -> bytes:
    with grpc.insecure_channel(node.address) as ch:
        resp = pb_grpc.BrokerStub(ch).Pull(pb.PullRequest(topic=topic, queue_id=queue, offset=0), timeout=10)
        return bytes(resp.SerializeToString())


def _pop_raw(node: DaemonProcess, topic: str) -> None:
    with grpc.insecure_channel(node.address) as ch:
        pb_grpc.BrokerStub(ch).Pop(pb.PopRequest(group="gp", topic=topic, max_messages=1), timeout=10)


def _gone_from_log(node: DaemonProcess, topic: str) -> bool:
    """The node's log no longer holds ``topic`` (describe answers from it, and from etcd's record)."""
    try:
        with BrokerClient(node.address) as c:
            c.describe_topic(topic)
    except NotFound:
        return True
    return False


def _sent(node: DaemonProcess, topic: str, queue: int, body: bytes) -> bool:
    try:
        _send_to(node, topic, queue, body)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:  # the shard's log does not hold the topic yet
            return False
        raise
    return True


def _keys_by_queue(c: BrokerClient, topic: str, queues: int) -> dict[int, list[bytes]]:
    return {q: [m.body for r in c.iter_pull(topic, q, 0) for m in r] for q in range(queues)}


def test_a_client_bootstrapped_from_one_node_routes_every_queue_to_its_shard(spawn: Spawn, etcd: EtcdProcess) -> None:
    """Keyed, keyless and delayed sends of one call split per shard and land on each queue's
    owner; reads follow the same routes; a stale route costs a pull one refusal that names the
    owner, followed without asking any node for routes again (a send: one route request)."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s2"].address) as c:
        c.create_topic("orders", queues=8)
        owners = [q["shard"] for q in c.describe_topic("orders")["queues"]]
        assert sorted(set(owners)) == ["s1", "s2"]
        keys = [f"k{i}" for i in range(64)]
        wait_until(lambda: sent_once_placed(c, "orders", [Message(b"probe", key=k) for k in keys]), 15, "every queue created")
        c.send("orders", [Message(f"{k}:{n}".encode(), key=k) for n in range(5) for k in keys], ack="replica")
        keyless = c.send("orders", [Message(b"loose") for _ in range(10)], ack="replica")
        assert len({r.queue_id for r in keyless}) == 1, "a call's keyless messages share a queue"
        due = int(time.time() * 1000) + 1500
        delayed = c.send("orders", [Message(f"late-{k}".encode(), key=k, deliver_at_ms=due) for k in keys[:16]])
        assert all(r.timer_offset is not None for r in delayed)
        assert c.current_address == nodes["s2"].address, "the bootstrap connection stays where it was"

        def everything_read() -> dict[int, list[bytes]] | None:
            got = _keys_by_queue(c, "orders", 8)
            return got if sum(len(v) for v in got.values()) == 64 + 320 + 10 + 16 else None

        got = wait_until(everything_read, 20, "every message readable, the delayed ones once due")
        assert got is not None
        for k in keys:  # each key in one queue, its messages in order, on the shard the route names
            holding = [q for q, bodies in got.items() if any(b.startswith(f"{k}:".encode()) for b in bodies)]
            assert len(holding) == 1
            mine = [b for b in got[holding[0]] if b.startswith(f"{k}:".encode())]
            assert mine == [f"{k}:{n}".encode() for n in range(5)]
        for k in keys[:16]:
            assert sum(b == f"late-{k}".encode() for bodies in got.values() for b in bodies) == 1, "each timer fired once"
        for q, shard in enumerate(owners):  # what each shard's own node holds is exactly its queues
            with BrokerClient(nodes[shard].address) as direct:
                assert [m.body for r in direct.iter_pull("orders", q, 0) for m in r] == got[q]
        described = c.describe_topic("orders")["queues"]  # each queue as its own shard describes it
        assert [(d["shard"], d["max_offset"]) for d in described] == [(owners[q], len(got[q])) for q in range(8)]
        assert c.describe_topic("__metadata")["queues"][0]["max_offset"] > 0, "a system topic: the asked node's"
        with pytest.raises(ValueError, match="no check-back"):
            c.begin_transaction("tid", check=lambda _: "commit")  # over shards a transaction is counted

        shown = subprocess.run([sys.executable, "-m", "broker.cli", "cluster", "status", "--json", "--broker",
                                nodes["s1"].address], capture_output=True, text=True, timeout=60, check=True)
        cluster = json.loads(shown.stdout)
        assert cluster["sharded"] and cluster["shard"] == "s1"
        assert {s["shard"]: (s["master"], s["nodes"], s["queues"]) for s in cluster["shards"]} == {
            shard: (node.address, [node.address], owners.count(shard)) for shard, node in nodes.items()}
        assert all(s["epoch"] >= 1 for s in cluster["shards"])

        asked = []
        learn = c._learn_routes
        c._learn_routes = lambda topics: (asked.append(topics), learn(topics))[1]  # type: ignore[method-assign]
        def corrupt() -> None:  # every route wrong
            for q in range(8):
                c._routes.moved("orders", q, "s1" if owners[q] == "s2" else "s2", "")

        corrupt()  # a send's request per shard is refused (nothing stored): one route request, then the owners
        c.send("orders", [Message(b"after", key=k) for k in keys], ack="replica")
        assert [c._routes.owner("orders", q) for q in range(8)] == owners
        assert asked == [["orders"]]
        corrupt()  # a pull of one queue follows the owner its refusal names, without asking anyone
        assert sum(len(v) for v in _keys_by_queue(c, "orders", 8).values()) == 64 + 320 + 10 + 16 + 64
        assert [c._routes.owner("orders", q) for q in range(8)] == owners
        assert asked == [["orders"]], "no route request for the pulls: the refusals named the owners"


def test_one_shard_failing_over_leaves_the_other_serving(spawn: Spawn, etcd: EtcdProcess) -> None:
    """kill -9 of one shard's master: the other shard's queues take sends throughout, from the
    same client whose send to the failed shard waits out its failover (a lock per shard, not one
    per client); the failed shard's queues serve again through that client's (stale) routes."""
    s1 = _pair(spawn, etcd, "s1", ("a", "b"))
    s2 = _pair(spawn, etcd, "s2", ("c", "d"))
    m1, slave1 = _settled(s1)
    _settled(s2)
    with BrokerClient([d.address for d in s2]) as c:
        c.create_topic("t", queues=4)
        owners = [q["shard"] for q in c.describe_topic("t")["queues"]]
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"probe", key=str(q)) for q in range(16)]), 15, "every queue created")
        other_q = owners.index("s2")
        failed_q = owners.index("s1")
        gaps: list[float] = []
        stop = threading.Event()

        key = _key_for(c, "t", other_q)

        def steady() -> None:  # sends to an s2 queue, straight through s1's failover, on the same client
            last = time.monotonic()
            while not stop.is_set():
                c.send("t", [Message(b"steady", key=key)], ack="replica")
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        t = threading.Thread(target=steady)
        t.start()
        time.sleep(1.0)
        m1.kill9()
        killed = time.monotonic()
        c.send("t", [Message(b"after-failover", key=_key_for(c, "t", failed_q))], ack="replica")
        served_s = time.monotonic() - killed
        wait_master(s1, 30, among=[slave1])
        time.sleep(1.0)
        stop.set()
        t.join(30)
        assert max(gaps) < 0.5, f"the other shard's sends paused {max(gaps):.2f} s"
        assert served_s < 15, "the failed shard's queue served again after its failover"
        bodies = [m.body for r in c.iter_pull("t", failed_q, 0) for m in r]
        assert bodies[-1] == b"after-failover"


def test_a_send_behind_one_stuck_on_its_shard_gives_up_in_its_own_time(spawn: Spawn, etcd: EtcdProcess) -> None:
    """Sends to one shard take turns (a lock per shard), and a send keeps within the client's
    timeout_s as a whole. A send whose turn does not come before its deadline fails unsent; with
    both nodes of a shard frozen (a call there retries over them until its deadline), a send
    queued behind one stuck there gives up at its own deadline; the other shard is not held up."""
    s1 = _pair(spawn, etcd, "s1", ("a", "c"))
    _settled(s1)
    s2 = _single(spawn, etcd, "s2", "b")
    timeout_s = 3.0
    with BrokerClient(s2.address, timeout_s=timeout_s) as c:
        c.create_topic("t", queues=2)
        owners = [q["shard"] for q in c.describe_topic("t")["queues"]]
        frozen_q = owners.index("s1")
        frozen_key, live_key = _key_for(c, "t", frozen_q), _key_for(c, "t", owners.index("s2"))
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"probe", key=k) for k in (frozen_key, live_key)]), 15,
                   "both queues created")
        end = c.describe_topic("t")["queues"][frozen_q]["max_offset"]

        refused: list[tuple[BrokerError, float]] = []

        def behind() -> None:
            t0 = time.monotonic()
            try:
                c.send("t", [Message(b"never", key=frozen_key)], ack="replica")
            except BrokerError as exc:
                refused.append((exc, time.monotonic() - t0))

        waiting = threading.Thread(target=behind)
        with c._shard_lock("s1"):  # s1's turn held (as by a send that never ends)
            waiting.start()
            waiting.join(timeout_s + 2.0)
            gave_up = not waiting.is_alive()
        waiting.join(30)
        assert gave_up and refused, "a send waited for its turn past its deadline"
        error, waited_s = refused[0]
        assert isinstance(error, DeadlineExceeded) and "was not sent" in error.details, error
        assert timeout_s - 0.1 < waited_s < timeout_s + 1.0, f"gave up after {waited_s:.2f} s"
        assert c.describe_topic("t")["queues"][frozen_q]["max_offset"] == end, "a send refused unsent stored nothing"

        first: list[BrokerError] = []

        def stuck() -> None:
            try:
                c.send("t", [Message(b"first", key=frozen_key)], ack="replica")
            except BrokerError as exc:
                first.append(exc)

        ahead = threading.Thread(target=stuck)
        try:
            for node in s1:
                assert node.proc is not None
                node.proc.send_signal(signal.SIGSTOP)
            ahead.start()
            time.sleep(0.5)  # the first send holds s1's turn
            t0 = time.monotonic()
            with pytest.raises(BrokerError):
                c.send("t", [Message(b"second", key=frozen_key)], ack="replica")
            waited_s = time.monotonic() - t0
            t0 = time.monotonic()
            c.send("t", [Message(b"live", key=live_key)], ack="replica")
            live_s = time.monotonic() - t0
            ahead.join(30)
        finally:
            for node in s1:
                assert node.proc is not None
                node.proc.send_signal(signal.SIGCONT)
        assert not ahead.is_alive() and first, "the send stuck on the frozen shard did not fail"
        # before the deadline covered the wait for the turn: 2.5 s of it, then a whole timeout_s more (5.5 s)
        assert waited_s < timeout_s + 1.3, f"the second send took {waited_s:.2f} s with timeout_s {timeout_s}"
        assert live_s < 1.0, f"a send to the other shard took {live_s:.2f} s"

        def sent_again() -> bool:
            try:
                c.send("t", [Message(b"again", key=frozen_key)], ack="replica")
            except BrokerError:
                return False
            return True

        wait_until(sent_again, 30, "s1 serving again, its turns free")


def test_a_pull_or_group_call_over_shards_keeps_within_its_timeout(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A pull or a group's call over shards is one operation within the client's timeout_s: the
    route request, the hop a refusal names and the call there share it. A fresh client whose first
    address is a frozen node spends CONNECT_S (1 s) on it before another node answers; the call on
    a frozen shard then has what is left, not a whole timeout_s of its own."""
    s1 = _pair(spawn, etcd, "s1", ("a", "c"))
    _settled(s1)
    s2 = _single(spawn, etcd, "s2", "b")
    timeout_s = 3.0
    with BrokerClient(s2.address) as c:
        c.create_topic("t", queues=2)
        frozen_q = [q["shard"] for q in c.describe_topic("t")["queues"]].index("s1")
        groups = [f"g{i}" for i in range(8)]
        for g in groups:
            c.commit_offset(g, "t", frozen_q, 0)
        frozen_group = next(g for g in groups if json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/slots/{slot_of(g)}")
                                                            or b"{}").get("shard") == "s1")
    took: dict[str, float] = {}
    calls = {"pull": lambda c: c.pull("t", frozen_q, 0),
             "committed_offset": lambda c: c.committed_offset(frozen_group, "t", frozen_q)}
    for name, call in calls.items():  # each on s1 just frozen (its leases in etcd still held)
        _settled(s1)
        with BrokerClient([s1[0].address, s2.address], timeout_s=timeout_s) as fresh:
            try:
                for node in s1:
                    assert node.proc is not None
                    node.proc.send_signal(signal.SIGSTOP)
                t0 = time.monotonic()
                with pytest.raises(BrokerError):
                    call(fresh)
                took[name] = time.monotonic() - t0
            finally:
                for node in s1:
                    assert node.proc is not None
                    node.proc.send_signal(signal.SIGCONT)
    # before the deadline covered the whole operation: 1 s on the frozen first address, then timeout_s more
    assert max(took.values()) < timeout_s + 0.5, f"with timeout_s {timeout_s} they took {took} s"


def _key_of(queue: int, queues: int, prefix: str = "key") -> str:
    """A key that maps to ``queue`` of ``queues`` (crc32c(key) % queues)."""
    return next(k for k in (f"{prefix}{i}" for i in range(10_000)) if crc32c.crc32c(k.encode()) % queues == queue)


def _key_for(c: BrokerClient, topic: str, queue: int) -> str:
    """A key that maps to ``queue`` of ``topic``."""
    return _key_of(queue, c._queue_count(topic))


def test_a_timer_is_cancelled_on_its_own_shard(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A timer offset is an offset of one shard's log: a cancel goes with its message's queue to
    that queue's shard, never by the bare offset to whichever node the client was given."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s2"].address) as c:
        c.create_topic("later", queues=4)
        owners = [q["shard"] for q in c.describe_topic("later")["queues"]]
        keys = [_key_for(c, "later", q) for q in range(4)]
        wait_until(lambda: sent_once_placed(c, "later", [Message(b"probe", key=k) for k in keys]), 15, "queues created")
        due = int(time.time() * 1000) + 60_000
        receipts = c.send("later", [Message(f"late-{q}".encode(), key=keys[q], deliver_at_ms=due) for q in range(4)])
        assert sorted(r.queue_id for r in receipts) == [0, 1, 2, 3] and all(r.timer_offset for r in receipts)
        with pytest.raises(ValueError, match="by its receipt"):
            c.cancel_timer(receipts[0].timer_offset or 0)
        r = receipts[0]
        wrong = nodes["s1" if owners[r.queue_id] == "s2" else "s2"]
        with grpc.insecure_channel(wrong.address) as ch:
            stub = pb_grpc.BrokerStub(ch)
            with pytest.raises(grpc.RpcError) as bare:
                stub.CancelTimer(pb.CancelTimerRequest(timer_offset=r.timer_offset or 0), timeout=10)
            assert bare.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as refused:
                stub.CancelTimer(pb.CancelTimerRequest(timer_offset=r.timer_offset or 0, topic="later",
                                                       queue_id=r.queue_id), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert (OWNER_SHARD_KEY, owners[r.queue_id]) in (refused.value.trailing_metadata() or ())
        mine = owners[r.queue_id]
        with grpc.insecure_channel(nodes[mine].address) as ch:  # the right shard, another of its queues named
            with pytest.raises(grpc.RpcError) as other:
                pb_grpc.BrokerStub(ch).CancelTimer(pb.CancelTimerRequest(
                    timer_offset=r.timer_offset or 0, topic="later",
                    queue_id=next(q for q in range(4) if q != r.queue_id and owners[q] == mine)), timeout=10)
            assert other.value.code() == grpc.StatusCode.NOT_FOUND
        for r in receipts:  # each on its own shard, from a client given s2's node
            assert c.cancel_timer(r)["queue_id"] == r.queue_id
        with pytest.raises(FailedPrecondition, match="already"):
            c.cancel_timer(receipts[1])
