"""Moving a queue between shards (DESIGN §15, docs/shards.md "Moving a queue"): the queue's segment
is sealed where it is and continues on the target at the same logical offset, no data copied; real
daemons, a real etcd."""

from __future__ import annotations

import time

import grpc
import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, BrokerError, FailedPrecondition, Message, NotFound
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.failoverutil import Spawn, sent_once_placed
from tests.moveutil import KeyedProducer, check_once_in_order, owners, read_back, shard_node
from tests.procs import DaemonProcess
from tests.test_shards import _key_for
from tests.waits import wait_until


def _single(spawn: Spawn, etcd: EtcdProcess, shard: str, name: str) -> DaemonProcess:
    return shard_node(spawn, etcd, shard, name)


_owners = owners


def _s1_queue(c: BrokerClient) -> int:
    """Topic t of two queues, created on both shards; the queue s1 writes."""
    c.create_topic("t", queues=2)
    wait_until(lambda: sent_once_placed(c, "t", [Message(b"x", key=str(q)) for q in range(8)]), 15, "queues created")
    return _owners(c, "t").index("s1")


def test_a_queue_moves_under_load_and_back_losing_and_repeating_nothing(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A keyed ack=replica producer sends throughout two moves (s1 -> s2 -> s1): every acknowledged
    message is read back once, in order, at the queue offset its receipt gave; offsets continue
    across the segments, and a group's committed offset resumes where it was."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c, BrokerClient(nodes["s2"].address) as admin:
        c.create_topic("t", queues=2)
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"probe", key=str(q)) for q in range(8)]), 15,
                   "every queue created")
        q = _owners(c, "t").index("s1")
        with KeyedProducer(c, "t", _key_for(c, "t", q)) as p:
            p.wait_more(50)
            admin.commit_offset("g", "t", q, 20)
            first = admin.move_queue("t", q, "s2")
            assert [(s["shard"], s["state"]) for s in first] == [("s1", "ro"), ("s2", "rw")]
            end1 = first[0]["end"]
            assert first[1]["logical_start"] == end1 and end1 >= 50
            p.wait_more(50)
            back = admin.move_queue("t", q, "s1")
            assert [(s["shard"], s["logical_start"]) for s in back] == [("s1", 0), ("s2", end1), ("s1", back[1]["end"])]
            p.wait_more(50)
        assert not p.errors, f"sends failed across the moves: {p.errors[:5]}"
        assert _owners(c, "t")[q] == "s1" and admin.cluster_status()["moves"] == []
        with BrokerClient(nodes["s2"].address) as reader:  # a fresh client, bootstrapped from the other shard
            read = read_back(reader, "t", q)
            check_once_in_order(read, p)
            assert reader.committed_offset("g", "t", q) == 20
            mid = reader.pull("t", q, end1, max_messages=1)  # a read inside the middle segment goes to s2
            assert [(m.queue_offset, m.body) for m in mid] == [read[end1]]


def test_a_move_is_refused_clearly_and_asking_twice_is_harmless(spawn: Spawn, etcd: EtcdProcess) -> None:
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c:
        c.create_topic("t", queues=2)
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"x", key=str(q)) for q in range(8)]), 15, "queues created")
        with pytest.raises(NotFound):
            c.move_queue("nope", 0, "s2")
        with pytest.raises(BrokerError) as exc:
            c.move_queue("t", 7, "s2")
        assert exc.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(FailedPrecondition) as refused:
            c.move_queue("t", 0, "s9")
        assert "s9" in refused.value.details and "s1, s2" in refused.value.details
        owner = _owners(c, "t")[0]
        assert c.move_queue("t", 0, owner) == [{"shard": owner, "logical_start": 0, "end": None, "state": "rw"}]
        other = "s2" if owner == "s1" else "s1"
        started = time.monotonic()
        moved = c.move_queue("t", 0, other)
        assert moved == c.move_queue("t", 0, other), "asked again once done: the same answer, nothing moved"
        assert time.monotonic() - started < 10
        assert _owners(c, "t")[0] == other


def _send_plain(node: DaemonProcess, topic: str, queue: int, producer: int, sequence: int, body: bytes) -> pb.MessageReceipt:
    with grpc.insecure_channel(node.address) as ch:
        resp = pb_grpc.BrokerStub(ch).Send(pb.SendRequest(ack=pb.ACK_REPLICA, producer_id=producer, messages=[
            pb.PlainMessage(topic=topic, queue_id=queue, body=body, sequence=sequence)]), timeout=10)
    return resp.message_receipts[0]


def test_a_send_retried_across_the_move_is_stored_once(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A send stored just before the seal whose answer was lost, retried on the new shard with the
    same producer id and sequence, is answered as the duplicate it is (the move carried the queue's
    producers); the producer's next sequence is taken there."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c:
        q = _s1_queue(c)
        pid = 0x5EED
        first = [_send_plain(nodes["s1"], "t", q, pid, seq, f"p{seq}".encode()) for seq in range(3)]
        c.move_queue("t", q, "s2")
        again = _send_plain(nodes["s2"], "t", q, pid, 2, b"p2")  # the retry of the last one
        assert again.duplicate and again.queue_offset == first[2].queue_offset
        with pytest.raises(grpc.RpcError) as gap:  # a sequence that skips one is refused there as it was on s1
            _send_plain(nodes["s2"], "t", q, pid, 4, b"p4")
        assert gap.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        nxt = _send_plain(nodes["s2"], "t", q, pid, 3, b"p3")
        assert not nxt.duplicate and nxt.queue_offset == first[2].queue_offset + 1
        bodies = [m.body for r in c.iter_pull("t", q, 0) for m in r]
        assert [b for b in bodies if b.startswith(b"p")] == [b"p0", b"p1", b"p2", b"p3"]
        # the writer's segment starts at the cut (describe_topic); the queue's earliest offset is its first's
        row = next(r for r in c.describe_topic("t")["queues"] if r["queue_id"] == q)
        assert row["min_offset"] > 0 and c.earliest_offset("t", q) == 0


def test_timers_due_after_the_move_fire_once_on_the_new_shard(spawn: Spawn, etcd: EtcdProcess) -> None:
    """Timer messages scheduled on the old shard, due after their queue moved: delivered once each
    into the queue on its new shard (forwarded), with their properties; none left pending."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c:
        q = _s1_queue(c)
        key = _key_for(c, "t", q)
        due = int(time.time() * 1000) + 3000
        c.send("t", [Message(f"late-{i}".encode(), key=key, properties={"n": str(i)}, deliver_at_ms=due + 10 * i)
                     for i in range(20)], ack="replica")
        c.move_queue("t", q, "s2")
        expected = {f"late-{i}".encode(): str(i) for i in range(20)}

        def delivered() -> list[tuple[bytes, str]]:
            return [(m.body, m.properties.get("n", "")) for r in c.iter_pull("t", q, 0) for m in r
                    if m.body.startswith(b"late-")]

        wait_until(delivered, 30, "the timers delivered on the new shard", accept=lambda d: len(d) >= 20)
        time.sleep(1.5)  # a second forward of the same timers would show now
        got = delivered()
        assert sorted(got) == sorted(expected.items()), "each timer once, with its properties"
        assert wait_until(lambda: c.status()["timer_pending"] == 0 or None, 10, "none pending on the old shard")


def test_a_transaction_open_across_the_move_commits_or_aborts_on_both_segments(spawn: Spawn,
                                                                             etcd: EtcdProcess) -> None:
    """A transaction sends to the queue, the queue moves, it sends to it again (now on the new
    shard, a second participant): its commit makes both parts visible at once, in order across the
    segments; an abort, neither. The seal does not wait for the transaction (its first part stays
    invisible on the old segment until it ends)."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c:
        q = _s1_queue(c)
        key = _key_for(c, "t", q)

        def committed() -> list[bytes]:
            return [m.body for r in c.iter_pull("t", q, 0) for m in r if m.body.startswith(b"tx")]

        for commit, to in ((True, "s2"), (False, "s1")):
            tx = c.begin_transaction(f"mover-{commit}")
            tx.send("t", [Message(f"tx-{commit}-before".encode(), key=key)])
            c.move_queue("t", q, to)
            tx.send("t", [Message(f"tx-{commit}-after".encode(), key=key)])
            assert not any(b.startswith(f"tx-{commit}".encode()) for b in committed()), "invisible while open"
            if commit:
                tx.commit()
            else:
                tx.abort()
        assert committed() == [b"tx-True-before", b"tx-True-after"]


def test_pop_leases_taken_before_the_move_are_acked_after_it_and_nothing_is_lost(spawn: Spawn,
                                                                                etcd: EtcdProcess) -> None:
    """A pop group leases part of a queue, the queue moves: the leases taken before are acked after
    the move (on the old segment's shard), the rest of the old segment is still leased from there,
    the new segment from the new shard; every message acked once, none left."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c:
        c.create_topic("t", queues=1)
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"probe")]), 15, "the queue created")
        c.send("t", [Message(f"old-{i}".encode()) for i in range(60)], ack="replica")
        first = c.pop("g", "t", max_messages=20, invisible_ms=60_000, start="earliest")
        assert len(first) == 20
        early = c.pop("g", "t", max_messages=10, invisible_ms=60_000)
        assert not c.ack("g", early), "acked before the move"
        other = "s2" if _owners(c, "t")[0] == "s1" else "s1"
        c.move_queue("t", 0, other)
        c.send("t", [Message(f"new-{i}".encode()) for i in range(40)], ack="replica")
        assert not c.ack("g", first), "leases taken before the move, acked after it"
        acked = [m.body for m in [*first, *early]]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = c.pop("g", "t", max_messages=50, invisible_ms=60_000, max_wait_ms=200)
            if not len(got):
                if len(acked) >= 101:
                    break
                continue
            assert not c.ack("g", got)
            acked += [m.body for m in got]
        everything = sorted([b"probe", *(f"old-{i}".encode() for i in range(60)), *(f"new-{i}".encode() for i in range(40))])
        assert sorted(acked) == everything, "every message acked once"
        late: list[bytes] = []  # a group that first pops after the move, from the earliest: both segments
        while time.monotonic() < deadline + 30:
            got = c.pop("late", "t", max_messages=50, invisible_ms=60_000, max_wait_ms=200, start="earliest")
            if not len(got) and len(late) >= len(everything):
                break
            assert not c.ack("late", got)
            late += [m.body for m in got]
        assert sorted(late) == everything, "a new group reads the old segment too, each message once"


def test_an_empty_queue_moved_away_and_back_takes_writes_again(spawn: Spawn, etcd: EtcdProcess) -> None:
    """Sealed at offset 0 and back at offset 0: the returning segment lifts the old seal."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c:
        c.create_topic("t", queues=2)
        owner = _owners(c, "t")[0]
        other = "s2" if owner == "s1" else "s1"
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"x", key=_key_for(c, "t", 1))]), 15, "queue 1 created")
        there = c.move_queue("t", 0, other)
        back = c.move_queue("t", 0, owner)
        assert [(s["shard"], s["logical_start"], s["end"]) for s in back] == [(owner, 0, 0), (other, 0, 0), (owner, 0, None)]
        assert there[-1]["shard"] == other
        r = c.send("t", [Message(b"home again", key=_key_for(c, "t", 0))], ack="replica")
        assert r[0].queue_offset == 0


def test_a_subscribed_group_reads_on_through_the_move_and_resumes_exactly(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A subscribe-mode member reads a queue while it moves: every message once, in order; a new
    member after a restart resumes exactly at the committed offset, on the new segment."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c, BrokerClient(nodes["s2"].address) as admin:
        c.create_topic("t", queues=1)
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"m-probe")]), 15, "the queue created")
        other = "s2" if _owners(c, "t")[0] == "s1" else "s1"
        seen: list[tuple[int, bytes]] = []
        with KeyedProducer(c, "t", "k") as p, c.consumer("readers", "t", auto_offset_reset="earliest",
                                                         session_timeout_ms=3000) as member:
            def read_some(n: int) -> None:
                target = len(seen) + n
                deadline = time.monotonic() + 30
                while len(seen) < target and time.monotonic() < deadline:
                    seen.extend((m.queue_offset, m.body) for m in member.poll(200))
                member.commit()

            p.wait_more(30)
            read_some(20)
            admin.move_queue("t", 0, other)
            p.wait_more(30)
            read_some(len(p.acked) - len(seen) + 1)
        committed = c.committed_offset("readers", "t", 0)
        assert committed == seen[-1][0] + 1
        assert [o for o, _ in seen] == list(range(len(seen))), "each message once, in order, across the move"
        assert [x for x in seen if x[1].startswith(b"m0")] == p.acked[:len([x for x in seen if x[1].startswith(b"m0")])]
        c.send("t", [Message(b"m-after", key="k")], ack="replica")  # at least one past the committed offset
        with c.consumer("readers", "t", session_timeout_ms=3000) as again:  # resumes exactly where it committed
            got: list[int] = []
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                got = [m.queue_offset for m in again.poll(200)]
            assert got and got[0] == committed


def test_a_timer_scheduled_before_the_move_is_cancelled_by_its_receipt_after_it(spawn: Spawn,
                                                                               etcd: EtcdProcess) -> None:
    """The receipt names the shard that holds the timer: the cancel goes there after the queue
    moved away, and the timer never fires on either shard."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s2"].address) as c:
        q = _s1_queue(c)
        due = int(time.time() * 1000) + 2500
        receipts = c.send("t", [Message(f"late-{i}".encode(), key=_key_for(c, "t", q), deliver_at_ms=due)
                                for i in range(2)], ack="replica")
        assert receipts[0].shard == "s1"
        c.move_queue("t", q, "s2")
        assert c.cancel_timer(receipts[0])["deliver_at_ms"] == due
        time.sleep(4.0)
        bodies = [m.body for r in c.iter_pull("t", q, 0) for m in r if m.body.startswith(b"late-")]
        assert bodies == [b"late-1"], "the cancelled one never fired; the other was forwarded"


def _drain(c: BrokerClient, group: str, start: str, want: int, topic: str = "t", limit_s: float = 30) -> list[bytes]:
    """Pop and ack ``group``'s messages until ``want`` are acked and a pop finds nothing more."""
    acked: list[bytes] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        got = c.pop(group, topic, max_messages=50, invisible_ms=60_000, max_wait_ms=200, start=start)
        if not len(got):
            if len(acked) >= want:
                break
            continue
        assert not c.ack(group, got)
        acked += [m.body for m in got]
    return acked


def _popped_once(c: BrokerClient, group: str, topic: str) -> bool:
    """A pop of a placed topic; False while a shard's log does not hold it yet."""
    try:
        c.pop(group, topic, max_messages=1, invisible_ms=60_000, start="earliest")
    except BrokerError as exc:
        if exc.code.name != "UNAVAILABLE":
            raise
        return False
    return True


def test_pops_on_a_queue_moved_away_and_back_skip_the_other_shards_segment(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A queue moves s1 -> s2 -> s1: s1 holds two segments with s2's between them. A group's
    window begun on the first segment goes on over the third (the second's offsets are s2's
    to lease, never s1's), leases taken before both moves still open when it crosses the gap;
    s2 begins that group's window at its segment's start although it never popped there while
    the queue was there (the move carried its name), also for a queue empty when it first moved;
    a group that began on s2's segment (from the latest) goes on over s1's new segment, never the
    first one; a new group from the earliest reads every segment; every message acked once."""
    nodes = {"s1": _single(spawn, etcd, "s1", "a"), "s2": _single(spawn, etcd, "s2", "b")}
    with BrokerClient(nodes["s1"].address) as c:
        c.create_topic("t", queues=1)
        c.create_topic("e", queues=1)
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"probe")]), 15, "the queue created")
        wait_until(lambda: _popped_once(c, "g", "e"), 15, "e's queue created, g's window on it begun (empty)")
        home = _owners(c, "t")[0]
        away = "s2" if home == "s1" else "s1"
        e_home = _owners(c, "e")[0]
        e_away = "s2" if e_home == "s1" else "s1"
        old = [f"old-{i}".encode() for i in range(60)]
        c.send("t", [Message(b) for b in old], ack="replica")
        first = c.pop("g", "t", max_messages=20, invisible_ms=60_000, start="earliest")
        assert len(first) == 20
        c.move_queue("t", 0, away)
        assert c.move_queue("e", 0, e_away)[-1]["logical_start"] == 0, "e moved empty"
        assert not len(c.pop("m", "t", max_messages=50, invisible_ms=60_000)), "m begins on the away segment"
        mid = [f"mid-{i}".encode() for i in range(40)]
        c.send("t", [Message(b) for b in mid], ack="replica")
        c.send("e", [Message(b) for b in mid[:10]], ack="replica")
        c.move_queue("t", 0, home)
        c.move_queue("e", 0, e_home)
        new = [f"new-{i}".encode() for i in range(30)]
        c.send("t", [Message(b) for b in new], ack="replica")
        c.send("e", [Message(b) for b in new[:5]], ack="replica")
        everything = sorted([b"probe", *old, *mid, *new])
        acked = [m.body for m in first]
        while len(acked) < len(everything):  # the leases taken before both moves still open
            more = c.pop("g", "t", max_messages=100, invisible_ms=60_000)
            if not len(more):
                break
            assert not c.ack("g", more)
            acked += [m.body for m in more]
        assert not c.ack("g", first), "leases taken before both moves, acked after them"
        acked += _drain(c, "g", "latest", 0)
        assert sorted(acked) == everything, "every message acked once"
        assert sorted(_drain(c, "g", "latest", 15, "e")) == sorted([*mid[:10], *new[:5]]), \
            "a queue empty when it first moved: its away segment is read too"
        assert sorted(_drain(c, "m", "latest", len(mid) + len(new))) == sorted([*mid, *new]), \
            "a group begun on the away segment reads on over the home one, never the first"
        assert sorted(_drain(c, "late", "earliest", len(everything))) == everything, \
            "a new group from the earliest reads every segment once"
