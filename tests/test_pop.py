"""Pop mode against a real daemon (DESIGN §12): leases, acks, redelivery after the invisibility
time with the delivery count raised, nack with delay, the DLQ, leases that survive kill -9, and
bad input that changes nothing."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest

from broker.client import BrokerClient, BrokerError, Message
from broker.groups import receipts
from proto import tidemark_pb2 as pb
from tests.procs import DaemonProcess
from tests.waits import wait_until

CONFIG = {"groups.max_deliveries": 3}


def _send(c: BrokerClient, n: int, topic: str = "t") -> None:
    c.send(topic, [Message(b"m%d" % i, key=str(i)) for i in range(n)], ack="flush")


def test_every_message_is_popped_once_by_cooperating_consumers(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=2)
        _send(c, 400)
        seen: list[bytes] = []
        lock = threading.Lock()

        def consume() -> None:
            with BrokerClient(d.address) as cc:
                while True:
                    msgs = cc.pop("g", "t", max_messages=25, invisible_ms=60_000, max_wait_ms=300, start="earliest")
                    if not msgs:
                        return
                    assert all(m.delivery_count == 1 for m in msgs)
                    assert cc.ack("g", msgs) == {}
                    with lock:
                        seen.extend(m.body for m in msgs)

        threads = [threading.Thread(target=consume) for _ in range(5)]  # more consumers than queues
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert Counter(seen) == Counter(b"m%d" % i for i in range(400))  # each exactly once
        desc = c.describe_group("g")
        assert sum(q["in_flight"] for q in desc["queues"]) == 0 and sum(q["lag"] for q in desc["queues"]) == 0
        assert len(c.pop("g", "t", max_wait_ms=0)) == 0
        assert {g["name"] for g in c.list_groups()} == {"g"}


def test_a_lease_comes_back_after_its_time_and_never_after_its_ack(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        first = c.pop("g", "t", max_wait_ms=0)  # a new group starts at the end (latest)
        assert len(first) == 0
        _send(c, 4)
        msgs = c.pop("g", "t", max_messages=4, invisible_ms=1000)
        assert [m.body for m in msgs] == [b"m0", b"m1", b"m2", b"m3"] and {m.delivery_count for m in msgs} == {1}
        assert c.ack("g", msgs[:2]) == {}
        assert len(c.pop("g", "t", max_wait_ms=0)) == 0  # the other two are still leased
        t0 = time.monotonic()
        again = c.pop("g", "t", max_messages=10, invisible_ms=1000, max_wait_ms=5000)  # woken by the expiry
        assert 0.5 < time.monotonic() - t0 < 3.0
        assert [(m.body, m.delivery_count) for m in again] == [(b"m2", 2), (b"m3", 2)]
        refused = c.ack("g", msgs[2:])  # the first leases of these ended: their handles are stale
        assert set(refused) == {m.receipt_handle for m in msgs[2:]} and all("ended" in r for r in refused.values())
        assert c.ack("g", msgs[:1]) != {}  # acked twice: refused, nothing changes
        assert c.ack("g", again) == {}
        time.sleep(1.3)
        assert len(c.pop("g", "t", max_wait_ms=0)) == 0  # acked messages never come back
        assert c.describe_group("g")["redeliveries"] == 2


def test_nack_with_delay_and_change_invisible(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        _send(c, 2)
        a, b = c.pop("g", "t", max_messages=2, invisible_ms=800, start="earliest")
        assert c.nack("g", [a], delay_ms=1500) == {}
        old = b.receipt_handle
        new = c.change_invisible("g", b, invisible_ms=60_000)
        assert new != old and b.receipt_handle == new
        assert c.ack("g", old) != {}  # the old handle stopped working
        time.sleep(1.0)
        assert len(c.pop("g", "t", max_wait_ms=0)) == 0  # a: not before its delay; b: extended
        back = c.pop("g", "t", max_wait_ms=3000)
        assert [(m.body, m.delivery_count) for m in back] == [(b"m0", 2)]
        assert c.ack("g", [b, back[0]]) == {}


def test_messages_go_to_the_dlq_after_max_deliveries(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(b"poison", key="k", properties={"origin": "x"})], ack="flush")
        for n in range(1, 4):
            (m,) = c.pop("g", "t", invisible_ms=1000, max_wait_ms=3000, start="earliest")
            assert m.delivery_count == n
            assert c.nack("g", m) == {}
        assert len(c.pop("g", "t", max_wait_ms=500)) == 0  # the fourth delivery went to the DLQ instead
        (dead,) = c.pull("g.dlq", 0, 0)
        assert dead.body == b"poison" and dead.key == "k"
        assert dead.properties == {"origin": "x", "dlq.topic": "t", "dlq.queue": "0", "dlq.offset": "0",
                                   "dlq.deliveries": "3"}
        assert c.describe_group("g")["dlq_messages"] == 1


def test_leases_survive_kill9(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=2)
        _send(c, 100)
        msgs = c.pop("g", "t", max_messages=100, invisible_ms=2000, start="earliest")
        assert len(msgs) == 100
        assert c.ack("g", msgs[:60]) == {}
        held = c.pop("g", "t", max_wait_ms=0)
        assert len(held) == 0
    d.kill9()
    d.start()
    with BrokerClient(d.address) as c:
        assert c.ack("g", msgs[:60]) != {}  # still acked after the crash
        back: list[bytes] = []
        wait_until(lambda: back.extend(m.body for m in c.pop("g", "t", max_messages=100, max_wait_ms=500)) or
                   len(back) >= 40, 10, "the 40 unacked messages come back")
        assert sorted(back) == sorted(m.body for m in msgs[60:])  # the unacked ones, none of the acked
        desc = c.describe_group("g")
        assert sum(q["in_flight"] for q in desc["queues"]) == 40 and desc["redeliveries"] == 40


def test_bad_pop_requests_get_clear_codes_and_change_nothing(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        _send(c, 3)
        (m,) = c.pop("g", "t", max_messages=1, invisible_ms=60_000, start="earliest")

        def code(method: str, request: object) -> str:
            with pytest.raises(BrokerError) as exc:
                c._call(method, request, retry=False)
            return exc.value.code.name

        assert code("Pop", pb.PopRequest(group="g", topic="nope", invisible_ms=1000)) == "NOT_FOUND"
        assert code("Pop", pb.PopRequest(group="bad group", topic="t")) == "INVALID_ARGUMENT"
        assert code("Pop", pb.PopRequest(group="g", topic="t", invisible_ms=10**9)) == "INVALID_ARGUMENT"
        assert code("Pop", pb.PopRequest(group="g", topic="__pop")) == "INVALID_ARGUMENT"
        assert code("Ack", pb.AckRequest(group="g", receipt_handles=["garbage"])) == "INVALID_ARGUMENT"
        assert code("Ack", pb.AckRequest(group="g", receipt_handles=[])) == "INVALID_ARGUMENT"
        h = receipts.decode(m.receipt_handle)
        other_cluster = receipts.encode(h._replace(cluster=h.cluster ^ 1))
        future_epoch = receipts.encode(h._replace(epoch=h.epoch + 5))
        forged = receipts.encode(h._replace(tag=h.tag ^ 0xFFFF))
        assert code("Ack", pb.AckRequest(group="g", receipt_handles=[other_cluster])) == "INVALID_ARGUMENT"
        assert code("Ack", pb.AckRequest(group="g", receipt_handles=[m.receipt_handle, future_epoch])) == \
            "INVALID_ARGUMENT"
        assert code("Nack", pb.NackRequest(group="g", receipt_handles=[m.receipt_handle], delay_ms=10**9)) == \
            "INVALID_ARGUMENT"
        assert code("ChangeInvisible", pb.ChangeInvisibleRequest(group="g", receipt_handle=forged,
                                                                 invisible_ms=1000)) == "FAILED_PRECONDITION"
        huge_run = receipts.encode(h._replace(length=1 << 31))  # would name 2^31 offsets: refused before expanding
        assert code("Ack", pb.AckRequest(group="g", receipt_handles=[huge_run])) == "INVALID_ARGUMENT"
        assert code("ChangeInvisible", pb.ChangeInvisibleRequest(group="g", receipt_handle=receipts.encode(
            h._replace(length=2)), invisible_ms=1000)) == "INVALID_ARGUMENT"  # one message, not a run
        assert set(c.ack("g", [forged])) == {forged}  # refused per handle
        assert set(c.ack("other", [m.receipt_handle])) == {m.receipt_handle}  # another group's lease
        # nothing changed: the genuine lease is still held and acks once
        assert sum(q["in_flight"] for q in c.describe_group("g")["queues"]) == 1
        assert c.ack("g", m) == {}


def test_a_pop_answers_runs_with_one_handle_each_and_messages_to_plain_clients(
        spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=2)
        _send(c, 100)
        got = c.pop("g", "t", max_messages=60, invisible_ms=60_000, start="earliest")
        assert len(got) == 60 and len(got.receipt_handles()) == len(got.runs) <= 2  # fresh: one run per queue
        assert sorted(got.bodies()) == sorted(m.body for m in got)
        for run in got.runs:  # a run's messages are its adjacent offsets, and each names itself
            ms = [m for m in got if m.queue_id == run.queue_id]
            assert [m.queue_offset for m in ms] == list(range(run.first_offset, run.first_offset + run.count))
            assert {receipts.decode(m.receipt_handle).length for m in ms} == {1}
        single = got[5]
        assert c.ack("g", single) == {}
        refused = c.ack("g", got)  # every lease of it, one handle a run: all but the one acked before
        run_of_single = next(r.receipt_handle for r in got.runs if r.queue_id == single.queue_id)
        assert list(refused) == [run_of_single] and refused[run_of_single].startswith("1 of the run's")
        assert c.ack("g", [m for m in got if m is not single]) != {}  # all acked now: stale
        # a client that knows only the proto's plain fields gets one PoppedMessage each
        resp = c._call("Pop", pb.PopRequest(group="g", topic="t", max_messages=100, invisible_ms=60_000))
        assert len(resp.messages) == 40 and not resp.runs
        bodies = {bytes(m.record) for m in resp.messages}
        assert len(bodies) == 40 and all(m.delivery_count == 1 for m in resp.messages)
        assert c.ack("g", [m.receipt_handle for m in resp.messages]) == {}
        assert len(c.pop("g", "t", max_wait_ms=0)) == 0
        desc = c.describe_group("g")
        assert sum(q["in_flight"] for q in desc["queues"]) == 0 and sum(q["lag"] for q in desc["queues"]) == 0


def test_a_pop_is_bounded_by_pull_bytes_max_and_leases_only_what_it_answers(
        spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config={**CONFIG, "limits.pull_bytes_max": 64 * 1024})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        for i in range(10):  # 10 batches of 10 x 2 KiB
            c.send("t", [Message(b"%d-%d-" % (i, j) + b"x" * 2048) for j in range(10)], ack="flush")
        got = c.pop("g", "t", max_messages=100, invisible_ms=60_000, start="earliest")
        assert 20 <= len(got) < 100  # about 64 KiB of batches, whole batches
        rest = c.pop("g", "t", max_messages=100, invisible_ms=60_000)
        assert {m.queue_offset for m in got}.isdisjoint(m.queue_offset for m in rest)
        assert len(got) + len(rest) <= 100 and c.ack("g", got) == {} and c.ack("g", rest) == {}


def test_the_first_pop_fixes_where_the_group_starts_on_every_queue(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=4)
        _send(c, 200)
        first = c.pop("g", "t", max_messages=10, invisible_ms=60_000, start="earliest")  # filled from one queue
        assert len(first) == 10
        rest: list[bytes] = []
        wait_until(lambda: rest.extend(c.pop("g", "t", max_messages=500).bodies()) or len(rest) >= 190, 10,
                   "the rest, from the earliest offset of every queue")  # later pops' start= no longer counts
        assert sorted(rest + [m.body for m in first]) == sorted(b"m%d" % i for i in range(200))
