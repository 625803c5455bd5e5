"""A full disk: sends refused with RESOURCE_EXHAUSTED, nothing acknowledged lost, writes resume
when space returns. Uses a small tmpfs mounted by the test (needs root, as CI runs)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from broker.client import BrokerClient, BrokerError, Message
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
