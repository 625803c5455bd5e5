"""Every writer goes through one write step (broker/store/writes.py, issue 36): a write appended
just before the write permit lapses is refused UNAVAILABLE with the outcome unknown, and nothing
is reported as done. In-process store (real files, fsync, LMDB); the permit is withdrawn by the
append itself, the moment between append and acknowledgement that a lapse can hit."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c
import pytest

from broker.daemon.heartbeats import Heartbeats
from broker.daemon.longpoll import LongPolls
from broker.daemon.service import BrokerService
from broker.errors import BrokerError
from broker.logformat import batch as bf
from broker.logformat import timer_props as tr
from broker.store import IncomingBatch, Store
from proto import tidemark_pb2 as pb
from tests.storeutil import create_topic, open_store
from tests.waits import wait_until


class Node:
    """A store with the gRPC service's handlers on an event loop of its own, and a switch that makes
    the next append withdraw the write permit as soon as it returns."""

    def __init__(self, path: Path) -> None:
        self.store: Store = open_store(str(path))
        self.loop = asyncio.new_event_loop()
        self.pool = ThreadPoolExecutor(4)
        heartbeats = Heartbeats(self.loop, lambda t: 1, members_max=100, rejoin_grace_ms=0, groups_max=100)
        self.service = BrokerService(self.store, LongPolls(self.loop), self.pool, heartbeats)
        self.lapse_next = False
        appender = self.store.appender
        for name in ("append", "append_system"):
            original = getattr(appender, name)
            setattr(appender, name, self._lapsing(original))

    def _lapsing(self, append: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = append(*args, **kwargs)
            if self.lapse_next:
                self.lapse_next = False
                self.store.permit.withdraw("the test let the lease lapse")
            return out
        return run

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.store.permit.grant(math.inf)
        self.store.stop()
        self.pool.shutdown()
        self.loop.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    create_topic(n.store, "t")
    yield n
    n.close()


def _records(*bodies: bytes) -> bytes:
    return bf.encode_records([(b, b"", b"") for b in bodies])[0]


def _send(n: Node, *bodies: bytes) -> None:
    raw = _records(*bodies)
    request = pb.SendRequest(ack=pb.ACK_REPLICA, batches=[pb.ProduceBatch(topic="t", records=raw, record_count=len(bodies),
                                                                         records_crc=crc32c.crc32c(raw))])
    n.run(n.service.data._send(request))


def _create_topic(n: Node) -> None:
    n.run(n.service.topics._write_metadata([("topic.create", {"topic": "u", "queues": 1})]))


def _popped(n: Node) -> list[pb.PoppedRun]:
    got, _ = n.service.pops.pop("g", "t", 10, 30_000, True)
    return got


def _pop(n: Node) -> None:
    _send(n, b"a")
    n.lapse_next = True
    _popped(n)


def _with_lease(end: Callable[[Node, str], object]) -> Callable[[Node], None]:
    def run(n: Node) -> None:
        _send(n, b"a")
        (lease,) = _popped(n)
        n.lapse_next = True
        end(n, lease.receipt_handle)
    return run


def _commit_offsets(n: Node) -> None:
    _send(n, b"a")
    n.lapse_next = True
    n.store.offsets.commit([("g", "t", 0, 1)], wait_s=5.0)


def _cancel_timer(n: Node) -> None:
    at = int(time.time() * 1000) + 60_000
    props = tr.scheduled_props(at, "t", 0, None)
    raw = bf.encode_records([(b"later", b"", props)])[0]
    receipts, _ = n.store.appender.append([IncomingBatch(tr.TIMER_TOPIC, 0, raw, 1, crc32c.crc32c(raw), timer_target=("t", 0))])
    n.store.watermarks.wait_ack(receipts[0].commit_offset + 1, "flush", 5000)
    offset = receipts[0].commit_offset + bf.HEADER_BYTES + len(tr.TIMER_TOPIC)
    wait_until(lambda: n.store.timers._slot is not None, 10, what="the timer service caught up")
    n.lapse_next = True
    n.store.timers.cancel(offset)


def _lapsing(write: Callable[[Node], None]) -> Callable[[Node], None]:
    def run(n: Node) -> None:
        n.lapse_next = True
        write(n)
    return run


WRITERS: dict[str, Callable[[Node], None]] = {
    "send": _lapsing(lambda n: _send(n, b"x")),
    "create topic": _lapsing(_create_topic),
    "pop": _pop,
    "ack": _with_lease(lambda n, h: n.service.pops.ack("g", [h])),
    "nack": _with_lease(lambda n, h: n.service.pops.nack("g", [h], 0)),
    "change invisible": _with_lease(lambda n, h: n.service.pops.change_invisible("g", h, 60_000)),
    "create a DLQ": _lapsing(lambda n: n.service.pops.dead.create("g.dlq")),
    "commit offsets": _commit_offsets,
    "cancel a timer": _cancel_timer,
}


@pytest.mark.parametrize("writer", list(WRITERS), ids=list(WRITERS))
def test_a_permit_lapsing_after_the_append_refuses_the_write(node: Node, writer: str) -> None:
    with pytest.raises(BrokerError) as refused:
        WRITERS[writer](node)
    assert refused.value.code == "UNAVAILABLE", refused.value.message
    if writer != "commit offsets":  # the offset buffer reports the write's failure in its own words
        assert "outcome unknown" in refused.value.message
    node.store.permit.grant(math.inf)


def test_a_timer_delivery_is_not_taken_as_done_after_a_lapse(node: Node) -> None:
    """The firing thread's round fails (reported, retried) instead of counting the delivery done."""
    failures: list[str] = []
    node.store.timers.report = lambda message: failures.append(message) if message else None
    at = int(time.time() * 1000) + 300
    raw = bf.encode_records([(b"soon", b"", tr.scheduled_props(at, "t", 0, None))])[0]
    node.lapse_next = False
    node.store.appender.append([IncomingBatch(tr.TIMER_TOPIC, 0, raw, 1, crc32c.crc32c(raw), timer_target=("t", 0))])
    wait_until(lambda: node.store.timers._slot is not None, 10, what="the timer service caught up")
    node.lapse_next = True  # the next append is the firing round's delivery
    wait_until(lambda: any(m.startswith("UNAVAILABLE") for m in failures), 10, what="the round refused",
               observe=lambda: failures)
