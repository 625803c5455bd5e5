"""A full disk: sends refused with RESOURCE_EXHAUSTED, nothing acknowledged lost, writes resume
when space returns. Uses a small tmpfs mounted by the test (needs root, as CI runs)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from broker.client import BrokerClient, BrokerError, Message
from broker.storage import instance
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.procs import DaemonProcess
from tests.waits import wait_until

MiB = 1 << 20


def _fill(path: Path, leave_bytes: int) -> None:
    st = os.statvfs(path.parent)
    free = st.f_bavail * st.f_frsize
    with open(path, "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))


def _send_until_refused(c: BrokerClient, acked: list[bytes], limit: int = 2000) -> BrokerError:
    for i in range(limit):
        bodies = [b"%06d-%03d-" % (i, j) + b"z" * 1000 for j in range(50)]
        try:
            c.send("t", [Message(body=b) for b in bodies], ack="flush")
        except BrokerError as exc:
            return exc
        acked += bodies
    raise AssertionError("sends were never refused")


def _read_all(c: BrokerClient) -> list[bytes]:
    out: list[bytes] = []
    offset = 0
    while True:
        r = c.pull("t", 0, offset, max_messages=10_000)
        if not len(r):
            return out
        out += r.bodies()
        offset = r.next_offset


@pytest.mark.root
@pytest.mark.parametrize("min_free_bytes", [4 * MiB, 0])
def test_full_disk_refuses_then_resumes(spawn: Callable[..., DaemonProcess], small_fs: Path, min_free_bytes: int) -> None:
    """Below storage.min_free_bytes (or at a real ENOSPC with 0) sends fail; nothing acked is lost."""
    d = spawn(str(small_fs / "data"), config={"storage.min_free_bytes": min_free_bytes})
    filler = small_fs / "filler"
    acked: list[bytes] = []
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        _fill(filler, leave_bytes=min_free_bytes + 3 * MiB)
        exc = _send_until_refused(c, acked)
        assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        assert acked
        assert c.status()["role"] == "master"
        filler.unlink()
        wait_until(lambda: c.status()["free_disk_bytes"] >= min_free_bytes + MiB, 10, "the freed space seen by the broker",
                   observe=lambda: c.status()["free_disk_bytes"])
        c.send("t", [Message(body=b"after")], ack="flush")
        stored = _read_all(c)
    assert stored[: len(acked)] == acked and stored[-1] == b"after"
    d.kill9()
    d.start()
    with BrokerClient(d.address) as c:
        assert _read_all(c) == stored


@pytest.mark.root
def test_a_daemon_restarted_on_a_full_disk_serves_reads_and_resumes_writes(spawn: Callable[..., DaemonProcess],
                                                                          small_fs: Path) -> None:
    """A node killed and restarted on a disk with no byte free starts (no traceback, no exit): it
    serves what it stored, refuses writes with RESOURCE_EXHAUSTED, and takes them again once
    space returns."""
    log_path = small_fs.parent / "node.log"  # the log on another disk: it shows what the start met
    d = spawn(str(small_fs / "data"), config={"storage.min_free_bytes": 0}, log_path=str(log_path))
    filler = small_fs / "filler"
    acked: list[bytes] = []
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        for i in range(20):
            bodies = [b"%03d-%03d-" % (i, j) + b"y" * 500 for j in range(20)]
            c.send("t", [Message(body=b) for b in bodies], ack="flush")
            acked += bodies
    d.kill9()
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # every byte: large writes, then small ones for what they leave
        for size in (MiB, 4096, 1):
            while True:
                try:
                    os.write(fd, b"\0" * size)
                except OSError:
                    break
    finally:
        os.close(fd)
    assert os.statvfs(small_fs).f_bavail == 0
    d.start()
    with BrokerClient(d.address) as c:
        assert _read_all(c) == acked
        with pytest.raises(BrokerError) as refused:
            c.send("t", [Message(body=b"while full" + b"w" * 1000)] * 64, ack="flush")  # more than the last page holds
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        channel = grpc.insecure_channel(d.address)
        stub = pb_grpc.BrokerStub(channel)
        local = pb.PullLocalRequest(topic="t", queue_id=0, offset=0, max_messages=10)
        assert not instance.matches((r := stub.PullLocal(local)).instance_file, r.instance)  # not written: no local reads
        filler.unlink()
        wait_until(lambda: c.status()["free_disk_bytes"] >= MiB, 10, "the freed space seen by the broker")
        c.send("t", [Message(body=b"after")], ack="flush")
        assert _read_all(c) == [*acked, b"after"]
    # the token file the start could not write is written once space returns: local reads come back
    wait_until(lambda: instance.matches((r := stub.PullLocal(local)).instance_file, r.instance), 15,
               "the instance file written after space returned")
    channel.close()
    started = log_path.read_text(errors="replace")
    assert "Traceback" not in started and "instance_file_not_written" in started, started[-3000:]
    assert "instance_file_written" in started
