"""Several pairs under one cluster in a real etcd (DESIGN §15, docs/shards.md): each shard elects
and fails over on its own; a one-pair cluster's data directories and etcd keys upgrade in place
into a shard; a one-pair node is refused in a cluster of shards."""

from __future__ import annotations

import base64
import json
import urllib.request

import grpc
import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import AlreadyExists, BrokerClient, FailedPrecondition, Message
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.failoverutil import Spawn, coordinated, in_sync, status, wait_master
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
    with BrokerClient(master.address) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(f"m{i}".encode()) for i in range(20)], ack="replica")
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
            with BrokerClient(other.address) as wrong, pytest.raises(FailedPrecondition, match=f"on shard {shard!r}"):
                wrong.pull("orders", q, 0)
        with pytest.raises(AlreadyExists):
            c2.create_topic("orders", queues=2)
        with pytest.raises(AlreadyExists):
            c2.create_topics({"fresh": 2, "orders": 2})
        assert _etcd_get(etcd, f"/tidemark/{CLUSTER}/topics/fresh") is None, "all or none"


def _sent(node: DaemonProcess, topic: str, queue: int, body: bytes) -> bool:
    try:
        _send_to(node, topic, queue, body)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:  # the shard's log does not hold the topic yet
            return False
        raise
    return True
