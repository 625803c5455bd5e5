"""Local reads (broker/client/local_reads.py): a reader on the node's host preads the batches a
``PullLocal`` names, gets exactly what ``Pull`` answers, and falls back to gRPC whenever it cannot
be sure of the files: another node's files at the path, a segment gone, a range in tiered storage."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from broker.client import BrokerClient, BrokerError, Message
from broker.client import local_reads as lr
from broker.client.local_reads import LocalPullResponse, SegmentFiles
from broker.storage import instance
from proto import tidemark_pb2 as pb
from tests.nodeutil import status
from tests.procs import DaemonProcess
from tests.tieredutil import caught_up, tiered_config
from tests.waits import wait_until

SMALL_SEGMENTS = {"commitlog.segment_bytes": 64 * 1024}


@pytest.fixture(autouse=True)
def _forget_remote_addresses() -> Iterator[None]:
    lr._NOT_LOCAL.clear()
    yield
    lr._NOT_LOCAL.clear()


def _fill(address: str, queues: int = 3, sends: int = 40, per_send: int = 25) -> dict[int, list[bytes]]:
    """Interleaved sends over ``queues`` queues (so a queue's batches are not adjacent in the log)."""
    sent: dict[int, list[bytes]] = {q: [] for q in range(queues)}
    with BrokerClient(address) as c:
        c.create_topic("t", queues=queues)
        for i in range(sends):  # keyless: each send goes to the next queue
            bodies = [b"%05d-%02d-" % (i, k) + os.urandom(200) for k in range(per_send)]
            receipts = c.send("t", [Message(body=b, properties={"k": str(k)}) for k, b in enumerate(bodies)], ack="flush")
            sent[receipts[0].queue_id] += bodies
    return sent


def _local(result: object) -> bool:
    return isinstance(result._response, LocalPullResponse)  # type: ignore[attr-defined]


def test_local_pulls_answer_what_pulls_answer(spawn: Callable[..., DaemonProcess]) -> None:
    """Across segment boundaries, from the middle of a batch, one pull at a time and pipelined:
    the same records, keys and offsets as Pull, read from the segment files."""
    d = spawn("n", config=SMALL_SEGMENTS)
    sent = _fill(d.address)
    with BrokerClient(d.address) as c:
        for q, bodies in sent.items():
            for offset, n in ((0, 1000), (7, 40), (233, 500), (len(bodies) - 3, 10)):
                remote = c.pull("t", q, offset, max_messages=n)
                local = c.pull("t", q, offset, max_messages=n, local_reads=True)
                assert _local(local) and not _local(remote)
                assert local.bodies() == remote.bodies() == bodies[offset : offset + n]
                assert [m.properties for m in local] == [m.properties for m in remote]
                assert [m.queue_offset for m in local] == list(range(offset, min(offset + n, len(bodies))))
                assert (local.next_offset, local.min_offset, local.max_offset) == \
                       (remote.next_offset, remote.min_offset, remote.max_offset)
            streamed = list(c.iter_pull("t", q, 0, max_messages=64, local_reads=True))
            assert all(_local(r) for r in streamed)
            assert [b for r in streamed for b in r.bodies()] == bodies
        end = c.pull("t", 0, len(sent[0]), local_reads=True)
        assert len(end) == 0 and end.next_offset == len(sent[0])
        with pytest.raises(BrokerError) as info:
            c.pull("t", 0, len(sent[0]) + 1, local_reads=True)
        assert info.value.code == grpc.StatusCode.OUT_OF_RANGE


def test_spans_name_the_nodes_segment_files(spawn: Callable[..., DaemonProcess]) -> None:
    """PullLocal's answer: absolute paths of segment files in the node's log directory, and the
    token its instance file holds."""
    d = spawn("n", config=SMALL_SEGMENTS)
    _fill(d.address, queues=1, sends=20)
    channel = grpc.insecure_channel(d.address)
    try:
        response = channel.unary_unary("/tidemark.v1.Broker/PullLocal",
                                       request_serializer=pb.PullLocalRequest.SerializeToString,
                                       response_deserializer=pb.PullLocalResponse.FromString)(
            pb.PullLocalRequest(topic="t", queue_id=0, offset=0, max_messages=500), timeout=10)
    finally:
        channel.close()
    log_dir = os.path.realpath(os.path.join(d.data_dir, "log"))
    assert len(response.spans) >= 2  # 500 x ~230 bytes over 64 KiB segments
    assert all(os.path.dirname(os.path.realpath(s.path)) == log_dir for s in response.spans)
    assert sum(s.length for s in response.spans) >= 500 * 200
    assert response.instance_file == os.path.abspath(os.path.join(d.data_dir, instance.FILE_NAME))
    assert instance.matches(response.instance_file, response.instance)
    assert response.count == 500
    with BrokerClient(d.address) as c:  # the client reads the runs across the segments
        local, remote = c.pull("t", 0, 0, max_messages=500, local_reads=True), c.pull("t", 0, 0, max_messages=500)
        assert _local(local) and len(local._response.batches) == len(response.spans)  # type: ignore[attr-defined]
        assert local.bodies() == remote.bodies() and len(local) == 500


def test_another_nodes_files_are_never_read(spawn: Callable[..., DaemonProcess]) -> None:
    """A reader that does not find the node's token in its instance file (another host, another node
    at the same path) pulls over gRPC, and does not try local reads from that address again."""
    d = spawn("n")
    sent = _fill(d.address, queues=1, sends=4)
    path = os.path.join(d.data_dir, instance.FILE_NAME)
    Path(path).write_text("0" * 32 + "\n")
    with BrokerClient(d.address) as c:
        result = c.pull("t", 0, 0, local_reads=True)
        assert not _local(result) and result.bodies() == sent[0]
        assert "does not hold" in (lr.not_local(d.address) or "")
        assert [b for r in c.iter_pull("t", 0, 0, max_messages=30, local_reads=True) for b in r.bodies()] == sent[0]


def test_a_restart_publishes_a_new_token(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("n")
    path = os.path.join(d.data_dir, instance.FILE_NAME)
    before = Path(path).read_text()
    d.stop()
    d.start()
    assert Path(path).read_text() != before and len(Path(path).read_text().strip()) == 2 * instance.TOKEN_BYTES


def test_files_that_cannot_be_read_fall_back(tmp_path: Path) -> None:
    """A segment gone since the answer (retention) or cut short: that pull goes over gRPC (None),
    and the address stays eligible; a token that does not match, or a path that is not a segment
    file of the node's log directory, marks it not local."""
    published = instance.InstanceFile(str(tmp_path))
    token_path, token = published.path, published.token
    (tmp_path / "log").mkdir()
    seg = tmp_path / "log" / "00000000000000000000.log"
    seg.write_bytes(b"x" * 100)
    (tmp_path / "secret").write_bytes(b"y" * 100)
    files = SegmentFiles()
    try:
        def answer(path: str, length: int, tok: str = token) -> pb.PullLocalResponse:
            return pb.PullLocalResponse(spans=[pb.LogSpan(path=path, position=10, length=length)], count=1,
                                        instance_file=token_path, instance=tok)

        read = files.read("a:1", answer(str(seg), 50))
        assert read is not None and read.batches == [b"x" * 50]
        assert files.read("a:1", answer(str(tmp_path / "log" / "00000000000000000100.log"), 50)) is None  # gone
        assert files.read("a:1", answer(str(seg), 500)) is None  # past the file's end
        assert lr.not_local("a:1") is None
        assert files.read("a:1", answer(str(seg), 50, tok="f" * 32)) is None
        assert "does not hold" in (lr.not_local("a:1") or "")
        for outside in (tmp_path / "secret", tmp_path / "log" / ".." / "secret", tmp_path / "log" / "x.log"):
            assert files.read("b:1", answer(str(outside), 50)) is None  # never opened: not a segment file of log/
            assert "not a segment file" in (lr.not_local("b:1") or "")
            lr._NOT_LOCAL.clear()
    finally:
        files.close()


def test_ranges_in_tiered_storage_are_pulled_over_grpc(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Below the local log start PullLocal refuses (FAILED_PRECONDITION); the client pulls those
    over gRPC, and reads the local part from the files again."""
    trim = {"commitlog.segment_bytes": 256 * 1024, "retention.local_bytes": 512 * 1024, "retention.check_interval_ms": 100}
    d = spawn("n", config=tiered_config(str(tmp_path / "tiered"), **trim))
    bodies = [b"m-%06d-" % i + b"r" * 1000 for i in range(3000)]
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        for i in range(0, len(bodies), 100):
            c.send("t", [Message(body=b) for b in bodies[i : i + 100]], ack="flush")
    wait_until(lambda: caught_up(d) and int(status(d)["min_offset"]) > 1 << 20, what="upload and local retention",
               observe=lambda: {k: status(d).get(k) for k in ("min_offset", "confirm_offset", "tiered_uploaded_offset", "tiered")})
    with BrokerClient(d.address) as c:
        cold = c.pull("t", 0, 0, max_messages=100, local_reads=True)
        assert not _local(cold) and cold.bodies() == bodies[:100]
        assert lr.not_local(d.address) is None
        hot = c.pull("t", 0, 2900, max_messages=100, local_reads=True)
        assert _local(hot) and hot.bodies() == bodies[2900:]
        assert [b for r in c.iter_pull("t", 0, 0, max_messages=500, local_reads=True) for b in r.bodies()] == bodies


def _answer(data_dir: Path, segment: str, length: int) -> pb.PullLocalResponse:
    token = (data_dir / instance.FILE_NAME).read_text().strip()
    return pb.PullLocalResponse(spans=[pb.LogSpan(path=str(data_dir / "log" / segment), position=0, length=length)],
                                count=1, instance_file=str(data_dir / instance.FILE_NAME), instance=token)


def test_a_new_instance_closes_the_files_of_the_old(tmp_path: Path) -> None:
    """A node re-bootstrapped at the same path (its directory moved aside, a new one installed, a
    new token): the cached descriptor of the old directory's segment is never read again."""
    node = tmp_path / "node"
    (node / "log").mkdir(parents=True)
    name = "00000000000000000000.log"
    (node / "log" / name).write_bytes(b"OLD-HISTORY-")
    instance.InstanceFile(str(node))
    files = SegmentFiles()
    try:
        first = files.read("n:1", _answer(node, name, 12))
        assert first is not None and first.batches == [b"OLD-HISTORY-"]
        node.rename(tmp_path / "node.old-1")
        (node / "log").mkdir(parents=True)
        (node / "log" / name).write_bytes(b"NEW-HISTORY-")
        instance.InstanceFile(str(node))
        second = files.read("n:1", _answer(node, name, 12))
        assert second is not None and second.batches == [b"NEW-HISTORY-"]
    finally:
        files.close()


def test_a_deleted_segment_is_let_go(tmp_path: Path) -> None:
    """Retention deleted a cached segment: its descriptor is closed at the next read (the space is
    freed) and that pull goes over gRPC."""
    (tmp_path / "log").mkdir()
    name = "00000000000000000000.log"
    (tmp_path / "log" / name).write_bytes(b"z" * 64)
    instance.InstanceFile(str(tmp_path))
    files = SegmentFiles()
    try:
        assert files.read("n:1", _answer(tmp_path, name, 64)) is not None
        (tmp_path / "log" / name).unlink()
        assert files.read("n:1", _answer(tmp_path, name, 64)) is None
        assert not files._fds and lr.not_local("n:1") is None
    finally:
        files.close()
    assert files.read("n:1", _answer(tmp_path, name, 64)) is None  # closed: nothing is opened again


def test_not_local_is_forgotten_after_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart or an upgrade may make a node readable locally: the memo expires."""
    monkeypatch.setattr(lr, "NOT_LOCAL_FOR_S", 0.05)
    lr.mark_not_local("x:1", "test")
    assert lr.not_local("x:1") == "test"
    time.sleep(0.1)
    assert lr.not_local("x:1") is None


def test_local_reads_stay_right_while_retention_deletes_segments(spawn: Callable[..., DaemonProcess]) -> None:
    """A reader following a queue with local reads while sends roll 64 KiB segments and local
    retention deletes them every 10 ms: every message it gets is the one at its offset, reads
    fall back or restart at the earliest offset when a segment went, and most are local."""
    d = spawn("n", config={"commitlog.segment_bytes": 64 * 1024, "retention.local_bytes": 256 * 1024,
                           "retention.check_interval_ms": 10, "checkpoint.interval_ms": 50})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
    stop = threading.Event()
    sent = [0]

    def send() -> None:
        with BrokerClient(d.address) as s:
            # until the reader is done (a fixed count ran out on a fast machine before the reader
            # got its 5,000: it then waited at the end of the queue); retention bounds the disk
            while not stop.is_set() and sent[0] < 1_000_000:
                s.send("t", [Message(body=b"%08d-" % (sent[0] + k) + b"p" * 500) for k in range(50)], ack="flush")
                sent[0] += 50

    sender = threading.Thread(target=send)
    sender.start()
    got = local = restarts = 0
    offset = 0
    try:
        wait_until(lambda: sent[0] >= 2_000, what="a backlog")
        with BrokerClient(d.address) as c:
            deadline = time.monotonic() + 60
            while got < 5_000 and time.monotonic() < deadline:
                try:
                    for r in c.iter_pull("t", 0, offset, max_messages=100, local_reads=True):
                        for i, body in enumerate(r.bodies()):
                            assert body.startswith(b"%08d-" % (offset + i)), (offset + i, body[:9])
                        offset, got, local = r.next_offset, got + len(r), local + _local(r)
                        time.sleep(0.01)  # slower than the sender: retention overtakes the reader
                except BrokerError as exc:  # retention passed us: go on from the earliest offset
                    assert exc.code == grpc.StatusCode.OUT_OF_RANGE, exc
                    offset = c.pull("t", 0, c.list_topics()["t"]["max_offsets"][0], max_messages=1).min_offset
                    restarts += 1
    finally:
        stop.set()
        sender.join()
    assert got >= 5_000 and local > 0, (got, local, restarts)
    assert int(status(d)["min_offset"]) > 0  # retention did delete segments meanwhile
