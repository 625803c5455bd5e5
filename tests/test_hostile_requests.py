"""One bad request or one bad message must not stall, poison or exhaust the node (issue 35).

Each test names the finding it covers; each failed on the code before the fix. Real daemons on
loopback, called through generated stubs or our client, as an attacker or a careless client would.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import crc32c
import grpc
import pytest

from broker.client import BrokerClient, BrokerError, Message
from broker.logformat import batch as bf
from broker.store import IncomingBatch
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.procs import DaemonProcess
from tests.storeutil import create_topic, open_store
from tests.waits import wait_until

Spawn = Callable[..., DaemonProcess]
TOKEN_OPS = "ops-token-0123456789"
TOKEN_APP = "app-token-0123456789"


def _stub(d: DaemonProcess) -> pb_grpc.BrokerStub:
    return pb_grpc.BrokerStub(grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 256 << 20)]))


def _error(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value


def _raw(topic: str, records: bytes, count: int) -> pb.SendRequest:
    return pb.SendRequest(ack=pb.ACK_FLUSH, batches=[pb.ProduceBatch(topic=topic, records=records, record_count=count,
                                                                    records_crc=crc32c.crc32c(records))])


def _record(key: bytes = b"", props: bytes = b"", body: bytes = b"x") -> bytes:
    return bf.encode_records([(body, key, props)])[0]


def _prop(name: bytes, value: bytes) -> bytes:
    return struct.pack("<H", len(name)) + name + struct.pack("<H", len(value)) + value


# -- findings 1 and 2: sizes the format cannot hold are INVALID_ARGUMENT, fast, and nothing is stored ----------
def test_oversized_keys_and_properties_are_refused_whole_and_fast(daemon: DaemonProcess) -> None:
    stub = _stub(daemon)
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        before = c.status()["max_offset"]
        many = [pb.PlainMessage(topic="t", body=b"m" * 300) for _ in range(20_000)]
        cases = {
            "a 70,000-byte property after 20,000 good messages": [*many, pb.PlainMessage(topic="t", properties={"p": "v" * 70_000})],
            "a 1 MiB key": [pb.PlainMessage(topic="t", key="k" * (1 << 20))],
            "a property name of 65,536 bytes": [pb.PlainMessage(topic="t", properties={"n" * 65_536: "v"})],
            "properties over 65,535 bytes in all": [pb.PlainMessage(topic="t", properties={f"p{i}": "v" * 40_000 for i in range(2)})],
            "a reserved property name": [pb.PlainMessage(topic="t", properties={"__timer_offset": "zz"})],
        }
        for what, messages in cases.items():
            t0 = time.monotonic()
            err = _error(lambda m=messages: stub.Send(pb.SendRequest(ack=pb.ACK_FLUSH, messages=m)))
            took = time.monotonic() - t0
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.details())
            assert took < 3.0, (what, took)  # before: 12.3 s for 5,000 + one, the serving thread held
        assert c.status()["max_offset"] == before  # nothing of any of them stored
    log = Path(daemon.log_path).read_text()
    assert "v" * 1000 not in log and "k" * 1000 not in log and "m" * 1000 not in log  # no contents in the log


def test_an_unexpected_failure_logs_one_bounded_line(tmp_path: Path) -> None:
    """Finding 1: the line an unexpected error logs is bounded and holds none of the request, in
    both log formats (the console renderer printed every local variable, JSON dropped the traceback)."""
    script = """
import sys
from broker.daemon import logsetup
from broker.daemon.failures import REQUEST, unexpected
from proto import tidemark_pb2 as pb
logsetup.configure("info", sys.argv[1])
REQUEST.set(("Send", pb.SendRequest(messages=[pb.PlainMessage(topic="t", body=b"secret" * 1000)] * 500)))
def inner(request):
    raise ValueError("bad " + "x" * 5000)
try:
    inner(REQUEST.get()[1])
except ValueError as exc:
    failure = unexpected(exc)
print(failure.message)
"""
    for fmt in ("console", "json"):
        r = subprocess.run([sys.executable, "-c", script, fmt], capture_output=True, text=True, timeout=60, check=True)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and len(lines[0]) < 1500, (fmt, r.stderr[:2000])
        assert "secret" not in lines[0] and "inner" in lines[0] and "ValueError" in lines[0]
        failure_id = r.stdout.split()[2]
        assert failure_id in lines[0] and "request_bytes" in lines[0]
        if fmt == "json":
            assert json.loads(lines[0])["method"] == "Send"


# -- finding 5: what is stored can always be decoded; what was stored before is read anyway -------------------
def test_records_every_reader_cannot_decode_are_refused(daemon: DaemonProcess) -> None:
    stub = _stub(daemon)
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        before = c.status()["max_offset"]
        bad = {
            "a property value that is not UTF-8": _record(props=_prop(b"p", b"\xff\xfe")),
            "a property name that is not UTF-8": _record(props=_prop(b"\xc3", b"v")),
            "a key that is not UTF-8": _record(key=b"\xed\xa0\x80"),
            "a property name length past the end": _record(props=b"\x10\x00ab"),
            "a reserved property name": _record(props=_prop(b"__timer_offset", b"zz")),
        }
        for what, records in bad.items():
            err = _error(lambda r=records: stub.Send(_raw("t", r, 1)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, err.details())
            assert "record 0" in err.details(), what
        for name, value in (("__deliver_at_ms", "abc"), ("__timer_offset", "zz")):
            err = _error(lambda n=name, v=value: stub.Send(pb.SendRequest(messages=[pb.PlainMessage(topic="t", properties={n: v})])))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "reserved" in err.details()
        assert c.status()["max_offset"] == before


def _count(c: BrokerClient, topic: str) -> int:
    """Messages in queue 0 of ``topic``; 0 while it does not exist."""
    try:
        return len(c.pull(topic, 0, 0))
    except BrokerError as exc:
        if exc.code != grpc.StatusCode.NOT_FOUND:
            raise
        return 0


def _poisoned_directory(path: Path) -> None:
    """A data directory whose topic ``t`` holds, between good messages, records today's send path
    refuses (as a log from before the check, or a peer's, may): read by a daemon afterwards."""
    s = open_store(str(path))
    try:
        create_topic(s, "t")
        items = [(b"good-0", b"", b""),
                 (b"bad-utf8", b"\xff", _prop(b"p", b"\xff\xfe")),
                 (b"bad-numbers", b"", _prop(b"__timer_offset", b"zz") + _prop(b"__deliver_at_ms", b"abc")),
                 (b"bad-length", b"", b"\x10\x00ab"),
                 (b"huge-prop", b"", _prop(b"p", b"\xff" * 65_000)),
                 (b"good-1", b"", _prop(b"q", b"1"))]
        records, _ = bf.encode_records(items)
        _, end = s.appender.append([IncomingBatch("t", 0, records, len(items), crc32c.crc32c(records))], internal=True)
        s.watermarks.wait_ack(end, "flush", 5000)
    finally:
        s.stop()


def test_records_stored_before_the_check_poison_no_reader(spawn: Spawn, tmp_path: Path) -> None:
    """Decoded pull, our client's pull, ``tidemark consume`` and decoded pops read every message;
    dead letters of such messages move to the DLQ and the next message is delivered (finding 6)."""
    _poisoned_directory(tmp_path / "node")
    d = spawn("node", config={"groups.max_deliveries": 1})
    stub = _stub(d)
    bodies = [b"good-0", b"bad-utf8", b"bad-numbers", b"bad-length", b"huge-prop", b"good-1"]
    decoded = stub.Pull(pb.PullRequest(topic="t", queue_id=0, offset=0, decode=True))
    assert [m.body for m in decoded.messages] == bodies
    assert decoded.messages[2].timer_offset == 0 and decoded.messages[2].deliver_at_ms == 0
    assert decoded.messages[1].properties["p"] == "\ufffd\ufffd"
    with BrokerClient(d.address) as c:
        pulled = c.pull("t", 0, 0)
        assert [m.body for m in pulled] == bodies
        assert [m.key for m in pulled][1] == "\ufffd" and pulled[2].timer_offset is None and pulled[3].properties == {}
        consumed = subprocess.run([sys.executable, "-m", "broker.cli", "consume", "t", "--broker", d.address, "--max", "6",
                                   "--timeout-ms", "2000"], capture_output=True, text=True, timeout=60, check=False)
        assert consumed.returncode == 0 and len(consumed.stdout.splitlines()) == 6, consumed.stderr
        popped = stub.Pop(pb.PopRequest(group="g", topic="t", max_messages=10, invisible_ms=1000, decode=True,
                                        start_earliest=True))
        assert [m.body for m in popped.messages] == bodies
        # max_deliveries = 1: once the leases end, every message moves to g.dlq, the odd ones too
        wait_until(lambda: not stub.Pop(pb.PopRequest(group="g", topic="t", max_messages=10, invisible_ms=1000,
                                                      decode=True)).messages and _count(c, "g.dlq") == 6,
                   20, what="all six dead letters in g.dlq")
        dead = c.pull("g.dlq", 0, 0)
        assert [m.body for m in dead] == bodies
        assert dead[4].properties["dlq.properties_dropped"] == str(65_005)  # too big with its origin: dropped, said
        assert dead[5].properties == {"q": "1", "dlq.topic": "t", "dlq.queue": "0", "dlq.offset": "5", "dlq.deliveries": "1"}
        c.send("t", [Message(b"after")], ack="flush")
        after = stub.Pop(pb.PopRequest(group="g", topic="t", max_messages=10, invisible_ms=1000, decode=True, max_wait_ms=5000))
        assert [m.body for m in after.messages] == [b"after"]


# -- finding 11: dead-letter topics are the group's and need the topic-creating role --------------------------------
def _tokens(tmp_path: Path) -> str:
    path = tmp_path / "tokens"
    path.write_text(f"ops admin,system,read,write {TOKEN_OPS}\napp read,write {TOKEN_APP}\n")
    return str(path)


def test_dead_letter_topics_need_the_admin_role_and_take_nothing_else(spawn: Spawn, tmp_path: Path) -> None:
    d = spawn("n", config={"auth.tokens_file": _tokens(tmp_path), "groups.max_deliveries": 1})
    with BrokerClient(d.address, token=TOKEN_OPS) as ops, BrokerClient(d.address, token=TOKEN_APP) as app:
        ops.create_topic("orders")
        ops.create_topic("t")
        app.send("t", [Message(b"m")], ack="flush")
        app.pop("w", "t", invisible_ms=1000, start="earliest")

        def held() -> bool:
            app.pop("w", "t", invisible_ms=1000)
            return bool(ops.status()["errors"].get("dlq", {}).get("active"))

        wait_until(held, 20, what="the dead letter held back for want of w.dlq")
        assert "w.dlq" not in ops.list_topics() and len(app.pop("w", "t", invisible_ms=1000)) == 0  # not delivered again
        with pytest.raises(BrokerError) as refused:  # a DLQ takes only its group's dead letters
            ops.send("w.dlq", [Message(b"mine")])
        assert refused.value.code == grpc.StatusCode.NOT_FOUND
        ops.create_topic("w.dlq")  # the admin creates it: the next pop moves the letter
        with pytest.raises(BrokerError) as mixed:
            ops.send("w.dlq", [Message(b"mine")])
        assert mixed.value.code == grpc.StatusCode.INVALID_ARGUMENT and "dead-letter topic" in mixed.value.details
        wait_until(lambda: len(app.pop("w", "t", invisible_ms=1000)) == 0 and _count(ops, "w.dlq") == 1, 20,
                   what="the held dead letter moved")
        assert not ops.status()["errors"]["dlq"]["active"]


# -- findings 3 and 4: heavy reads and thousands of waiting pops leave health and sends alone ---------------------
def test_waiting_pops_on_a_wide_topic_cost_one_wait_each(daemon: DaemonProcess) -> None:
    stub = _stub(daemon)
    with BrokerClient(daemon.address) as c:
        c.create_topic("wide", queues=1024)
        rss_before = daemon.rss_anon_bytes()
        calls = [stub.Pop.future(pb.PopRequest(group="g", topic="wide", max_wait_ms=20_000)) for _ in range(500)]
        wait_until(lambda: c.status()["long_polls"] >= 500, 20, what="500 parked pops")
        assert c.status()["long_polls"] == 500  # one wait per pop, not one per queue (512,000 before)
        assert daemon.rss_anon_bytes() - rss_before < 100 << 20
        t0 = time.monotonic()
        c.send("wide", [Message(b"x", key="k")], ack="flush")
        assert time.monotonic() - t0 < 1.0
        for f in calls:
            f.cancel()


def test_parked_waits_are_bounded(spawn: Spawn) -> None:
    d = spawn("node", config={"limits.parked_waits_max": 10})
    stub = _stub(d)
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        calls = [stub.Pull.future(pb.PullRequest(topic="t", queue_id=0, offset=0, max_wait_ms=20_000)) for _ in range(10)]
        wait_until(lambda: c.status()["long_polls"] == 10, 20, what="ten parked pulls")
        err = _error(lambda: stub.Pop(pb.PopRequest(group="g", topic="t", max_wait_ms=5000)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "parked_waits_max" in err.details()
        c.create_topic("u")
        c.send("u", [Message(b"waiting")], ack="flush")  # a call with something to read is served, full or not
        assert stub.Pull(pb.PullRequest(topic="u", queue_id=0, offset=0, max_wait_ms=5000)).count == 1
        c.send("t", [Message(b"x")], ack="flush")  # they answer; waiting is possible again
        for f in calls:
            assert f.result(timeout=10).count == 1
        wait_until(lambda: c.status()["long_polls"] == 0, 10, what="the pulls to end")
        stub.Pop(pb.PopRequest(group="g", topic="t", max_wait_ms=100))


def test_decoded_reads_are_capped_and_leave_health_checks_alone(daemon: DaemonProcess) -> None:
    stub = _stub(daemon)
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        for _ in range(10):
            c.send("t", [Message(b"y" * 100)] * 10_000, ack="flush")
        got = stub.Pull(pb.PullRequest(topic="t", queue_id=0, offset=0, max_messages=100_000, decode=True))
        assert len(got.messages) == 10_000 and got.next_offset == 10_000  # limits.pull_decoded_messages_max
        stop = threading.Event()

        def reader() -> None:
            s = _stub(daemon)
            while not stop.is_set():
                s.Pull(pb.PullRequest(topic="t", queue_id=0, offset=0, max_messages=100_000, decode=True))

        readers = [threading.Thread(target=reader) for _ in range(4)]
        for t in readers:
            t.start()
        try:
            health = grpc.insecure_channel(daemon.address).unary_unary("/grpc.health.v1.Health/Check")
            worst = 0.0
            for _ in range(30):
                t0 = time.monotonic()
                health(b"", timeout=10)
                worst = max(worst, time.monotonic() - t0)
            assert worst < 0.5, worst  # before: 1.84 s
        finally:
            stop.set()
            for t in readers:
                t.join()


# -- findings 7, 9, 10: what one caller can make the node keep is bounded ---------------------------------------------
def test_what_a_member_claims_to_hold_is_bounded_by_the_queues_there_are(daemon: DaemonProcess) -> None:
    stub = _stub(daemon)
    with BrokerClient(daemon.address) as c:
        c.create_topic("t", queues=2)
        rss_before = daemon.rss_anon_bytes()
        owned = [pb.QueueRef(topic="x" * 120 + str(i), queue_id=i % 1024) for i in range(65_536)]
        for _ in range(3):
            stub.Heartbeat(pb.HeartbeatRequest(group="g", topics=["t"], owned=owned, session_timeout_ms=600_000))
        assert daemon.rss_anon_bytes() - rss_before < 50 << 20  # before: +360 MB
        described = c.describe_group("g")
        assert all(q["owner"] == "" or q["topic"] == "t" for q in described["queues"])


def test_members_are_bounded_on_the_node_and_keep_only_topics_that_exist(spawn: Spawn) -> None:
    d = spawn("node", config={"groups.members_total_max": 3})
    stub = _stub(d)
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        made_up = [f"x{i}" + "y" * 100 for i in range(999)]
        for group in ("a", "b", "c"):
            stub.Heartbeat(pb.HeartbeatRequest(group=group, topics=["t", *made_up], session_timeout_ms=60_000))
        err = _error(lambda: stub.Heartbeat(pb.HeartbeatRequest(group="d", topics=["t"], session_timeout_ms=60_000)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "members_total_max" in err.details()
        assert all(m["topics"] == ["t"] for g in ("a", "b", "c") for m in c.describe_group(g)["members"])


def test_groups_with_committed_offsets_are_bounded(spawn: Spawn) -> None:
    d = spawn("node", config={"groups.committed_groups_max": 100, "limits.commit_offsets_max": 500})
    stub = _stub(d)
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        c.send("t", [Message(b"x")], ack="flush")
        err = _error(lambda: stub.CommitOffset(pb.CommitOffsetRequest(offsets=[
            pb.CommittedOffset(group=f"g{i}", topic="t", queue_id=0, offset=1) for i in range(501)])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "commit_offsets_max" in err.details()
        stub.CommitOffset(pb.CommitOffsetRequest(offsets=[
            pb.CommittedOffset(group=f"g{i}", topic="t", queue_id=0, offset=1) for i in range(100)]))
        err = _error(lambda: stub.CommitOffset(pb.CommitOffsetRequest(offsets=[
            pb.CommittedOffset(group="new", topic="t", queue_id=0, offset=1)])))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "committed_groups_max" in err.details()
        c.commit_offset("g7", "t", 0, 0)  # a known group still commits
        assert len(c.list_groups()) == 100
        c.create_topic("u")
        c.send("u", [Message(b"x")], ack="flush")
        c.delete_topic("t")  # every offset of the 100 groups was on t: they are forgotten
        wait_until(lambda: not c.list_groups(), 10, what="the groups forgotten with their topic")
        c.commit_offset("new", "u", 0, 1)


def test_total_queues_are_bounded(spawn: Spawn) -> None:
    d = spawn("node", config={"limits.queues_max": 3000})
    with BrokerClient(d.address) as c:
        c.create_topics({f"t{i}": 1024 for i in range(2)})
        with pytest.raises(BrokerError) as refused:
            c.create_topics({"a": 1024, "b": 4})
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queues_max" in refused.value.details
        assert "a" not in c.list_topics()
        c.create_topic("small", queues=900)
    d.stop()
    d.start()  # the count comes back from the metadata view after a restart
    with BrokerClient(d.address) as c, pytest.raises(BrokerError) as again:
        c.create_topic("more", queues=100)
    assert again.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


# -- finding 13: system topics and member ids are not for anyone ------------------------------------------------------
def test_system_topics_and_member_ids_need_their_roles(spawn: Spawn, tmp_path: Path) -> None:
    d = spawn("n", config={"auth.tokens_file": _tokens(tmp_path)})
    with BrokerClient(d.address, token=TOKEN_OPS) as ops, BrokerClient(d.address) as anon, \
            BrokerClient(d.address, token=TOKEN_APP) as app:
        ops.create_topic("t")
        for call in (lambda: anon.offset_for_time("__timer", 0, 0), lambda: anon.describe_topic("__metadata"),
                     lambda: app.describe_topic("__timer")):
            with pytest.raises(BrokerError) as denied:
                call()
            assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED and "system role" in denied.value.details
        ops.offset_for_time("__timer", 0, 0)
        ops.describe_topic("__metadata")
        with app.consumer("g", ["t"]) as member:
            member.poll(timeout_ms=200)
            wait_until(lambda: ops.describe_group("g")["members"], 10, what="the member known")
            real = ops.describe_group("g")["members"][0]["member_id"]
            shown = app.describe_group("g")["members"][0]["member_id"]
            assert real == member.member_id and shown.startswith("h:") and real not in json.dumps(app.describe_group("g"))


def test_refused_requests_are_freed_at_once(daemon: DaemonProcess) -> None:
    """A refused call's request is freed when the call ends, not at the next full collection: grpc's
    ``abort`` kept the refusal's traceback, and with it the request, in a cycle (refused sends of
    6 MB piled up to 1.4 GB between collections under load)."""
    stub = _stub(daemon)
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
    big = pb.SendRequest(messages=[pb.PlainMessage(topic="t", body=b"m" * 4000)] * 1000
                         + [pb.PlainMessage(topic="t", properties={"__x": "y"})])
    _error(lambda: stub.Send(big))  # warm up
    rss_before = daemon.rss_anon_bytes()
    for _ in range(40):
        assert _error(lambda: stub.Send(big)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.rss_anon_bytes() - rss_before < 60 << 20  # 40 x 4 MB stay referenced before the fix
