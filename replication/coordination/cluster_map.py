"""A watched copy of a cluster of shards (docs/shards.md): every topic's placement, where each
shard serves (its master and nodes) and which shard coordinates each group slot, as etcd holds
them under ``/tidemark/<cluster>/topics/``, ``topology/`` and ``slots/``, and the shards being
drained (``state/draining/<shard>``).

One range read, then one watch of those prefixes (one key range, ``slots/`` to the end of
``topology/``: of a cluster of shards' keys only these sort between them)
from the revision after it: a node learns of a new topic or a new master from etcd's push, never
by polling, and never sees the shards' own keys (their node records change every second).
A compacted watch (it fell too far behind) reads everything again. A value this version does not
understand is kept aside (shown in status) and never trusted.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import structlog

from broker.storage.failpoints import failpoint_async
from replication.coordination import placement as pl
from replication.coordination import records as rec
from replication.coordination import slots as sl
from replication.coordination.etcd import Etcd, Unreachable

log = structlog.get_logger("replication.cluster_map")


def prefix_range_end_text(prefix: str) -> str:
    """The end of the key range of every key that starts with ``prefix`` (its last byte plus one)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)
RETRY_S = 0.5
DRAINING = "state/draining/"  # sorts between slots/ and topics/: inside the watched range


class ClusterMap:
    def __init__(self, root: str) -> None:
        self.root = root
        self.on_change: list[Callable[[], None]] = []  # told after each change (from the loop: must not block)
        self._cond = threading.Condition()
        self.revision = 0  # the etcd revision this copy reflects (0: not loaded)
        self.placements: dict[str, pl.Placement] = {}
        self.deleted: set[str] = set()  # topics whose record is a tombstone
        self.raw: dict[str, bytes] = {}  # topic -> its record as etcd holds it (a delete compares it)
        self.masters: dict[str, rec.Topology] = {}  # shard -> where it serves (while its master holds a lease)
        self.bad: dict[str, str] = {}  # key -> why its value is not understood
        self.slots: dict[int, str] = {}  # group slot -> the shard coordinating its groups
        self.slot_moves: dict[int, str] = {}  # group slot -> the shard it is moving to
        self.draining: set[str] = set()  # shards being drained: new queues and slots avoid them
        self._start = root + "slots/"
        self._end = prefix_range_end_text(root + "topology/")  # the watched range: [slots/, past topology/)
        self._counts: dict[str, int] = {}  # shard -> the queues it writes (queue_counts)
        self._moving: dict[tuple[str, int], pl.Segment] = {}  # queues being sealed now -> their sealing segment
        self._read_only: dict[str, int] = {}  # shard -> the read-only segments its log holds
        self._fresh: dict[tuple[str, int], pl.Segment] = {}  # writable segments a move began, not yet begun

    # -- reads (any thread) ---------------------------------------------------------------------
    def placement(self, topic: str) -> pl.Placement | None:
        with self._cond:
            return self.placements.get(topic)

    def is_deleted(self, topic: str) -> bool:
        with self._cond:
            return topic in self.deleted

    def raw_record(self, topic: str) -> bytes | None:
        with self._cond:
            return self.raw.get(topic)

    def placements_snapshot(self) -> dict[str, pl.Placement]:
        with self._cond:
            return dict(self.placements)

    def master(self, shard: str) -> rec.Topology | None:
        with self._cond:
            return self.masters.get(shard)

    def shards(self) -> dict[str, rec.Topology | None]:
        """Every shard with a master or a queue: where it serves (None: no master now)."""
        owning = self.queue_counts()
        with self._cond:
            return {s: self.masters.get(s) for s in sorted(set(self.masters) | set(owning))}

    def queue_counts(self) -> dict[str, int]:
        """Per shard: the queues it writes (kept as placements change: a route request at 10,000
        topics x 16 queues recounted 160,000 queues after each new topic)."""
        with self._cond:
            return {shard: n for shard, n in self._counts.items() if n}

    def moves_in_flight(self) -> list[tuple[str, int, str, str]]:
        """The queue moves under way: (topic, queue, from shard, to shard), by topic and queue."""
        with self._cond:
            return sorted((t, q, seg.shard, seg.to) for (t, q), seg in self._moving.items())

    def fresh_segments(self) -> list[tuple[str, int, pl.Segment]]:
        """Writable segments a move began that still say so in etcd (fresh, or carrying producers)."""
        with self._cond:
            return [(t, q, seg) for (t, q), seg in self._fresh.items()]

    def live_shards(self) -> list[str]:
        """The shards with a master now, by name."""
        with self._cond:
            return sorted(self.masters)

    def queues_held(self) -> dict[str, int]:
        """Per shard with a master that is not being drained: the queues it writes now."""
        counts = self.queue_counts()
        with self._cond:
            return {shard: counts.get(shard, 0) for shard in self.masters if shard not in self.draining}

    def draining_shards(self) -> set[str]:
        with self._cond:
            return set(self.draining)

    def read_only_counts(self) -> dict[str, int]:
        """Per shard: the read-only segments (of queues that moved away) its log still holds (kept
        as placements change, as ``queue_counts``)."""
        with self._cond:
            return {shard: n for shard, n in self._read_only.items() if n}

    def is_draining(self, shard: str) -> bool:
        with self._cond:
            return shard in self.draining

    def slot_shard(self, slot: int) -> str | None:
        with self._cond:
            return self.slots.get(slot)

    def bad_value(self, name: str) -> str | None:
        """Why the value at ``name`` (relative to the cluster's root) is not understood, if it is not."""
        with self._cond:
            return self.bad.get(self.root + name)

    def slot_record(self, slot: int) -> tuple[str | None, str | None]:
        """(the shard coordinating ``slot``, the shard it is moving to), read together."""
        with self._cond:
            return self.slots.get(slot), self.slot_moves.get(slot)

    def slot_moves_in_flight(self) -> dict[int, tuple[str, str]]:
        """Each moving slot: (its shard, the shard it moves to)."""
        with self._cond:
            return {slot: (self.slots[slot], to) for slot, to in self.slot_moves.items()}

    def slot_map(self) -> dict[int, str]:
        with self._cond:
            return dict(self.slots)

    def slots_held(self) -> dict[str, int]:
        """Per shard: the group slots it coordinates."""
        with self._cond:
            out: dict[str, int] = {}
            for shard in self.slots.values():
                out[shard] = out.get(shard, 0) + 1
            return out

    def wait_revision(self, revision: int, timeout_s: float) -> bool:
        """Until this copy reflects ``revision`` (a write of ours); False after ``timeout_s``."""
        return self.wait_for(lambda: self.revision >= revision, timeout_s)

    def wait_for(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Until ``ready()`` (called under the copy's lock, after each change); False after ``timeout_s``."""
        with self._cond:
            return self._cond.wait_for(ready, timeout_s)

    # -- the copy (the coordinator's loop) ----------------------------------------------------------
    async def load(self, etcd: Etcd) -> None:
        revision, kvs = await etcd.range_prefix(self._start, self._end)
        with self._cond:
            self.placements, self.masters, self.bad, self._counts, self._moving = {}, {}, {}, {}, {}
            self._read_only, self._fresh = {}, {}
            self.deleted, self.raw, self.slots, self.draining = set(), {}, {}, set()
            self.slot_moves = {}
            for key, value in kvs:
                self._apply(key, value)
            self.revision = revision
            self._cond.notify_all()
        self._changed()

    async def follow(self, etcd: Etcd) -> None:
        """Load, then apply the watch's events (until cancelled); again from a fresh read after a
        compaction or an error."""
        while True:
            try:
                await self.load(etcd)
                async for revision, events, compacted in etcd.watch_prefix(self._start, self.revision + 1,
                                                                           self._end):
                    if compacted:
                        log.warning("cluster_watch_compacted", revision=revision)
                        break
                    await failpoint_async("cluster_before_apply")  # a copy trailing etcd, in tests
                    with self._cond:
                        for key, value in events:
                            self._apply(key, value)
                        self.revision = max(self.revision, revision)
                        self._cond.notify_all()
                    self._changed()
            except Unreachable as exc:
                log.warning("cluster_watch_failed", error=str(exc), retry_in_s=RETRY_S)
            await asyncio.sleep(RETRY_S)

    def _changed(self) -> None:
        for callback in self.on_change:
            callback()

    def _count(self, topic: str, p: pl.Placement, sign: int) -> None:
        for q in range(p.queues):
            shard = p.owner(q)
            self._counts[shard] = self._counts.get(shard, 0) + sign
            for seg in p.segments[q][:-1]:
                self._read_only[seg.shard] = self._read_only.get(seg.shard, 0) + sign
        for q, seg in p.moving():
            if sign > 0:
                self._moving[(topic, q)] = seg
            else:
                self._moving.pop((topic, q), None)
        for q in range(p.queues):
            last = p.last(q)
            if last.fresh or last.producers:
                if sign > 0:
                    self._fresh[(topic, q)] = last
                else:
                    self._fresh.pop((topic, q), None)

    def _apply(self, key: str, value: bytes | None) -> None:
        """One key's new value (None: deleted), under the lock."""
        name = key[len(self.root):]
        try:
            if name.startswith("topics/"):
                topic = name[len("topics/"):]
                new = pl.decode(value) if value is not None else None
                old = self.placements.pop(topic, None)
                if old is not None:
                    self._count(topic, old, -1)
                self.deleted.discard(topic)
                self.raw.pop(topic, None)
                if new is not None and value is not None:
                    self.raw[topic] = value
                    if new.deleted:
                        self.deleted.add(topic)
                    else:
                        self.placements[topic] = new
                        self._count(topic, new, 1)
            elif (slot := sl.parse_key(name)) is not None:
                self.slot_moves.pop(slot, None)
                if value is None:
                    self.slots.pop(slot, None)
                else:
                    self.slots[slot], to = sl.decode_moving(value)
                    if to:
                        self.slot_moves[slot] = to
            elif name.startswith(DRAINING):
                if value is None:
                    self.draining.discard(name[len(DRAINING):])
                else:
                    self.draining.add(name[len(DRAINING):])
            elif name.startswith("topology/") and name.count("/") == 1:
                shard = name[len("topology/"):]
                if value is None:
                    self.masters.pop(shard, None)
                else:
                    self.masters[shard] = rec.decode_topology(value)
            else:
                return
            self.bad.pop(key, None)
        except rec.RecordError as exc:
            self.bad[key] = str(exc)[:200]
            log.warning("cluster_value_not_understood", key=key, error=str(exc)[:200])
