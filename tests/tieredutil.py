"""Helpers shared by the tiered-storage tests: configs, waits, and checks of the object store."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c

from broker.client import BrokerClient, BrokerError, Message
from tests.procs import DaemonProcess
from tieredstore.backend import Backend
from tieredstore.objects import LOG_PREFIX, TieredObject, parse_key, runs

OBJECT_BYTES = 64 * 1024


def tiered_config(root: str, **extra: Any) -> dict[str, Any]:
    return {"tieredstore.root": root, "tieredstore.object_bytes": OBJECT_BYTES, "tieredstore.upload_interval_ms": 100,
            "checkpoint.interval_ms": 100, **extra}


def wait_for(cond: Callable[[], bool], timeout_s: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def status(d: DaemonProcess) -> dict[str, Any]:
    with BrokerClient(d.address) as c:
        return c.status()


def caught_up(d: DaemonProcess, slack_bytes: int = 512) -> bool:
    """Everything confirmed is uploaded, but for at most a trailing progress record."""
    st = status(d)
    return int(st["confirm_offset"]) - int(st["tiered_uploaded_offset"]) <= slack_bytes


def objects(backend: Backend) -> list[TieredObject]:
    out = [parse_key(i.key) for i in backend.list(LOG_PREFIX)]
    assert all(o is not None for o in out), "a non-object key under log/"
    return sorted((o for o in out if o is not None), key=lambda o: (o.start, o.end))


def check_chain(backend: Backend) -> tuple[list[TieredObject], bytes]:
    """Objects form one contiguous chain, each holding the bytes its CRC names; return them and their bytes."""
    objs = objects(backend)
    assert objs, "no objects uploaded"
    assert len(runs(objs)) == 1, f"gap or overlap between objects: {[(o.start, o.end) for o in objs][:20]}"
    assert len({(o.start, o.end) for o in objs}) == len(objs)
    parts = []
    for o in objs:
        data = backend.get(o.key)
        assert len(data) == o.size_bytes and crc32c.crc32c(data) == o.crc, f"{o.key}: bytes do not match the name"
        parts.append(data)
    return objs, b"".join(parts)


def log_bytes(d: DaemonProcess) -> tuple[int, bytes]:
    """(first offset, every byte) of a node's local log."""
    segs = sorted((Path(d.data_dir) / "log").glob("*.log"))
    return int(segs[0].name[:20]), b"".join(p.read_bytes() for p in segs)


class Sender(threading.Thread):
    """Sends numbered 1 KiB messages until stopped; remembers what was acknowledged."""

    def __init__(self, addresses: list[str], topic: str, ack: str, batch: int = 20, pause_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.addresses = addresses
        self.topic = topic
        self.ack = ack
        self.batch = batch
        self.pause_s = pause_s
        self.acked: list[bytes] = []
        self.stop = threading.Event()
        self.errors = 0

    def run(self) -> None:
        seq = 0
        with BrokerClient(self.addresses, timeout_s=3) as c:
            while not self.stop.is_set():
                bodies = [b"m-%08d-" % (seq + i) + b"v" * 1000 for i in range(self.batch)]
                seq += self.batch
                try:
                    c.send(self.topic, [Message(body=b, key=str(i % 7)) for i, b in enumerate(bodies)], ack=self.ack)
                except BrokerError:
                    self.errors += 1
                    time.sleep(0.1)
                    continue
                self.acked += bodies
                if self.pause_s:
                    time.sleep(self.pause_s)


def read_all(address: str, topic: str, queues: int) -> list[bytes]:
    out: list[bytes] = []
    with BrokerClient(address) as c:
        for q in range(queues):
            offset = 0
            while True:
                r = c.pull(topic, q, offset, max_messages=5000)
                if not len(r):
                    break
                out += r.bodies()
                offset = r.next_offset
    return out
