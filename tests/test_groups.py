"""Subscribe-mode consumer groups against a real daemon (DESIGN §12): members share the queues, a queue
is never held by two members at once, cooperative members consume every message exactly once, a
killed member's queues move after its session, operator tools and bad input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest

from broker.client import BrokerClient, BrokerError, Consumer, Message
from proto import tidemark_pb2 as pb
from tests.procs import DaemonProcess
from tests.waits import wait_until

CONFIG = {"groups.rejoin_grace_ms": 0, "groups.heartbeat_interval_ms": 500}
QUEUES = 8


class Member:
    """A consumer polling in a thread; records what it consumed and when it took or released queues."""

    def __init__(self, address: str, name: str, events: list[tuple[float, str, str, tuple[str, int]]],
                 consumed: list[tuple[int, int]], session_timeout_ms: int = 3000) -> None:
        self.name = name
        self.client = BrokerClient(address, timeout_s=10)
        self.stop = threading.Event()
        self.consumer = self.client.consumer(
            "g", ["t"], session_timeout_ms=session_timeout_ms, auto_offset_reset="earliest",
            on_assigned=lambda qs: events.extend((time.monotonic(), name, "take", q) for q in qs),
            on_revoked=lambda qs: events.extend((time.monotonic(), name, "release", q) for q in qs))
        self.events = events
        self.consumed = consumed
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            for m in self.consumer.poll(timeout_ms=200):
                self.consumed.append((m.queue_id, m.queue_offset))
            self.consumer.commit()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        now = time.monotonic()
        self.events.extend((now, self.name, "release", q) for q in self.consumer.assignment)
        self.consumer.close()
        self.client.close()


def _never_shared(events: list[tuple[float, str, str, tuple[str, int]]]) -> int:
    """Replay take/release events in time order; fail if a queue is taken while another member holds it."""
    holder: dict[tuple[str, int], str] = {}
    for _, who, what, q in sorted(events):
        if what == "take":
            assert q not in holder, f"{q} taken by {who} while {holder[q]} holds it"
            holder[q] = who
        elif holder.get(q) == who:
            del holder[q]
    return len(events)


def test_members_share_the_queues_and_consume_each_message_once(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    events: list[tuple[float, str, str, tuple[str, int]]] = []
    consumed: list[tuple[int, int]] = []
    sent: list[tuple[int, int]] = []
    stop = threading.Event()
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=QUEUES)

        def produce() -> None:
            with BrokerClient(d.address) as p:
                i = 0
                while not stop.is_set():
                    for r in p.send("t", [Message(b"m%d" % (i + k), key=str(i + k)) for k in range(20)], ack="flush"):
                        sent.append((r.queue_id, r.queue_offset))
                    i += 20
                    time.sleep(0.01)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        a = Member(d.address, "a", events, consumed)
        wait_until(lambda: len(a.consumer.assignment) == QUEUES, 20, "the first member holds every queue")
        b = Member(d.address, "b", events, consumed)
        wait_until(lambda: len(b.consumer.assignment) == QUEUES // 2 == len(a.consumer.assignment), 20, "a and b share")
        x = Member(d.address, "x", events, consumed)
        wait_until(lambda: len(x.consumer.assignment) >= 2, 20, "a third member gets its share")
        desc = c.describe_group("g")
        assert len(desc["members"]) == 3 and desc["rebalances"] >= 2
        owners = Counter(q["owner"] for q in desc["queues"])
        assert sorted(owners.values()) == [2, 3, 3] and "" not in owners
        b.close()  # leaves: its queues move at once, after it committed what it consumed
        wait_until(lambda: len(a.consumer.assignment) + len(x.consumer.assignment) == QUEUES, 20, "b's queues moved")
        stop.set()
        producer.join(30)
        wait_until(lambda: len(consumed) >= len(sent), 30, "everything sent consumed")
        time.sleep(0.5)
        a.close()
        x.close()
    assert _never_shared(events) > QUEUES
    dupes = [k for k, n in Counter(consumed).items() if n > 1]
    assert not dupes, f"{len(dupes)} messages consumed twice, e.g. {dupes[:5]}"
    assert sorted(consumed) == sorted(sent)


MEMBER_SCRIPT = """
import sys, time
from broker.client import BrokerClient
c = BrokerClient(sys.argv[1])
cons = c.consumer("g", ["t"], session_timeout_ms=int(sys.argv[2]), auto_offset_reset="earliest")
while True:
    cons.poll(timeout_ms=200)
    print(len(cons.assignment), flush=True)
"""


def test_a_killed_members_queues_move_after_its_session(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    session_ms = 2000
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=QUEUES)
        proc = subprocess.Popen([sys.executable, "-c", MEMBER_SCRIPT, d.address, str(session_ms)],
                                stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": os.getcwd()})
        try:
            wait_until(lambda: len(c.describe_group("g")["members"]) == 1, 20, "the child joined",
                       transient=lambda exc: isinstance(exc, BrokerError) and exc.code.name == "NOT_FOUND")
            with c.consumer("g", ["t"], session_timeout_ms=session_ms) as cons:
                wait_until(lambda: (cons.poll(timeout_ms=50) or True) and len(cons.assignment) == QUEUES // 2, 20,
                           "shared with the child")
                proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                wait_until(lambda: (cons.poll(timeout_ms=50) or True) and len(cons.assignment) == QUEUES, 20,
                           "the killed member's queues taken over")
                took_s = time.monotonic() - killed
                desc = c.describe_group("g")
                assert [m["member_id"] for m in desc["members"]] == [cons.member_id]
                assert {q["owner"] for q in desc["queues"]} == {cons.member_id}
        finally:
            proc.kill()
            proc.wait()
    # the session (2 s) plus one expiry tick and a heartbeat round; generous for a loaded CI machine
    assert took_s < session_ms / 1000 + 3.0, took_s


def test_reset_offsets_is_refused_while_the_group_is_live(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=2)
        c.send("t", [Message(b"x%d" % i, key=str(i)) for i in range(10)], ack="flush")
        with c.consumer("g", ["t"], auto_offset_reset="earliest") as cons:
            got: list[int] = []
            wait_until(lambda: got.extend(m.queue_offset for m in cons.poll(timeout_ms=100)) or len(got) == 10, 20,
                       "all ten consumed")
            cons.commit()
            with pytest.raises(BrokerError) as exc:
                c.reset_offsets("g", "t", "earliest")
            assert exc.value.code.name == "FAILED_PRECONDITION" and "live members" in exc.value.details
        assert all(q["lag"] == 0 for q in c.describe_group("g")["queues"])
        assert c.reset_offsets("g", "t", "earliest") == {0: 0, 1: 0}
        assert sum(q["lag"] for q in c.describe_group("g")["queues"]) == 10
        assert set(c.reset_offsets("g", "t", "offset:3").values()) <= {3} | {q["max_offset"] for q in
                                                                             c.describe_topic("t")["queues"]}
        listed = {g["name"]: g for g in c.list_groups()}
        assert listed["g"]["members"] == 0 and listed["g"]["topics"] == ["t"]
        topic = c.describe_topic("t")
        assert sum(q["max_offset"] for q in topic["queues"]) == 10 and all(q["bytes"] > 0 for q in topic["queues"])


def test_bad_group_requests_get_clear_codes(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)

        def code(method: str, request: object) -> str:
            with pytest.raises(BrokerError) as exc:
                c._call(method, request, retry=False)
            return exc.value.code.name

        assert code("DescribeGroup", pb.DescribeGroupRequest(group="nobody")) == "NOT_FOUND"
        assert code("DescribeGroup", pb.DescribeGroupRequest(group="")) == "INVALID_ARGUMENT"
        assert code("Heartbeat", pb.HeartbeatRequest(group="g", topics=["t"], session_timeout_ms=1)) == "INVALID_ARGUMENT"
        assert code("Heartbeat", pb.HeartbeatRequest(group="g", topics=["__timer"])) == "INVALID_ARGUMENT"
        assert code("Heartbeat", pb.HeartbeatRequest(group="g\0", topics=["t"])) == "INVALID_ARGUMENT"
        assert code("Heartbeat", pb.HeartbeatRequest(group="g", topics=[])) == "INVALID_ARGUMENT"
        assert code("Heartbeat", pb.HeartbeatRequest(group="g", member_id="x" * 100, topics=["t"])) == "INVALID_ARGUMENT"
        assert code("ResetOffsets", pb.ResetOffsetsRequest(group="g", topic="t", to=pb.RESET_TO_OFFSET, value=-1)) \
            == "INVALID_ARGUMENT"
        assert code("ResetOffsets", pb.ResetOffsetsRequest(group="g", topic="t")) == "INVALID_ARGUMENT"  # to: unset
        assert code("ResetOffsets", pb.ResetOffsetsRequest(group="g", topic="nope", to=pb.RESET_TO_LATEST)) == "NOT_FOUND"
        assert code("DescribeTopic", pb.DescribeTopicRequest(name="nope")) == "NOT_FOUND"
        with pytest.raises(ValueError):
            c.reset_offsets("g", "t", "yesterday")
        assert c.list_groups() == []  # nothing above created any state
        # a heartbeat for a topic that does not exist yet joins, with nothing assigned
        resp = c._call("Heartbeat", pb.HeartbeatRequest(group="g", topics=["later"]))
        assert resp.member_id and not resp.assigned
    assert isinstance(Consumer, type)
