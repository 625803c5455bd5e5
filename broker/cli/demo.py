"""``tidemark demo``: the main job on embedded defaults, with real daemon processes.

A master/slave pair under a real etcd (automatic failover) in a temporary directory; shows every
capability that exists so far and prints a short readable summary; then two shards of one
cluster (demo_shards.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import grpc

from broker.cli import demo_shards
from broker.cli.etcd_process import EtcdMissing, EtcdProcess
from broker.cli.node_process import NodeProcess
from broker.client import BrokerClient, Message, Receipt
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

MESSAGES = 20_000
TIMERS = 1000
CANCELLED = 10


def _say(text: str) -> None:
    print(text, flush=True)


def _wait(cond: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError("the demo waited too long")


def _count(c: BrokerClient, topic: str, queues: int) -> int:
    return sum(len(r) for q in range(queues) for r in c.iter_pull(topic, q, 0, max_messages=5000))


def _objects(work: str) -> int:

    return sum(len(files) for _, _, files in os.walk(f"{work}/objects"))


def _restart(node: NodeProcess, stop: Callable[[], object]) -> dict[str, Any]:
    """Stop ``node`` the given way, start it again; its recovery report."""
    stop()
    node.start()
    with BrokerClient(node.address) as c:
        return dict(c.status()["recovery"])


def _leader(address: str) -> str:
    """The node id etcd names as master, as the node at ``address`` sees it ('' if none or down)."""
    try:
        with BrokerClient(address, timeout_s=1) as c:
            st = c.status()
    except Exception:
        return ""
    coordinator = st.get("coordinator") or {}
    return str(coordinator.get("leader", "")) if st["role"] == "master" else ""


def _data_on_a_pair(master: NodeProcess, slave: NodeProcess) -> None:
    with BrokerClient(master.address) as c:
        c.create_topic("orders", queues=4)
        t0 = time.perf_counter()
        receipts: list[Receipt] = []
        for start in range(0, MESSAGES, 1000):
            batch = [Message(body=b"order-%06d " % i + b"x" * 1000, key=f"customer-{i % 97}")
                     for i in range(start, start + 1000)]
            receipts += c.send("orders", batch, ack="replica")
        dt = time.perf_counter() - t0
        _say(f"2. sent {MESSAGES} x 1 KiB messages with ack=replica (on both nodes before the ack) in {dt:.2f}s "
             f"({MESSAGES / dt:,.0f} msg/s); keys spread them over queues {sorted({r.queue_id for r in receipts})}")
        for q in range(4):
            c.commit_offset("demo-group", "orders", q, 10)
        first = c.pull("orders", 0, 0, max_messages=1)[0]
        _say(f"3. seek by time: messages stored at {first.store_time_ms} start at queue offset "
             f"{c.offset_for_time('orders', 0, first.store_time_ms)}")
        st = c.status()
        rep = st["replicas"][0]
        _say(f"4. master: epoch {st['epoch']}, confirm offset {st['confirm_offset']}; "
             f"replica {rep['address']} acked {rep['acked_offset']}, in sync: {rep['in_sync']}")
    time.sleep(0.3)
    with BrokerClient(slave.address) as c:
        _wait(lambda: c.committed_offset("demo-group", "orders", 0) == 10)
        _say(f"5. the slave serves reads: {_count(c, 'orders', 4)} messages, topics {list(c.list_topics())}, "
             f"committed offset of demo-group = {c.committed_offset('demo-group', 'orders', 0)}")
        c.send("orders", [Message(body=b"sent to the slave")], ack="replica")
        _say("6. a write sent to the slave was redirected to the master by the client")


def _timers_groups_tiered(master: NodeProcess, slave: NodeProcess, work: str) -> int:
    with BrokerClient(master.address) as c:
        c.create_topic("reminders", queues=2)
        due = int(time.time() * 1000) + 2500
        timers = c.send("reminders", [Message(body=b"reminder-%d" % i, deliver_at_ms=due + i) for i in range(TIMERS)])
        for r in timers[:CANCELLED]:
            c.cancel_timer(r)
        _say(f"6b. scheduled {TIMERS} timer messages due in 2.5 s (stored in __timer, receipts name their "
             f"timer_offset) and cancelled {CANCELLED}; pending: {c.status()['timer_pending']}")
    with BrokerClient(master.address) as c:
        popped = c.pop("packers", "orders", max_messages=500, invisible_ms=30_000, start="earliest")
        refused = c.ack("packers", popped)
        with c.consumer("auditors", ["orders"], auto_offset_reset="earliest") as member:
            _wait(lambda: len(member.assignment) == 4)
            polled = len(member.poll(timeout_ms=1000))
            member.commit()
        _say(f"6d. consumer groups: pop leased {len(popped)} messages to group packers in {len(popped.runs)} runs "
             f"and one ack ended them ({len(refused)} refused); a subscribe member of auditors was assigned "
             f"{len(member.assignment)} queues by the master and polled {polled} messages")
    with grpc.insecure_channel(master.address) as channel:  # any gRPC client, proto/tidemark.proto alone
        stub = pb_grpc.BrokerStub(channel)
        sent = stub.Send(pb.SendRequest(messages=[pb.PlainMessage(topic="orders", queue_id=1, key="plain",
                                                                  body=b"from any language")]))
        (receipt,) = sent.message_receipts
        pulled = stub.Pull(pb.PullRequest(topic="orders", queue_id=1, offset=receipt.queue_offset, decode=True))
        role = pb.Role.Name(stub.Status(pb.StatusRequest()).status.role)
        _say(f"6e. any language: a plain message sent through the generated stubs (the server encodes it) "
             f"landed at orders/1@{receipt.queue_offset}; a decoded pull returned {pulled.messages[0].body!r}; "
             f"typed status: {role} (examples/node does the same from Node.js)")
    with BrokerClient(master.address) as a, BrokerClient(slave.address) as b:
        _wait(lambda: a.status()["tiered_uploaded_offset"] > 16 << 20)
        _say(f"6c. tiered storage: the master uploaded the log below the confirm offset up to "
             f"{a.status()['tiered_uploaded_offset']} as {_objects(work)} objects; the slave knows it too "
             f"({b.status()['tiered_uploaded_offset']})")
    return due


def _failover(master: NodeProcess, slave: NodeProcess, work: str, due: int) -> None:
    master.kill9()
    killed = time.monotonic()
    _say("7. killed the master with SIGKILL; nobody types promote")
    with BrokerClient([master.address, slave.address]) as c:  # a client that knows both addresses
        c.send("orders", [Message(body=b"after failover")], ack="replica")
        rto = time.monotonic() - killed
        epoch = c.status()["epoch"] if c.current_address == slave.address else -1
    with BrokerClient(slave.address) as c:
        n = _count(c, "orders", 4)
        verdict = "none lost" if n == MESSAGES + 3 else f"EXPECTED {MESSAGES + 3}"
        _say(f"8. etcd elected node-b when node-a's lease ran out: epoch {epoch}; the client's next ack=replica "
             f"send was acknowledged {rto:.2f}s after the kill; {n} messages ({verdict})")
        _wait(lambda: c.status()["timer_pending"] == 0 and time.time() * 1000 > due + TIMERS + 200)
        fired = [m for q in range(2) for r in c.iter_pull("reminders", q, 0, max_messages=5000) for m in r]
        once = len({m.timer_offset for m in fired}) == len(fired) == TIMERS - CANCELLED
        early = sum(m.store_time_ms < (m.deliver_at_ms or 0) for m in fired)
        late = max(m.store_time_ms - (m.deliver_at_ms or 0) for m in fired)
        _say(f"8b. the new master fired the timers the old one had scheduled: {len(fired)} delivered "
             f"({'each once' if once else 'NOT EXACTLY ONCE'}), {early} early, latest {late} ms after its time")
        _wait(lambda: c.status()["tiered_uploaded_offset"] >= c.status()["confirm_offset"] - (64 << 10))
        _say(f"8c. the new master resumed uploading at the break point found in the object store: uploaded "
             f"offset {c.status()['tiered_uploaded_offset']} of {c.status()['confirm_offset']}, "
             f"{_objects(work)} objects")
    master.start()  # the same command line as before: the election, not the config, decides the role
    with BrokerClient(master.address) as a, BrokerClient(slave.address) as b:
        _wait(lambda: a.status()["max_offset"] == b.status()["max_offset"] == a.status()["confirm_offset"])
        _say(f"9. node-a restarted with its unchanged configuration and rejoined as a slave by itself: both at "
             f"offset {a.status()['max_offset']}, {_count(a, 'orders', 4)} messages on each")
        t0 = time.monotonic()
        epoch = a.promote()  # a switchover through etcd: node-b stops, waits for node-a, hands over
        _say(f"9b. promote on node-a is a switchover: node-b handed over after node-a held its whole log; "
             f"epoch {epoch} in {time.monotonic() - t0:.2f}s")
        a.demote(slave.address)
        _wait(lambda: b.status()["role"] == "master")


def run_demo() -> int:
    work = tempfile.mkdtemp(prefix="tidemark-demo-")
    try:
        etcd = EtcdProcess(f"{work}/etcd").start()
    except EtcdMissing as exc:
        print(f"tidemark demo: {exc}", flush=True)
        shutil.rmtree(work, ignore_errors=True)
        return 2
    common = {"tieredstore.root": f"{work}/objects", "tieredstore.object_bytes": 4 << 20,
              "tieredstore.upload_interval_ms": 200,  # both nodes share one object store (a directory here)
              "coordinator.endpoints": etcd.endpoint}  # node.role is auto: etcd's election decides
    ok = False
    shard_nodes: list[NodeProcess] = []
    master = NodeProcess(f"{work}/node-a", config=common)
    slave = NodeProcess(f"{work}/node-b", config=common)
    try:
        master.start()
        _wait(lambda: _leader(master.address))  # alone in a new cluster: elected after one lease TTL
        slave.start()
        with BrokerClient(master.address) as c:
            _wait(lambda: len(c.status()["coordinator"]["insync"]) == 2)
        _say(f"1. etcd at {etcd.endpoint}; node-a ({master.address}) was elected master, node-b ({slave.address}) "
             f"follows it and is in etcd's in-sync set (data under {work})")
        _data_on_a_pair(master, slave)
        due = _timers_groups_tiered(master, slave, work)
        _failover(master, slave, work, due)
        rec = _restart(slave, slave.kill9)
        _say(f"10. kill -9 and restart of node-b (master again after the demote; etcd elects node-a meanwhile): "
             f"ready in {slave.ready_seconds:.2f}s; recovery scanned "
             f"{rec['scanned_bytes']} bytes and replayed {rec['replayed_bytes']} (only above the view checkpoints)")
        rec = _restart(slave, slave.stop)
        _say(f"11. after a clean stop (SIGTERM) the restart replayed {rec['replayed_bytes']} bytes (clean={rec['clean']})")
        master.kill9()
        slave.kill9()
        shard_nodes = demo_shards.run(work, etcd.endpoint, _say, _wait)
        _say("Not shown here: TLS, tokens and systemd units (docs/operations.md); the S3 backend (README).")
        ok = True
        return 0
    finally:
        master.kill9()
        slave.kill9()
        for node in shard_nodes:
            node.kill9()
        etcd.kill9()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:  # the nodes' and etcd's logs are what tells why
            print(f"tidemark demo: a step failed; the data directories and logs are kept in {work}", flush=True)
