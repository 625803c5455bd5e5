"""Dead letters of pop mode: ``<group>.dlq`` and what a message carries there (DESIGN §12).

A message delivered ``groups.max_deliveries`` times without an ack moves to its group's DLQ topic,
in the same append as the lease record that ends it, with its origin in ``dlq.*`` properties. The
DLQ is a topic like any other to read, takes nothing but its group's dead letters, and is created
by the first dead letter only when the popping caller may create topics (admin); otherwise dead
letters wait, neither leased nor delivered, and status says so (``errors.dlq``).

In a cluster of shards each shard pops its own queues, so the DLQ is placed with one queue per
shard (``Placement.dead_letter_queue``) and each shard appends its dead letters to its own queue.
"""

from __future__ import annotations

import threading

import crc32c
import structlog

from broker import metrics
from broker.errors import shown
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.ports import IncomingBatch
from broker.store import Store

log = structlog.get_logger("groups.pop")
ORIGIN_PROPS = ("dlq.topic", "dlq.queue", "dlq.offset", "dlq.deliveries")
HELD_GROUPS_MAX = 1000  # named in the incident; more are held back all the same


def dead_letter_props(raw: bytes | memoryview, origin: dict[str, str]) -> bytes:
    """A dead letter's properties: the message's own, read leniently (a record stored before the
    send path checked contents may not decode strictly), then its origin. When both do not fit a
    record's properties, the origin and how many bytes of the message's own were dropped: moving a
    message to the DLQ never fails on the message."""
    props = bf.decode_props_lenient(raw) if len(raw) else {}
    props.update(origin)
    fits = sum(4 + len(n.encode()) + len(v.encode()) for n, v in props.items()) <= bf.PROPS_BYTES_MAX
    return bf.encode_props(props if fits else {**origin, "dlq.properties_dropped": str(len(raw))})


class DeadLetters:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock = threading.Lock()  # pops of two queues may both find the DLQ missing
        self._held: set[str] = set()  # groups whose dead letters wait for their DLQ
        self._queues: dict[str, int] = {}  # a cluster of shards: DLQ topic -> this shard's queue of it

    def ready(self, group: str, may_create: bool) -> bool:
        """``<group>.dlq`` exists, or this caller may create it and did: dead letters can move.
        Otherwise they are held back, said in the log and in status (``errors.dlq``)."""
        name = group + system_records.DLQ_SUFFIX
        metadata = self.store.views.metadata
        with self._lock:
            if metadata.topic(name) is None and not may_create:
                if len(self._held) < HELD_GROUPS_MAX:
                    self._held.add(group)
                self._report()
                metrics.POP_DLQ_HELD.inc()
                return False
            placement = self.store.placement
            if placement is not None:
                queue = placement.dead_letter_queue(name)
                if queue is None:  # not in this shard's log yet (next pop), or no queue of it here
                    if metadata.topic(name) is not None and len(self._held) < HELD_GROUPS_MAX:
                        self._held.add(group)
                        self._report()
                    return False
                if len(self._queues) >= HELD_GROUPS_MAX:
                    self._queues.clear()
                self._queues[name] = queue
            elif metadata.topic(name) is None:
                self.create(name)
            if group in self._held:
                self._held.discard(group)
                self._report()
        return True

    def _report(self) -> None:
        """One incident for all groups whose dead letters wait (cleared when none does)."""
        if not self._held:
            self.store.incidents.clear("dlq")
            return
        groups = sorted(self._held)
        listed = ", ".join(shown(g) for g in groups[:5]) + (f" and {len(groups) - 5} more" if len(groups) > 5 else "")
        self.store.incidents.record("dlq", f"dead letters of pop group(s) {listed} are held back: their dead-letter "
                                    "topic (<group>.dlq) does not exist and the popping caller may not create topics "
                                    "(admin): tidemark topic create it, or pop with an admin token; in a cluster of "
                                    "shards, or it has no queue on this shard (a shard that joined after it was placed)")

    def create(self, name: str) -> None:
        self.store.writes.write_system([(system_records.TOPIC_CREATE, {"topic": name, "queues": 1})],
                                       applied=self.store.views.metadata)
        log.info("dlq_topic_created", topic=name)

    def letter(self, topic: str, queue_id: int, queue_offset: int, deliveries: int, key: bytes | memoryview,
               props: bytes | memoryview, body: bytes | memoryview) -> tuple[bytes, bytes, bytes]:
        """(body, key, props) of one dead message, its origin added to its properties."""
        origin = dict(zip(ORIGIN_PROPS, (topic, str(queue_id), str(queue_offset), str(deliveries)), strict=True))
        return bytes(body), bytes(key), dead_letter_props(props, origin)

    def batch(self, group: str, items: list[tuple[bytes, bytes, bytes]]) -> IncomingBatch:
        records, _ = bf.encode_records(items)
        name = group + system_records.DLQ_SUFFIX
        return IncomingBatch(name, self._queues.get(name, 0), records, len(items), crc32c.crc32c(records))
