"""Helpers shared by the tiered-storage tests: configs, a sender, and checks of the object store."""

from __future__ import annotations

import itertools
from typing import Any

import crc32c

from broker.client import BrokerClient
from tests.crashutil import Producer, read_everything
from tests.nodeutil import status
from tests.procs import DaemonProcess
from tests.waits import wait_until
from tieredstore.backend import Backend
from tieredstore.objects import LOG_PREFIX, TieredObject, parse_key

OBJECT_BYTES = 64 * 1024


def tiered_config(root: str, **extra: Any) -> dict[str, Any]:
    return {"tieredstore.root": root, "tieredstore.object_bytes": OBJECT_BYTES, "tieredstore.upload_interval_ms": 100,
            "checkpoint.interval_ms": 100, **extra}


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
    assert all(a.end == b.start for a, b in itertools.pairwise(objs)), \
        f"gap or overlap between objects: {[(o.start, o.end) for o in objs][:20]}"
    assert len({(o.start, o.end) for o in objs}) == len(objs)
    parts = []
    for o in objs:
        data = backend.get(o.key)
        assert len(data) == o.size_bytes and crc32c.crc32c(data) == o.crc, f"{o.key}: bytes do not match the name"
        parts.append(data)
    return objs, b"".join(parts)


class Sender(Producer):
    """Sends numbered 1 KiB messages (keyed) until stopped, following failover; remembers what was acknowledged."""

    def __init__(self, addresses: list[str], topic: str, ack: str, batch: int = 20, pause_s: float = 0.0) -> None:
        super().__init__(addresses, topic, "m", ack=ack, batch=batch, body_bytes=1000, keys=7, retry=True,
                         pause_s=pause_s, timeout_s=3)


def promote_while_sending(s: DaemonProcess, sender: Sender) -> None:
    """Promote ``s``; the sender carries on against it, refused (alone it has fewer than 2 in-sync
    replicas): until two more of its sends failed (the first may have begun before the promotion)."""
    errors = sender.errors
    with BrokerClient(s.address) as c:
        c.promote()
    wait_until(lambda: sender.errors >= errors + 2, what="two sends refused after the promotion",
               observe=lambda: (sender.errors, len(sender.acked)))


def read_all(address: str, topic: str, queues: int) -> list[bytes]:
    """Every body in ``topic``, queue after queue."""
    return [b for bodies in read_everything(address, topic, queues).values() for b in bodies]
