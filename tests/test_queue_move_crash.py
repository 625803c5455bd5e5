"""A queue move interrupted (docs/shards.md "Moving a queue"): kill -9 of the source's master
mid-seal, of the target's master before it starts the queue, a deposed source master waking after
the switch, etcd paused mid-move. Each move is finished by whoever comes next, never with two
writable segments, and a keyed ack=replica producer loses and repeats nothing."""

from __future__ import annotations

import json
import signal
import threading
import time

import grpc

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, Message
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.failoverutil import Spawn, sent_once_placed, wait_master
from tests.moveutil import KeyedProducer, check_once_in_order, owners, read_back, shard_node, shard_pair
from tests.procs import DaemonProcess
from tests.test_shards import CLUSTER, _etcd_get, _key_for
from tests.waits import wait_until


def _topic(c: BrokerClient) -> int:
    """Topic t over two shards; the queue that s1 writes."""
    c.create_topic("t", queues=2)
    wait_until(lambda: sent_once_placed(c, "t", [Message(b"probe", key=str(q)) for q in range(8)]), 30,
               "every queue created")
    return owners(c, "t").index("s1")


def _segments(etcd: EtcdProcess, q: int) -> list[dict[str, object]]:
    return json.loads(_etcd_get(etcd, f"/tidemark/{CLUSTER}/topics/t") or b"{}")["segments"][q]


def _moving(etcd: EtcdProcess, q: int) -> bool:
    return _segments(etcd, q)[-1]["state"] == "sealing"


def _check_moved(etcd: EtcdProcess, q: int, p: KeyedProducer, addresses: list[str]) -> None:
    segs = _segments(etcd, q)
    assert [(s["shard"], s["state"]) for s in segs] == [("s1", "ro"), ("s2", "rw")], segs
    assert segs[1]["logical_start"] == segs[0]["end"]
    assert not p.errors, f"sends failed: {p.errors[:5]}"
    with BrokerClient(addresses) as reader:
        check_once_in_order(read_back(reader, "t", q), p)


def _ask_move(admin: BrokerClient, q: int) -> threading.Thread:
    t = threading.Thread(target=lambda: admin.move_queue("t", q, "s2", timeout_ms=60_000), daemon=True)
    t.start()
    return t


def test_the_source_master_killed_mid_seal_its_successor_finishes_the_move(spawn: Spawn, etcd: EtcdProcess) -> None:
    a, b = shard_pair(spawn, etcd, "s1", ("a", "b"), master_env={"TIDEMARK_FAILPOINTS": "move_after_seal=exit"})
    c_ = shard_node(spawn, etcd, "s2", "c")
    addresses = [a.address, b.address, c_.address]
    with BrokerClient(addresses) as c, BrokerClient([c_.address]) as admin:
        q = _topic(c)
        with KeyedProducer(c, "t", _key_for(c, "t", q)) as p:
            p.wait_more(30)
            mover = _ask_move(admin, q)
            assert a.wait_exit(30) != 0, "the source master died at the seal"
            mover.join(60)
            assert not mover.is_alive()
            assert owners(c, "t")[q] == "s2"
            wait_master([b])
            p.wait_more(30)
        _check_moved(etcd, q, p, addresses)


def test_the_target_master_killed_before_it_starts_the_queue_its_successor_does(spawn: Spawn,
                                                                               etcd: EtcdProcess) -> None:
    a = shard_node(spawn, etcd, "s1", "a")
    c_, d = shard_pair(spawn, etcd, "s2", ("c", "d"), master_env={"TIDEMARK_FAILPOINTS": "move_before_start=exit"})
    addresses = [a.address, c_.address, d.address]
    with BrokerClient(addresses) as c, BrokerClient([a.address]) as admin:
        q = _topic(c)
        with KeyedProducer(c, "t", _key_for(c, "t", q)) as p:
            p.wait_more(30)
            mover = _ask_move(admin, q)
            assert c_.wait_exit(30) != 0, "the target master died before starting the queue"
            mover.join(60)
            assert not mover.is_alive()
            p.wait_more(30)
        _check_moved(etcd, q, p, addresses)


def _raw_send(node: DaemonProcess, q: int) -> grpc.StatusCode | None:
    try:
        with grpc.insecure_channel(node.address) as ch:
            pb_grpc.BrokerStub(ch).Send(pb.SendRequest(ack=pb.ACK_LEADER, messages=[
                pb.PlainMessage(topic="t", queue_id=q, body=b"stray")]), timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return None


def test_a_deposed_source_master_that_wakes_after_the_switch_writes_nothing(spawn: Spawn, etcd: EtcdProcess) -> None:
    """The source master seals, then freezes (SIGSTOP) before its switch: its slave takes over and
    finishes the move. Woken, the old master's switch is refused by etcd (its leader key is gone),
    and it takes no write for the queue."""
    a, b = shard_pair(spawn, etcd, "s1", ("a", "b"), master_env={"TIDEMARK_FAILPOINTS": "move_after_seal=sleep:3000"})
    c_ = shard_node(spawn, etcd, "s2", "c")
    addresses = [a.address, b.address, c_.address]
    with BrokerClient(addresses) as c, BrokerClient([c_.address]) as admin:
        q = _topic(c)
        with KeyedProducer(c, "t", _key_for(c, "t", q)) as p:
            p.wait_more(30)
            mover = _ask_move(admin, q)
            wait_until(lambda: _moving(etcd, q), 10, "the move asked (sealing)")
            time.sleep(0.5)  # a has sealed and sleeps before its switch
            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            try:
                mover.join(60)
                assert not mover.is_alive() and owners(c, "t")[q] == "s2"
                p.wait_more(30)
            finally:
                a.proc.send_signal(signal.SIGCONT)
            time.sleep(4)  # a wakes, ends its sleep and tries its switch
            assert _raw_send(a, q) is not None, "the deposed master took a write for the moved queue"
            p.wait_more(20)
        _check_moved(etcd, q, p, addresses)
        assert "queue_seal_not_written" in a.tail_log(200) or "queue_sealed" not in a.tail_log(200)


def test_etcd_paused_mid_move_the_move_finishes_when_it_is_back(spawn: Spawn, etcd: EtcdProcess) -> None:
    a = shard_node(spawn, etcd, "s1", "a", env={"TIDEMARK_FAILPOINTS": "move_after_seal=sleep:1000"})
    c_ = shard_node(spawn, etcd, "s2", "c")
    addresses = [a.address, c_.address]
    with BrokerClient(addresses) as c, BrokerClient([c_.address]) as admin:
        q = _topic(c)
        with KeyedProducer(c, "t", _key_for(c, "t", q)) as p:
            p.wait_more(30)
            mover = _ask_move(admin, q)
            wait_until(lambda: _moving(etcd, q), 10, "the move asked (sealing)")
            etcd.pause()
            time.sleep(3)
            etcd.resume()
            mover.join(90)
            wait_until(lambda: owners(c, "t")[q] == "s2", 60, "the move finished")
            wait_master([a])
            wait_master([c_])
            p.wait_more(30, timeout_s=60)
        _check_moved(etcd, q, p, addresses)


def test_a_timer_forward_repeated_after_a_crash_is_stored_once(spawn: Spawn, etcd: EtcdProcess) -> None:
    """The old shard's master dies after the new shard stored its forwarded timers, before it marked
    them forwarded: restarted, it forwards them again, and the new shard stores none twice."""
    a = shard_node(spawn, etcd, "s1", "a", env={"TIDEMARK_FAILPOINTS": "timer_after_forward=exit"})
    b = shard_node(spawn, etcd, "s2", "b")
    with BrokerClient([a.address, b.address]) as c:
        q = _topic(c)
        key = _key_for(c, "t", q)
        due = int(time.time() * 1000) + 2000
        c.send("t", [Message(f"late-{i}".encode(), key=key, deliver_at_ms=due) for i in range(10)], ack="replica")
        c.move_queue("t", q, "s2")
        assert a.wait_exit(30) != 0, "the old master died after its forward"
        a.env = {}
        a.start()
        wait_master([a])

        def late() -> list[bytes]:
            return [m.body for r in c.iter_pull("t", q, 0) for m in r if m.body.startswith(b"late-")]

        wait_until(lambda: "timers_forwarded" in a.tail_log(300), 30, "the restarted master forwarding again")
        assert "stored=0" in a.tail_log(300), "the repeated forward was answered as duplicates"
        time.sleep(1.0)
        assert sorted(late()) == sorted(f"late-{i}".encode() for i in range(10))
        with BrokerClient(a.address) as old:
            assert wait_until(lambda: old.status()["timer_pending"] == 0 or None, 10, "none pending on the old shard")
