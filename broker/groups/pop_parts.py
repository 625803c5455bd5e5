"""What the pop service's parts share (pops.py composes them): the store, the pop view, the queue
locks, the idle cache and dead letters, and the checks and the durable step every call takes."""

from __future__ import annotations

from typing import Any

import crc32c
import structlog

from broker import clock
from broker.errors import invalid, not_found, shown
from broker.groups import receipts
from broker.groups.dead_letters import DeadLetters
from broker.groups.pop_idle import IdlePops
from broker.groups.pop_locks import QueueLocks
from broker.logformat import batch as bf
from broker.logformat import pop_records as pr
from broker.logformat import system_records
from broker.ports import IncomingBatch
from broker.store import Store
from broker.views.pop_leases import ENDED, EXPIRED, NOT_LEASED, RETAGGED, PopLeaseView

log = structlog.get_logger("groups.pop")
FAILED_PRECONDITION = 9  # grpc.StatusCode.FAILED_PRECONDITION's value, per handle in Ack/Nack results
TWICE = 5  # beyond PopQueue.check's reasons: the same lease twice in one call
REASONS = {
    NOT_LEASED: "no lease: the message was acked, dead-lettered or never popped by this group",
    ENDED: "the lease ended: the message was acked",
    RETAGGED: "the lease ended: the message was nacked or delivered again (or the handle is not genuine)",
    EXPIRED: "the lease expired: the message will be delivered again",
    TWICE: "the same lease twice in one call",
}


def now_ms() -> int:
    return clock.wall_ms()


class PopParts:
    store: Store
    config: Any
    view: PopLeaseView
    idle_pops: IdlePops
    locks: QueueLocks
    dead: DeadLetters

    @property
    def cluster(self) -> int:
        """The cluster handles belong to (read each time: a slave takes its master's cluster id)."""
        return receipts.cluster_hash(self.store.identity.cluster_id)

    def check_group(self, group: str) -> None:
        if not group or system_records.topic_name_error(group + system_records.DLQ_SUFFIX) is not None:
            raise invalid(f"invalid pop group name {shown(group)}: use 1-123 of [A-Za-z0-9._-], starting alphanumeric "
                          "(its dead letters go to the topic '<group>.dlq')")

    def topic_queues(self, topic: str) -> int:
        err = system_records.topic_name_error(topic)
        if err:
            raise invalid(err)
        info = self.store.views.metadata.topic(topic)
        if info is None:
            raise not_found(f"unknown topic {shown(topic)}")
        return int(info["queues"])

    def _check_duration(self, name: str, value_ms: int) -> int:
        top = self.config["groups.invisible_ms_max"]
        if not 0 < value_ms <= top:
            raise invalid(f"{name} {value_ms} ms out of range: 1..{top} (groups.invisible_ms_max)")
        return value_ms

    def _append(self, batches: list[IncomingBatch]) -> int:
        _, end = self.store.appender.append(batches, internal=True)
        return end

    def _durable(self, end: int) -> None:
        """As durable as an ack=replica send, then applied (the answer reflects the record)."""
        self.store.writes.acknowledged(end, "replica", applied=self.view, what="the pop record")


def record_batch(kind: str, fields: dict[str, object]) -> IncomingBatch:
    key, body = system_records.encode(kind, fields)
    records, _ = bf.encode_records([(body, key, b"")])
    return IncomingBatch(pr.POP_TOPIC, 0, records, 1, crc32c.crc32c(records))
