"""The proto on its own (DESIGN §13): plain messages the server encodes, decoded pulls and the
typed status, called with nothing but generated stubs, against real daemons."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import crc32c
import grpc
import pytest

from broker.client import BrokerClient, Message
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.procs import DaemonProcess
from tests.waits import wait_until


def _stub(d: DaemonProcess) -> pb_grpc.BrokerStub:
    return pb_grpc.BrokerStub(grpc.insecure_channel(d.address))


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value.code()  # type: ignore[no-any-return, attr-defined]


def test_plain_messages_land_where_the_python_client_puts_them(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node")
    stub = _stub(d)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=4)
        resp = stub.Send(pb.SendRequest(ack=pb.ACK_FLUSH, messages=[
            pb.PlainMessage(topic="t", key="k1", body=b"a", properties={"p": "1"}),
            pb.PlainMessage(topic="t", key="k2", body=b"b"),
            pb.PlainMessage(topic="t", key="k1", body=b"c"),
            pb.PlainMessage(topic="t", queue_id=3, body=b"d"),
        ]))
        rs = resp.message_receipts
        assert [r.queue_id for r in rs] == [crc32c.crc32c(b"k1") % 4, crc32c.crc32c(b"k2") % 4,
                                           crc32c.crc32c(b"k1") % 4, 3]
        by_queue: dict[int, list[int]] = {}
        for r in rs:
            by_queue.setdefault(r.queue_id, []).append(r.queue_offset)
        assert all(offs == list(range(len(offs))) for offs in by_queue.values())  # one batch per queue, in order
        ours = c.send("t", [Message(b"e", key="k1")], ack="flush")[0]  # our client picks the same queue
        assert ours.queue_id == rs[0].queue_id and ours.queue_offset == len(by_queue[rs[0].queue_id])
        for r, body in zip(rs, [b"a", b"b", b"c", b"d"], strict=True):  # each receipt names its own record
            (m,) = c.pull("t", r.queue_id, r.queue_offset, max_messages=1)
            assert m.body == body and m.commit_offset == r.commit_offset
        assert c.pull("t", rs[0].queue_id, rs[0].queue_offset, max_messages=1)[0].properties == {"p": "1"}
        keyless = stub.Send(pb.SendRequest(messages=[pb.PlainMessage(topic="t", body=b"x%d" % i) for i in range(5)]))
        assert len({r.queue_id for r in keyless.message_receipts}) == 1  # one queue per call without keys


def test_decoded_pulls_and_plain_timer_messages(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node")
    stub = _stub(d)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(b"m%d" % i, key="k", properties={"i": str(i)}) for i in range(10)], ack="flush")
        r = stub.Pull(pb.PullRequest(topic="t", queue_id=0, offset=3, max_messages=4, decode=True))
        assert not r.batches and r.count == 4 and r.next_offset == 7
        assert [(m.queue_offset, m.body, m.key, dict(m.properties)) for m in r.messages] == \
            [(i, b"m%d" % i, "k", {"i": str(i)}) for i in range(3, 7)]  # from the middle of a batch
        ours = c.pull("t", 0, 3, max_messages=4)
        assert [m.commit_offset for m in r.messages] == [m.commit_offset for m in ours]
        due = int(time.time() * 1000) + 800
        sent = stub.Send(pb.SendRequest(messages=[pb.PlainMessage(topic="t", body=b"later", deliver_at_ms=due,
                                                                  properties={"a": "b"})]))
        (rec,) = sent.message_receipts
        assert rec.queue_offset == -1 and rec.timer_offset == rec.commit_offset > 0 and rec.deliver_at_ms == due
        fired = wait_until(lambda: stub.Pull(pb.PullRequest(topic="t", queue_id=0, offset=10, decode=True,
                                                           max_wait_ms=500)).messages, 10, "the timer message fired")
        (m,) = fired
        assert (m.body, dict(m.properties), m.deliver_at_ms, m.timer_offset) == (b"later", {"a": "b"}, due,
                                                                                  rec.timer_offset)
        assert m.store_time_ms >= due


def test_decoded_pops_are_acked_with_plain_stubs(spawn: Callable[..., DaemonProcess]) -> None:
    """Pop mode without our record format: decoded messages across batches and queues, acked by handle."""
    d = spawn("node")
    stub = _stub(d)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=2)
        for q in range(2):
            for b in range(3):  # three batches a queue
                stub.Send(pb.SendRequest(ack=pb.ACK_FLUSH, messages=[
                    pb.PlainMessage(topic="t", queue_id=q, body=b"q%d-%d-%d" % (q, b, i), key=f"k{i}",
                                    properties={"b": str(b)}) for i in range(4)]))
        got: list[pb.PoppedMessage] = []
        while len(got) < 24:
            r = stub.Pop(pb.PopRequest(group="g", topic="t", max_messages=7, invisible_ms=60_000, start_earliest=True,
                                       decode=True))
            assert r.messages and not r.runs
            got += r.messages
        assert all(not m.record and m.delivery_count == 1 for m in got)
        want = {(q, b * 4 + i): (b"q%d-%d-%d" % (q, b, i), f"k{i}", {"b": str(b)})
                for q in range(2) for b in range(3) for i in range(4)}
        assert {(m.queue_id, m.queue_offset): (m.body, m.key, dict(m.properties)) for m in got} == want
        plain = stub.Pop(pb.PopRequest(group="h", topic="t", max_messages=1, start_earliest=True))
        assert plain.messages[0].record and not plain.messages[0].body  # without decode: the encoded record
        acked = stub.Ack(pb.AckRequest(group="g", receipt_handles=[m.receipt_handle for m in got]))
        assert not acked.results  # every handle acked
        assert not stub.Pop(pb.PopRequest(group="g", topic="t", max_messages=50, decode=True)).messages
        desc = c.describe_group("g")
        assert sum(int(q["in_flight"]) for q in desc["queues"]) == 0


def test_plain_sends_are_idempotent_with_a_producer_id(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node")
    stub = _stub(d)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=2)
        req = pb.SendRequest(producer_id=77, ack=pb.ACK_FLUSH, messages=[
            pb.PlainMessage(topic="t", queue_id=q, sequence=s, body=b"%d-%d" % (q, s)) for q in (0, 1) for s in (0, 1)])
        first = stub.Send(req).message_receipts
        again = stub.Send(req).message_receipts  # a retry of the same call: the original receipts
        assert all(not r.duplicate for r in first) and all(r.duplicate for r in again)
        assert [(r.queue_id, r.queue_offset) for r in again] == [(r.queue_id, r.queue_offset) for r in first]
        assert [len(c.pull("t", q, 0)) for q in (0, 1)] == [2, 2]


def test_bad_plain_messages_are_refused_whole_and_store_nothing(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node")
    stub = _stub(d)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=2)
        before = c.status()["max_offset"]
        good = pb.PlainMessage(topic="t", body=b"ok")

        def send(*bad: pb.PlainMessage, **fields: object) -> grpc.StatusCode:
            return _code(lambda: stub.Send(pb.SendRequest(messages=[good, *bad], **fields)))  # type: ignore[arg-type]

        assert send(pb.PlainMessage(topic="nope", body=b"x")) == grpc.StatusCode.NOT_FOUND
        assert send(pb.PlainMessage(topic="t", queue_id=2, body=b"x")) == grpc.StatusCode.INVALID_ARGUMENT
        assert send(pb.PlainMessage(topic="__timer", body=b"x")) == grpc.StatusCode.INVALID_ARGUMENT
        assert send(pb.PlainMessage(topic="t", body=b"x", deliver_at_ms=-5)) == grpc.StatusCode.INVALID_ARGUMENT
        assert send(pb.PlainMessage(topic="t", body=b"x", deliver_at_ms=int(time.time() * 1000) + 1000,
                                    properties={"__topic": "other"})) == grpc.StatusCode.INVALID_ARGUMENT
        assert send(producer_id=5) == grpc.StatusCode.INVALID_ARGUMENT  # idempotent: queue and sequence needed
        assert send(pb.PlainMessage(topic="t", queue_id=0, sequence=0, body=b"x"),
                    pb.PlainMessage(topic="t", queue_id=0, sequence=2, body=b"y"), producer_id=5) == \
            grpc.StatusCode.INVALID_ARGUMENT  # a gap in one queue's sequence
        assert _code(lambda: stub.Send(pb.SendRequest())) == grpc.StatusCode.INVALID_ARGUMENT
        assert c.status()["max_offset"] == before  # nothing of any refused call was stored


def test_the_typed_status_says_what_the_json_says(spawn: Callable[..., DaemonProcess]) -> None:
    master = spawn("master")
    slave = spawn("slave", config={"node.role": "slave", "node.master": master.address})
    with BrokerClient(master.address) as c:
        c.create_topic("t")
        c.send("t", [Message(b"x", deliver_at_ms=int(time.time() * 1000) + 60_000)], ack="replica")
    wait_until(lambda: _stub(master).Status(pb.StatusRequest()).status.replicas[0].in_sync, 20, "the slave in sync")
    # the timer view counts the timer once it has applied the record (views trail the log; a busy machine shows it)
    wait_until(lambda: _stub(master).Status(pb.StatusRequest()).status.timer_pending == 1, 20, "the timer applied")
    m = _stub(master).Status(pb.StatusRequest())
    st, js = m.status, json.loads(m.json)
    assert st.role == pb.ROLE_MASTER and st.epoch == js["epoch"] == 1
    assert (st.max_offset, st.confirm_offset, st.timer_pending) == (js["max_offset"], js["confirm_offset"], 1)
    assert st.timer_pending_by_topic == {"t": 1} and st.node_id == js["node_id"] and st.cluster_id == js["cluster_id"]
    (rep,) = st.replicas
    assert rep.address == js["replicas"][0]["address"] and rep.acked_offset > 0 and rep.connected
    assert dict(st.views) == js["views"] and st.recovery.new and st.open_files_max == js["open_files"]["max"]
    s = _stub(slave).Status(pb.StatusRequest()).status
    assert s.role == pb.ROLE_SLAVE and s.replication.connected and s.cluster_id == st.cluster_id
    assert s.replication.master == slave_master(slave)


def slave_master(slave: DaemonProcess) -> str:
    return str(json.loads(_stub(slave).Status(pb.StatusRequest()).json)["replication"]["master"])
