"""The metadata view in LMDB: topics, subscription groups, consumer offsets.

Databases (keys UTF-8, values JSON or u64 LE); spec docs/formats/metadata-lmdb.md:

- ``topics``  name → ``{"id": create offset, "queues": n}``
- ``groups``  group → ``{"created_offset": n}`` (created by a group's first offset commit)
- ``offsets`` ``group\\0topic\\0queue`` → u64 next offset to consume
- ``timers``  topic → u64 pending timer messages targeting it (absent at 0)
- ``meta``    ``applied_offset`` → u64; ``tiered_uploaded_offset`` → u64 (highest ``tiered.uploaded`` end)

One write transaction carries both a round's changes and the view's applied offset, so the
state and the offset it reflects can never disagree. LMDB keeps its default durable sync.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from typing import Any

import lmdb

from broker import metrics
from broker.logformat import system_records, txn_records
from broker.logformat import timer_props as timer_records
from broker.logformat.batch import FLAG_TIMER_DELIVERY, FLAG_TIMER_FIRED, BatchHeader, iter_records
from broker.storage.failpoints import failpoint
from broker.storage.regular import regular_stat
from broker.views.base import View
from broker.views.change_log import ChangeLog

_U64 = struct.Struct("<Q")
MAP_SIZE_BYTES = 64 << 30  # address space, not disk
LMDB_FILES = ("data.mdb", "lock.mdb")


def _offset_key(group: str, topic: str, queue: int) -> bytes:
    return f"{group}\0{topic}\0{queue}".encode()


class MetadataView(View):
    name = "metadata"

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        for name in LMDB_FILES:  # LMDB opens them itself: a FIFO there would hang it (docs/formats/README.md)
            with contextlib.suppress(FileNotFoundError):
                regular_stat(os.path.join(directory, name))
        self.env = lmdb.open(directory, map_size=MAP_SIZE_BYTES, max_dbs=8, subdir=True)
        self._topics_db = self.env.open_db(b"topics")
        self._groups_db = self.env.open_db(b"groups")
        self._offsets_db = self.env.open_db(b"offsets")
        self._meta_db = self.env.open_db(b"meta")
        self._timers_db = self.env.open_db(b"timers")
        self._timer_pending: dict[str, int] = {}
        self._timer_round: dict[str, int] = {}  # counts changed by the round being applied
        self._lock = threading.Lock()
        self.topics: dict[str, dict[str, int]] = {}
        self.queues_total = 0  # queues of all topics (limits.queues_max), kept with ``topics``
        self.applied_offset = 0
        self._stored_offset = 0
        self._txn: lmdb.Transaction | None = None
        # created topics applied but not yet in LMDB (see end_round); touched under the dispatcher's lock
        self._unwritten_topics: dict[str, bytes] = {}
        self.changes_log = ChangeLog()  # topic creates and deletes as applied: from start, not in recovery
        self.changes_applied = 0
        self.tiered_uploaded_offset = 0  # tiered progress: what the log says is in object storage

    def load(self) -> bool:
        """Read state from LMDB; False when the environment holds no applied offset yet."""
        with self.env.begin() as txn:
            raw = txn.get(b"applied_offset", db=self._meta_db)
            topics = {bytes(k).decode(): json.loads(bytes(v)) for k, v in txn.cursor(db=self._topics_db)}
            timers = {bytes(k).decode(): _U64.unpack(bytes(v))[0] for k, v in txn.cursor(db=self._timers_db)}
            tiered = txn.get(b"tiered_uploaded_offset", db=self._meta_db)
        self.topics = topics
        self.queues_total = sum(int(t["queues"]) for t in topics.values())
        self.tiered_uploaded_offset = _U64.unpack(tiered)[0] if tiered is not None else 0
        self._timer_pending = timers
        metrics.set_bounded(metrics.TIMER_PENDING, {(t,): v for t, v in timers.items()})
        if raw is None:
            return False
        self.applied_offset = self._stored_offset = _U64.unpack(raw)[0]
        return True

    def reset(self) -> None:
        """Empty every table: the view is rebuilt from offset 0."""
        with self.env.begin(write=True) as txn:
            for db in (self._topics_db, self._groups_db, self._offsets_db, self._meta_db, self._timers_db):
                txn.drop(db, delete=False)
        with self._lock:
            self.topics = {}
            self.queues_total = 0
            self._timer_pending = {}
        self._unwritten_topics.clear()
        self.tiered_uploaded_offset = 0
        self.applied_offset = self._stored_offset = 0

    def stage(self, data_dir: str, staging: str) -> None:
        """A consistent copy of the LMDB environment (a read transaction of LMDB's own)."""
        target = os.path.join(staging, os.path.relpath(self.env.path(), data_dir))
        os.makedirs(target, exist_ok=True)
        self.env.copy(target)

    # -- apply --------------------------------------------------------------------------------
    def apply(self, header: BatchHeader, batch: memoryview) -> None:
        if header.topic == timer_records.TIMER_TOPIC:
            self._apply_timer_batch(header, batch)
            return
        if header.flags & FLAG_TIMER_DELIVERY:
            self._count_timers(header.topic, -header.record_count)
            return
        if header.topic == txn_records.TXN_TOPIC:  # consumer offsets committed with a transaction
            for rec in txn_records.records(header, batch):
                if isinstance(rec, txn_records.End) and rec.commit and rec.offsets:
                    self._apply_change(rec.offset, system_records.OFFSETS_COMMIT, {"offsets": rec.offsets})
            return
        if header.topic != system_records.METADATA_TOPIC:
            return
        for _, key, _, body in iter_records(batch, header):
            change, fields = system_records.decode(key, body)
            self._apply_change(header.base_offset, change, fields)
            self.changes_applied += 1

    def _write_txn(self) -> lmdb.Transaction:
        """The round's write transaction: committed (durably) at the end of the round."""
        if self._txn is None:
            self._txn = self.env.begin(write=True)
        return self._txn

    def _apply_change(self, offset: int, change: str, fields: dict[str, Any]) -> None:
        if change == system_records.TOPIC_CREATE:
            name = fields["topic"]
            if name not in self.topics:
                info = {"id": offset, "queues": int(fields["queues"])}
                # readers see topics in memory: LMDB gets it with the next commit (see end_round)
                self._unwritten_topics[name] = json.dumps(info).encode()
                with self._lock:
                    self.topics[name] = info
                    self.queues_total += info["queues"]
                self.changes_log.note(change, name, offset, info["queues"])
            return
        txn = self._write_txn()
        if change == system_records.TOPIC_DELETE:
            name = fields["topic"]
            if name in self.topics:
                self.changes_log.note(change, name, offset)
                self._unwritten_topics.pop(name, None)
                txn.delete(name.encode(), db=self._topics_db)
                with self._lock:
                    self.queues_total -= int(self.topics.pop(name)["queues"])
                cursor = txn.cursor(db=self._offsets_db)
                doomed = [bytes(k) for k, _ in cursor if bytes(k).split(b"\0")[1] == name.encode()]
                for k in doomed:
                    txn.delete(k, db=self._offsets_db)
                for group in {k.split(b"\0")[0] for k in doomed}:  # a group with no offsets left is forgotten
                    left = txn.cursor(db=self._offsets_db)
                    if not (left.set_range(group + b"\0") and bytes(left.key()).startswith(group + b"\0")):
                        txn.delete(group, db=self._groups_db)
        elif change == system_records.OFFSETS_COMMIT:
            for group, topic, queue, value in fields["offsets"]:
                if topic not in self.topics:
                    continue
                gkey = group.encode()
                if txn.get(gkey, db=self._groups_db) is None:
                    txn.put(gkey, json.dumps({"created_offset": offset}).encode(), db=self._groups_db)
                txn.put(_offset_key(group, topic, int(queue)), _U64.pack(int(value)), db=self._offsets_db)
        elif change == system_records.TIERED_UPLOADED:
            end = int(fields["end"])
            if end > self.tiered_uploaded_offset:
                txn.put(b"tiered_uploaded_offset", _U64.pack(end), db=self._meta_db)
                self.tiered_uploaded_offset = end

    def _apply_timer_batch(self, header: BatchHeader, batch: memoryview) -> None:
        """Pending timers per target topic: +n for scheduled records, -1 per cancel or drop
        (deliveries are counted where they land, by their batch flag)."""
        if header.flags & FLAG_TIMER_FIRED:
            return  # fired events change no count (their deliveries did)
        if not timer_records.is_event_batch(batch, header):
            _, _, props, _ = next(iter_records(batch, header))  # one target per scheduled batch
            _, topic, _ = timer_records.scheduled_target(props)
            self._count_timers(topic, header.record_count)
            return
        for kind, _, topic in timer_records.event_refs(batch, header):
            if kind in (timer_records.CANCELLED, timer_records.DROPPED, timer_records.FORWARDED):
                self._count_timers(topic, -1)

    def _count_timers(self, topic: str, delta: int) -> None:
        txn = self._write_txn()
        self._timer_round[topic] = self._timer_round.get(topic, self._timer_pending.get(topic, 0)) + delta
        value = max(0, self._timer_round[topic])
        if value:
            txn.put(topic.encode(), _U64.pack(value), db=self._timers_db)
        else:
            txn.delete(topic.encode(), db=self._timers_db)

    def _publish_timer_counts(self) -> None:
        """After the round's commit: readers see the counts together with the rest of the round."""
        with self._lock:
            for topic, value in self._timer_round.items():
                if value > 0:
                    self._timer_pending[topic] = value
                else:
                    self._timer_pending.pop(topic, None)
            pending: dict[tuple[str, ...], float] = {(t,): float(v) for t, v in self._timer_pending.items()}
        metrics.set_bounded(metrics.TIMER_PENDING, pending)
        self._timer_round.clear()

    def timer_pending(self) -> dict[str, int]:
        """Pending timer messages per target topic."""
        with self._lock:
            return dict(self._timer_pending)

    def end_round(self, offset: int) -> None:
        """A round that changed what readers read from LMDB (offsets, groups, counts, a deletion)
        commits, durably, before ``applied_offset`` moves. Topic creates alone change only
        ``topics`` in memory for readers: they wait for the next commit or checkpoint (a crash
        before it replays them from the log, which holds them: views apply confirmed records only).
        One LMDB commit, two fsyncs, fewer on the way of each created topic."""
        if self._txn is not None:
            self._commit(offset)
        if self._timer_round:
            self._publish_timer_counts()
        self.applied_offset = offset

    def _commit(self, offset: int) -> None:
        txn = self._txn if self._txn is not None else self.env.begin(write=True)
        self._txn = None
        for name, info in self._unwritten_topics.items():
            txn.put(name.encode(), info, db=self._topics_db)
        self._unwritten_topics.clear()
        txn.put(b"applied_offset", _U64.pack(offset), db=self._meta_db)
        failpoint("metadata_before_commit")
        txn.commit()
        self._stored_offset = offset

    def checkpoint(self) -> None:
        self.changes_log.flush()
        if self.applied_offset != self._stored_offset:
            self._commit(self.applied_offset)

    # -- reads --------------------------------------------------------------------------------
    def topic(self, name: str) -> dict[str, int] | None:
        with self._lock:
            return self.topics.get(name)

    def list_topics(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return dict(self.topics)

    def committed_offset(self, group: str, topic: str, queue: int) -> int | None:
        with self.env.begin() as txn:
            raw = txn.get(_offset_key(group, topic, queue), db=self._offsets_db)
        return None if raw is None else int(_U64.unpack(raw)[0])

    def group_known(self, group: str) -> bool:
        """``group`` has committed offsets (it has a groups entry)."""
        with self.env.begin() as txn:
            return txn.get(group.encode(), db=self._groups_db) is not None

    def group_names(self) -> list[str]:
        """Every group with committed offsets."""
        with self.env.begin() as txn:
            return [bytes(k).decode() for k, _ in txn.cursor(db=self._groups_db)]

    def groups_count(self) -> int:
        with self.env.begin() as txn:
            return int(txn.stat(self._groups_db)["entries"])

    def group_offsets(self) -> list[tuple[str, str, int, int]]:
        """Every (group, topic, queue, offset), for lag metrics."""
        out: list[tuple[str, str, int, int]] = []
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self._offsets_db):
                g, t, q = bytes(k).decode().split("\0")
                out.append((g, t, int(q), int(_U64.unpack(bytes(v))[0])))
        return out

    def dump(self) -> dict[str, Any]:
        """Whole state as plain data, for tests comparing two nodes."""
        with self.env.begin() as txn:
            return {
                "topics": self.list_topics(),
                "groups": sorted(bytes(k).decode() for k, _ in txn.cursor(db=self._groups_db)),
                "offsets": self.group_offsets(),
                "timer_pending": {bytes(k).decode(): _U64.unpack(bytes(v))[0] for k, v in txn.cursor(db=self._timers_db)},
            }

    def close(self) -> None:
        self.changes_log.flush()
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
        self.env.close()
