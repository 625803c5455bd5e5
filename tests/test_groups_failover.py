"""Consumer groups across a failover through a real etcd (DESIGN §11-12): kill -9 the master while a
subscribe-mode member consumes and pop leases are in flight. The member goes on from the new master
within a session timeout, re-reading nothing below what it committed; acked pop messages never
come back, unacked ones do, and leases taken before the failover can still be acked after it."""

from __future__ import annotations

import threading
import time
from collections import Counter

import grpc

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, BrokerError, Message
from proto import tidemark_pb2 as pb
from tests.failoverutil import TOPIC, Pair, Spawn, create_topic, in_sync, status, wait_master
from tests.waits import wait_until

QUEUES = 2
SESSION_MS = 3000
CONFIG = {"groups.rejoin_grace_ms": 1000, "groups.heartbeat_interval_ms": 500, "offsets.flush_interval_ms": 200}


def test_groups_go_on_after_the_master_is_killed(spawn: Spawn, etcd: EtcdProcess) -> None:
    pair = Pair(spawn, etcd, **CONFIG)
    master = wait_master(pair.nodes)
    slave = pair.other(master)
    create_topic(master, pair.nodes, QUEUES)
    wait_until(lambda: in_sync(master, slave), 30, "the slave in sync")
    addresses = [pair.a.address, pair.b.address]
    with BrokerClient(addresses) as c:
        c.send(TOPIC, [Message(b"m%d" % i, key=str(i)) for i in range(200)], ack="replica")
        # pop mode: 100 leased, 60 of them acked; the other 100 never popped yet
        leased = c.pop("p", TOPIC, max_messages=100, invisible_ms=120_000, start="earliest")
        assert len(leased) == 100
        assert c.ack("p", leased[:60]) == {}

    consumed: list[bytes] = []
    stop = threading.Event()
    committed: dict[tuple[str, int], int] = {}
    member_client = BrokerClient(addresses, timeout_s=10)
    cons = member_client.consumer("s", [TOPIC], session_timeout_ms=SESSION_MS, auto_offset_reset="earliest",
                                  max_messages=20)

    def consume() -> None:
        while not stop.is_set():
            try:
                for m in cons.poll(timeout_ms=200):
                    consumed.append(m.body)
                cons.commit()
            except BrokerError:
                time.sleep(0.2)  # the master is gone for a moment: the member keeps trying

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_until(lambda: len(consumed) >= 60, 30, "the member consumed part of the topic")
    stop.set()
    thread.join(10)
    with BrokerClient(addresses) as c:  # what the slave holds as committed, flushed through the log
        wait_until(lambda: sum(q["committed_offset"] or 0 for q in c.describe_group("s")["queues"]) == len(consumed),
                   10, "the commits flushed")
    with BrokerClient(slave.address) as sc:
        wait_until(lambda: sum(q["committed_offset"] or 0 for q in sc.describe_group("s")["queues"]) == len(consumed),
                   10, "the commits replicated to the slave")
        committed = {(q["topic"], q["queue_id"]): q["committed_offset"] for q in sc.describe_group("s")["queues"]}
        with grpc.insecure_channel(slave.address) as ch:  # a heartbeat to the slave names the master
            try:
                ch.unary_unary("/tidemark.v1.Broker/Heartbeat", request_serializer=pb.HeartbeatRequest.SerializeToString,
                               response_deserializer=pb.HeartbeatResponse.FromString)(
                    pb.HeartbeatRequest(group="s", topics=[TOPIC]), timeout=5)
                raise AssertionError("a slave answered a heartbeat")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert dict(exc.trailing_metadata() or ()).get("tidemark-master") == master.address

    before = len(consumed)
    master.kill9()
    killed_at = time.monotonic()
    new = wait_master(pair.nodes, 30, among=[slave])
    stop.clear()
    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_until(lambda: len(consumed) >= 200 and Counter(consumed).keys() >= {b"m%d" % i for i in range(200)}, 30,
               "the member consumed the rest from the new master")
    took = time.monotonic() - killed_at
    stop.set()
    thread.join(10)
    cons.close()
    member_client.close()
    # nothing below what was committed came again; anything after it at most once more
    again = Counter(consumed[before:])
    assert all(n == 1 for n in again.values())
    assert not set(consumed[:before]) & set(again), "messages below the committed offsets were consumed again"
    assert took < 30 + SESSION_MS / 1000.0
    assert committed

    with BrokerClient(new.address) as c:
        assert status(new)["role"] == "master"
        refused = c.ack("p", leased[:70])  # 60 acked before (refused), 10 still leased (ok: leases replicate)
        assert set(refused) == {m.receipt_handle for m in leased[:60]}
        assert c.nack("p", leased[70:]) == {}  # the other 30 given back: delivered again at once
        back: list[tuple[bytes, int]] = []
        wait_until(lambda: back.extend((m.body, m.delivery_count) for m in c.pop("p", TOPIC, max_messages=500,
                                                                                  max_wait_ms=500)) or len(back) >= 130,
                   20, "the unacked and never-popped messages delivered by the new master")
        acked = {m.body for m in leased[:70]}
        assert not acked & {b for b, _ in back}, "acked messages came back after the failover"
        assert Counter(n for _, n in back) == Counter({1: 100, 2: 30})
        assert {b for b, _ in back} == {b"m%d" % i for i in range(200)} - acked
