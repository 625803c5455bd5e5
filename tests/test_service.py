"""The gRPC service on a real daemon process: behaviour and status codes for bad input."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable

import crc32c
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from broker.client import BrokerClient, BrokerError, Message
from broker.logformat import batch as bf
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.nodeutil import offsets_recorded
from tests.procs import DaemonProcess, free_port
from tests.waits import holds_for, wait_until


def _stub(d: DaemonProcess) -> pb_grpc.BrokerStub:
    return pb_grpc.BrokerStub(grpc.insecure_channel(d.address))


def _code(fn: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()  # type: ignore[attr-defined, no-any-return]


def test_a_pull_after_an_acknowledged_send_reads_it_however_far_the_views_lag(spawn: Callable[..., DaemonProcess]) -> None:
    """Read-your-writes: every apply round of the views is slowed by 0.8 s, so the queue view lags
    each acknowledged send; a pull right after it (no wait) still returns it, and a pull at the
    offset after its receipt is at the end, not beyond it (seen in CI: a pull found nothing)."""
    d = spawn("node", env={"TIDEMARK_FAILPOINTS": "views_before_apply=sleep:800"})
    with BrokerClient(d.address, timeout_s=20) as c:
        c.create_topic("ryw", queues=1)
        for round_no in range(3):
            receipts = c.send("ryw", [Message(body=b"r%d-%d" % (round_no, i)) for i in range(5)], ack="flush")
            got = c.pull("ryw", 0, receipts[0].queue_offset, max_messages=100)
            assert [m.body for m in got] == [b"r%d-%d" % (round_no, i) for i in range(5)]
            after = c.pull("ryw", 0, receipts[-1].queue_offset + 1)
            assert len(after) == 0 and after.next_offset == receipts[-1].queue_offset + 1


def test_send_pull_roundtrip_with_keys_and_properties(daemon: DaemonProcess) -> None:
    """Messages come back intact, in order, with key, properties and offsets from the receipts."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("orders", queues=4)
        msgs = [Message(body=b"m%d" % i, key=f"k{i % 3}", properties={"i": str(i)}) for i in range(300)]
        receipts = c.send("orders", msgs, ack="flush")
        assert len(receipts) == 300
        for q in range(4):
            mine = [(r, m) for r, m in zip(receipts, msgs, strict=True) if r.queue_id == q]
            got = list(c.pull("orders", q, 0, max_messages=1000))
            assert [m.body for m in got] == [m.body for _, m in mine]
            assert [m.queue_offset for m in got] == [r.queue_offset for r, _ in mine] == list(range(len(mine)))
            assert [m.commit_offset for m in got] == [r.commit_offset for r, _ in mine]
            assert all(g.key == m.key and g.properties == m.properties for g, (_, m) in zip(got, mine, strict=True))
        for r, m in zip(receipts, msgs, strict=True):  # a key always lands on crc32c(key) % queues
            assert m.key is not None and r.queue_id == crc32c.crc32c(m.key.encode()) % 4


def test_ack_modes_and_visibility(daemon: DaemonProcess) -> None:
    """leader, flush and replica all become readable; status offsets are ordered."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        for ack in ("leader", "flush", "replica"):
            c.send("t", [Message(body=ack.encode())], ack=ack)
        wait_until(lambda: len(c.pull("t", 0, 0)) >= 3, 5, "three messages readable", poll_s=0.01)
        assert [m.body for m in c.pull("t", 0, 0)] == [b"leader", b"flush", b"replica"]
        st = c.status()
        assert st["max_offset"] >= st["flushed_offset"] >= st["confirm_offset"] > 0
        for field in ("role", "epoch", "min_offset", "replicas", "tiered_uploaded_offset", "timer_pending"):
            assert field in st


def test_retried_batch_is_stored_once(daemon: DaemonProcess) -> None:
    """The same SendRequest sent twice (a client retry) returns the original receipts."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
    records, _ = bf.encode_records([(b"once", b"", b""), (b"twice?", b"", b"")])
    req = pb.SendRequest(batches=[pb.ProduceBatch(topic="t", queue_id=0, producer_id=42, base_sequence=0,
                                                  record_count=2, records_crc=crc32c.crc32c(records), records=records)],
                         ack=pb.ACK_FLUSH)
    stub = _stub(daemon)
    first = stub.Send(req).receipts[0]
    second = stub.Send(req).receipts[0]
    assert not first.duplicate and second.duplicate
    assert (first.commit_offset, first.base_queue_offset) == (second.commit_offset, second.base_queue_offset)
    out_of_order = pb.SendRequest(batches=[pb.ProduceBatch(
        topic="t", queue_id=0, producer_id=42, base_sequence=7, record_count=2,
        records_crc=crc32c.crc32c(records), records=records)])
    assert _code(lambda: stub.Send(out_of_order)) == grpc.StatusCode.FAILED_PRECONDITION
    with BrokerClient(daemon.address) as c:
        assert [m.body for m in c.pull("t", 0, 0)] == [b"once", b"twice?"]


def test_bad_requests_get_status_codes_and_daemon_survives(daemon: DaemonProcess) -> None:
    """Malformed, unknown and out-of-range requests get clear codes; the daemon keeps serving."""
    stub = _stub(daemon)
    with BrokerClient(daemon.address) as c:
        c.create_topic("t", queues=2)
        c.send("t", [Message(body=b"x", key="a")], ack="flush")
    records, _ = bf.encode_records([(b"x", b"", b"")])
    crc = crc32c.crc32c(records)

    def send(**kw: object) -> None:
        fields: dict[str, object] = {"topic": "t", "queue_id": 0, "record_count": 1, "records_crc": crc, "records": records}
        fields.update(kw)
        stub.Send(pb.SendRequest(batches=[pb.ProduceBatch(**fields)]))  # type: ignore[arg-type]

    cases: list[tuple[Callable[[], object], grpc.StatusCode]] = [
        (lambda: send(topic="nope"), grpc.StatusCode.NOT_FOUND),
        (lambda: send(topic="__metadata"), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: send(queue_id=2), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: send(records_crc=crc ^ 1), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: send(record_count=2), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: send(records=b"\xff" * 11, records_crc=crc32c.crc32c(b"\xff" * 11)), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: send(record_count=0, records=b"", records_crc=0), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.Send(pb.SendRequest()), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.Send(pb.SendRequest(ack=7, batches=[pb.ProduceBatch(topic="t")])), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.Pull(pb.PullRequest(topic="nope")), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.Pull(pb.PullRequest(topic="t", queue_id=9)), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.Pull(pb.PullRequest(topic="t", queue_id=0, offset=10**12)), grpc.StatusCode.OUT_OF_RANGE),
        (lambda: stub.CreateTopic(pb.CreateTopicRequest(name="bad name!")), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.CreateTopic(pb.CreateTopicRequest(name="__mine")), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.CreateTopic(pb.CreateTopicRequest(name="q", queues=100000)), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.CreateTopic(pb.CreateTopicRequest(name="t")), grpc.StatusCode.ALREADY_EXISTS),
        (lambda: stub.DeleteTopic(pb.DeleteTopicRequest(name="nope")), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.DeleteTopic(pb.DeleteTopicRequest(name="__metadata")), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.CommitOffset(pb.CommitOffsetRequest(offsets=[pb.CommittedOffset(group="", topic="t")])),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.CommitOffset(pb.CommitOffsetRequest(offsets=[pb.CommittedOffset(group="g", topic="t", offset=99)])),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.GetOffset(pb.GetOffsetRequest(group="g", topic="nope")), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.CommitOffset(pb.CommitOffsetRequest(offsets=[pb.CommittedOffset(group="g", topic="__metadata")])),
         grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.OffsetForTime(pb.OffsetForTimeRequest(topic="nope")), grpc.StatusCode.NOT_FOUND),
    ]
    for call, code in cases:
        assert _code(call) == code
    # oversized request: beyond limits.request_bytes_max (64 MiB by default)
    big = pb.SendRequest(batches=[pb.ProduceBatch(topic="t", records=b"\0" * (65 << 20))])
    ch = grpc.insecure_channel(daemon.address, options=[("grpc.max_send_message_length", 128 << 20)])
    assert _code(lambda: pb_grpc.BrokerStub(ch).Send(big)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    with BrokerClient(daemon.address) as c:
        assert [m.body for m in c.pull("t", 0, 0)] + [m.body for m in c.pull("t", 1, 0)] == [b"x"]


def test_create_topics_all_or_none(daemon: DaemonProcess) -> None:
    """CreateTopics creates every topic of the call at once, visible on return; an existing or
    repeated name, or a bad one, fails the whole call and creates nothing."""
    stub = _stub(daemon)

    def topics(*names: str) -> pb.CreateTopicsRequest:
        return pb.CreateTopicsRequest(topics=[pb.CreateTopicRequest(name=n, queues=2) for n in names])

    with BrokerClient(daemon.address) as c:
        c.create_topic("old")
        resp = stub.CreateTopics(topics("a", "b", "c"))
        assert [(t.name, t.queues) for t in resp.topics] == [("a", 2), ("b", 2), ("c", 2)]
        c.send("b", [Message(b"at once", key="k")], ack="flush")  # the metadata view applied the batch
        assert _code(lambda: stub.CreateTopics(topics("d", "old"))) == grpc.StatusCode.ALREADY_EXISTS
        assert _code(lambda: stub.CreateTopics(topics("e", "e"))) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: stub.CreateTopics(topics("f", "__g"))) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: stub.CreateTopics(topics())) == grpc.StatusCode.INVALID_ARGUMENT
        c.create_topics({f"m{i}": 1 for i in range(1000)})
        assert sorted(c.list_topics()) == sorted(["old", "a", "b", "c", *(f"m{i}" for i in range(1000))])


def test_long_poll_pull_wakes_on_new_data(daemon: DaemonProcess) -> None:
    """A pull at the queue end waits up to max_wait_ms and returns as soon as data arrives."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        t0 = time.monotonic()
        assert len(c.pull("t", 0, 0, max_wait_ms=300)) == 0
        assert time.monotonic() - t0 >= 0.28

        got: list[list[bytes]] = []
        threading.Thread(target=lambda: got.append([m.body for m in c.pull("t", 0, 0, max_wait_ms=10_000)])).start()
        holds_for(lambda: not got, 0.3, "the pull waiting at the queue end")
        t0 = time.monotonic()
        with BrokerClient(daemon.address) as p:
            p.send("t", [Message(body=b"late")], ack="leader")
        wait_until(lambda: got, 10, "the pull to return")
        assert got == [[b"late"]] and time.monotonic() - t0 < 5


def test_consumer_offsets_and_seek_by_time(daemon: DaemonProcess) -> None:
    """Committed offsets read back at once and survive a kill -9 once their record is flushed."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        c.send("t", [Message(body=b"a")] * 10, ack="flush")
        split_ms = int(time.time() * 1000) + 1  # after the store time of every "a" (same clock)
        wait_until(lambda: time.time() * 1000 >= split_ms, 1, "the wall clock past the split", poll_s=0.001)
        c.send("t", [Message(body=b"b")] * 5, ack="flush")
        assert c.offset_for_time("t", 0, 0) == 0
        assert c.offset_for_time("t", 0, split_ms) == 10
        assert c.offset_for_time("t", 0, split_ms + 10**9) == 15
        assert c.committed_offset("g", "t", 0) is None
        c.commit_offset("g", "t", 0, 7)
        assert c.committed_offset("g", "t", 0) == 7
        wait_until(lambda: offsets_recorded(daemon.address, "g", "t", {0: 7}), 5, "the offsets record flushed")
    daemon.kill9()
    daemon.start()
    with BrokerClient(daemon.address) as c:
        assert c.committed_offset("g", "t", 0) == 7


def test_topic_delete_and_recreate(daemon: DaemonProcess) -> None:
    """A deleted topic's data is gone and a re-created topic starts from offset 0, across restarts."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("t", queues=2)
        c.send("t", [Message(body=b"old")] * 3, ack="flush")
        c.delete_topic("t")
        assert "t" not in c.list_topics()
        c.create_topic("t", queues=1)
        c.send("t", [Message(body=b"new")], ack="flush")
    daemon.kill9()
    daemon.start()
    with BrokerClient(daemon.address) as c:
        assert c.list_topics()["t"]["queues"] == 1
        assert [m.body for m in c.pull("t", 0, 0)] == [b"new"]
        assert "__metadata" in c.list_topics(include_system=True)


def test_health_reflection_and_metrics(spawn: Callable[..., DaemonProcess]) -> None:
    """Health checking says SERVING, reflection lists the service, /metrics has our series."""
    port = free_port()
    d = spawn("m", config={"node.metrics_listen": f"127.0.0.1:{port}"})
    ch = grpc.insecure_channel(d.address)
    resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="tidemark.v1.Broker"))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    answers = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = [s.name for a in answers for s in a.list_services_response.service]
    assert "tidemark.v1.Broker" in names
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        c.send("t", [Message(body=b"x")] * 3, ack="flush")
        c.pull("t", 0, 0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for series in ("tidemark_send_messages_total 3.0", "tidemark_fsync_seconds_bucket", "tidemark_recovery_seconds",
                   "tidemark_pull_messages_total", "tidemark_free_disk_bytes", "tidemark_view_lag_bytes"):
        assert series in text


def test_client_fails_over_to_next_address(daemon: DaemonProcess) -> None:
    """With a dead address first in the list, the client reaches the live one."""
    with BrokerClient([f"127.0.0.1:{free_port()}", daemon.address], timeout_s=5) as c:
        assert c.status()["role"] == "master"


def test_unknown_topic_from_client(daemon: DaemonProcess) -> None:
    """The client reports NOT_FOUND for sends to an unknown topic."""
    with BrokerClient(daemon.address) as c, pytest.raises(BrokerError) as info:
        c.send("missing", [Message(body=b"x")])
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_crash_during_first_start_leaves_a_new_directory(spawn: Callable[..., DaemonProcess]) -> None:
    """A kill during the very first start (identity not yet renamed) does not brick the directory."""
    d = spawn("first", start=False, env={"TIDEMARK_FAILPOINTS": "atomicfile_before_rename=exit"})
    d.start(wait=False)
    assert d.wait_exit(30) == -9
    d.env.pop("TIDEMARK_FAILPOINTS")
    d.start()
    with BrokerClient(d.address) as c:
        assert c.status()["recovery"]["new"] is True


def test_committed_offset_reads_own_latest_commit(spawn: Callable[..., DaemonProcess]) -> None:
    """Across many buffer flushes, a read right after a commit always returns that commit."""
    d = spawn("o", config={"offsets.flush_interval_ms": 2})
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        c.send("t", [Message(body=b"x")] * 300, ack="flush")
        # the views catch up first: the commits below then race with the offsets buffer's flushes alone
        wait_until(lambda: c.list_topics()["t"]["max_offsets"] == [300], 5, "the 300 messages applied by the views")
        for offset in range(1, 301):
            c.commit_offset("g", "t", 0, offset)
            assert c.committed_offset("g", "t", 0) == offset


def test_sigterm_with_long_poll_in_flight_stops_fast(daemon: DaemonProcess) -> None:
    """A consumer waiting in a 30 s long-poll does not hold up a graceful stop."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
    result: list[object] = []

    def poll() -> None:
        try:
            with BrokerClient(daemon.address) as c:
                result.append(len(c.pull("t", 0, 0, max_wait_ms=30_000)))
        except BrokerError as exc:
            result.append(exc)

    t = threading.Thread(target=poll)
    t.start()
    holds_for(lambda: t.is_alive() and not result, 0.3, "the long-poll in flight")
    t0 = time.monotonic()
    assert daemon.stop() == 0
    assert time.monotonic() - t0 < 3.0
    t.join(10)
    assert result == [0]


def test_iter_pull_pipelines_to_the_end(daemon: DaemonProcess) -> None:
    """iter_pull yields every message once, in order, and stops at the queue end."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        for i in range(5):
            c.send("t", [Message(body=b"%d-%d" % (i, j)) for j in range(300)], ack="flush")
        got = [b for r in c.iter_pull("t", 0, 150, max_messages=400) for b in r.bodies()]
    assert got == [b"%d-%d" % (i, j) for i in range(5) for j in range(300)][150:]


def test_a_send_of_many_records_leaves_the_loop_serving(daemon: DaemonProcess) -> None:
    """A send whose checks are long (1,000,000 plain messages, framed in C, and as many receipts:
    ~0.5 s) runs in a pool thread: health checks keep answering meanwhile,
    and every message is stored. On the loop, a check waited 0.85-0.90 s for 200,000 framed in
    Python; in a pool thread the loop still parses the request and shares the interpreter lock:
    0.2-0.4 s (0.39 s once under CI's load), so the bound is 0.6 s."""
    count = 1_000_000
    stub = pb_grpc.BrokerStub(grpc.insecure_channel(daemon.address, options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]))
    with BrokerClient(daemon.address) as c:
        c.create_topic("many")
    request = pb.SendRequest(ack=pb.ACK_FLUSH, messages=[pb.PlainMessage(topic="many", queue_id=0, body=b"x")] * count)
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(daemon.address))
    health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    answered: list[pb.SendResponse] = []
    sender = threading.Thread(target=lambda: answered.append(stub.Send(request, timeout=60)))
    started = time.monotonic()
    sender.start()
    slowest = 0.0
    while sender.is_alive():
        t0 = time.monotonic()
        health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.01)
    sender.join()
    took_s = time.monotonic() - started
    assert answered and len(answered[0].message_receipts) == count
    assert took_s > 0.3, f"the send took {took_s:.2f} s: too short for the checks to mean something"
    assert slowest < 0.6, f"a health check waited {slowest:.2f} s while the big send was checked"
    with BrokerClient(daemon.address) as c:
        assert c.pull("many", 0, count - 1, 10)[0].body == b"x"


def test_status_says_the_framing_walk_is_native(daemon: DaemonProcess) -> None:
    """`make venv` built the C framing walk and the daemon uses it (status ``native_framing``)."""
    with BrokerClient(daemon.address) as c:
        assert c.status()["native_framing"] is True
