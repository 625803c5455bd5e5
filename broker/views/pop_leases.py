"""The pop view: per (group, topic, queue) the lease state of pop mode (DESIGN §12), from ``__pop``.

A queue's state is a window ``[base, cursor)`` of queue offsets: everything below ``base`` is
finished (acked, sent to the DLQ, or removed by retention), ``cursor`` is the next offset never
leased. For each offset in the window, in parallel arrays (about 19 bytes a message, so a million
leases in flight take ~19 MB): ``until`` (epoch ms: while leased, the end of the lease; after a
nack, when it becomes visible again), ``count`` (deliveries so far), ``tag`` (the lease's tag that
receipt handles carry; 0 when no handle is valid) and ``done``. A message is *available* when it is
not done and ``until`` has passed; the master re-leases available messages before fresh ones.
Expiry needs no record: the deadline is in the lease record, so every replica reaches the same
state by applying the same records, and the master's clock decides when a lease ended.

Checkpoint: atomic file ``pop_leases.ckpt`` (docs/formats/pop-leases.md): a JSON header per queue
followed by the raw arrays; restart loads it with ``numpy.frombuffer`` and replays ``__pop`` above.
"""

from __future__ import annotations

import json
import struct
import threading
from dataclasses import dataclass, field

import numpy as np

from broker.logformat import batch as bf
from broker.logformat import pop_records as pr
from broker.logformat import system_records
from broker.storage import atomic_file
from broker.views.base import View, copy_prefix

CHECKPOINT_MAGIC = b"TMPL"
CHECKPOINT_VERSION = 1
_LEN = struct.Struct("<I")
MIN_CAPACITY = 64
LeaseKey = tuple[str, str, int]  # group, topic, queue
# why a handle's lease cannot be ended (PopQueue.check); 0: it can
NOT_LEASED, ENDED, RETAGGED, EXPIRED = 1, 2, 3, 4
_TOPIC_CHANGES = (system_records.TOPIC_CREATE.encode(), system_records.TOPIC_DELETE.encode())


class PopQueue:
    """The lease window of one (group, topic, queue)."""

    __slots__ = ("base", "count", "cursor", "done", "tag", "until")

    def __init__(self, base: int) -> None:
        self.base = base
        self.cursor = base
        self.until = np.zeros(0, dtype=np.int64)
        self.count = np.zeros(0, dtype=np.uint16)
        self.tag = np.zeros(0, dtype=np.uint64)
        self.done = np.zeros(0, dtype=np.bool_)

    @property
    def window(self) -> int:
        return self.cursor - self.base

    def in_flight(self) -> int:
        """Messages delivered at least once and not finished (leased, or waiting to come back)."""
        return int(self.window - np.count_nonzero(self.done[: self.window]))

    def _grow(self, end: int) -> None:
        need = end - self.base
        if need <= len(self.until):
            return
        cap = max(need, 2 * len(self.until), MIN_CAPACITY)
        n = self.window
        for name in ("until", "count", "tag", "done"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[:n] = old[:n]
            setattr(self, name, new)

    def _index(self, offsets: np.ndarray) -> np.ndarray:
        """Window indices of ``offsets`` that lie in the window (others are finished already)."""
        idx = offsets - self.base
        return idx[(idx >= 0) & (idx < self.window)]

    def lease(self, offsets: np.ndarray, until_ms: int, tag: int) -> int:
        """Lease ``offsets`` (from the window or fresh, at ``cursor``); return how many are re-deliveries."""
        if offsets.size == 0:
            return 0
        top = int(offsets.max()) + 1
        if top > self.cursor:
            fresh_from = int(offsets[offsets >= self.cursor].min())
            if self.base == self.cursor:  # an empty window begins again at the fresh ones (past a gap at no cost)
                self.base = self.cursor = fresh_from
            self._grow(top)
            if fresh_from > self.cursor:  # skipped (removed by retention before the first delivery)
                self.done[self.window : fresh_from - self.base] = True
            self.cursor = top
        idx = self._index(offsets)
        again = int(np.count_nonzero(self.count[idx]))
        self.count[idx] += 1
        self.until[idx] = until_ms
        self.tag[idx] = tag
        return again

    def finish(self, offsets: np.ndarray) -> None:
        """Acked, sent to the DLQ or gone: never delivered again."""
        idx = self._index(offsets)
        self.done[idx] = True
        self.tag[idx] = 0
        self._pass_over(offsets)
        self._advance()

    def _pass_over(self, offsets: np.ndarray) -> None:
        """Offsets gone before their first delivery (aborted, removed by retention) from ``cursor``
        on: the cursor passes over the run of them that starts at it (else a pick ending at the next
        shard's segment would ask for the same ones for good)."""
        ahead = np.unique(offsets[offsets >= self.cursor])
        if not ahead.size or int(ahead[0]) != self.cursor:
            return
        apart = np.flatnonzero(ahead != np.arange(self.cursor, self.cursor + ahead.size))
        end = self.cursor + (int(apart[0]) if apart.size else int(ahead.size))
        if self.base == self.cursor:  # an empty window begins again past them
            self.base = self.cursor = end
            return
        self._grow(end)
        self.done[self.window : end - self.base] = True
        self.cursor = end

    def make_visible(self, offsets: np.ndarray, at_ms: int) -> None:
        """Nacked: no handle is valid any more; available again at ``at_ms``."""
        idx = self._index(offsets)
        idx = idx[~self.done[idx]]
        self.tag[idx] = 0
        self.until[idx] = at_ms

    def move(self, offset: int, until_ms: int, tag: int) -> None:
        idx = self._index(np.array([offset], dtype=np.int64))
        idx = idx[~self.done[idx]]
        self.until[idx] = until_ms
        self.tag[idx] = tag

    def _advance(self) -> None:
        n = self.window
        if n == 0:
            return
        open_ = np.flatnonzero(~self.done[:n])
        k = int(open_[0]) if open_.size else n
        if k:
            self.base += k
            for name in ("until", "count", "tag", "done"):
                setattr(self, name, getattr(self, name)[k:])

    # -- the master's questions ----------------------------------------------------------------
    def available(self, now_ms: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` offsets whose lease ended (oldest first) and their delivery counts."""
        n = self.window
        idx = np.flatnonzero(~self.done[:n] & (self.until[:n] <= now_ms))[:limit]
        return idx + self.base, self.count[idx].astype(np.int64)

    def _open(self, finished: np.ndarray | None) -> np.ndarray:
        """Per window index: not done, nor among ``finished`` (offsets whose leases end now)."""
        open_ = ~self.done[: self.window]
        if finished is not None:
            open_[self._index(finished)] = False
        return open_

    def base_after(self, finished: np.ndarray) -> int:
        """Where ``base`` will be once ``finished`` are done too."""
        open_ = self._open(finished)
        return self.base + (int(np.argmax(open_)) if open_.any() else self.window)

    def next_visible_ms(self, finished: np.ndarray | None = None) -> int | None:
        """When the next leased message becomes available again (None: nothing leased), not
        counting ``finished``."""
        live = self.until[: self.window][self._open(finished)]
        return int(live.min()) if live.size else None

    def check(self, offsets: np.ndarray, tag: int, now_ms: int) -> np.ndarray:
        """Per offset: 0 when a lease under ``tag`` holds it until after ``now_ms``, else why not."""
        i = offsets - self.base
        inside = (i >= 0) & (i < self.window)
        reasons = np.full(offsets.size, NOT_LEASED, dtype=np.int8)
        j = i[inside]
        r = np.zeros(j.size, dtype=np.int8)
        r[self.until[j] <= now_ms] = EXPIRED
        r[self.tag[j] != np.uint64(tag)] = RETAGGED
        r[self.done[j]] = ENDED
        reasons[inside] = r
        return reasons


@dataclass
class GroupCounters:
    redeliveries: int = 0
    dlq: int = 0
    queues: dict[tuple[str, int], PopQueue] = field(default_factory=dict)


class PopLeaseView(View):
    name = "pop"

    def __init__(self, checkpoint_path: str, log_min_offset: int = 0) -> None:
        self.checkpoint_path = checkpoint_path
        self.log_min_offset = log_min_offset
        self.applied_offset = 0
        self.groups: dict[str, GroupCounters] = {}
        self.lock = threading.Lock()  # readers (describe, the master's selection) against the dispatcher

    # -- reads ------------------------------------------------------------------------------------
    def queue(self, group: str, topic: str, queue_id: int) -> PopQueue | None:
        g = self.groups.get(group)
        return g.queues.get((topic, queue_id)) if g else None

    def groups_of(self, topic: str, queue_id: int) -> list[str]:
        """The groups with a window on one queue (a move carries them: docs/shards.md)."""
        with self.lock:
            return sorted(name for name, g in self.groups.items() if (topic, queue_id) in g.queues)

    def in_flight_total(self) -> int:
        with self.lock:
            return sum(pq.in_flight() for g in self.groups.values() for pq in g.queues.values())

    # -- recovery ---------------------------------------------------------------------------------
    def load(self) -> bool:
        loaded = atomic_file.load(self.checkpoint_path, CHECKPOINT_MAGIC, CHECKPOINT_VERSION)
        if loaded is None:
            if not atomic_file.exists_any(self.checkpoint_path) and self.log_min_offset > 0:
                # a data directory from before pop mode: its log holds no __pop record
                self.applied_offset = self.log_min_offset
                return True
            return False
        payload = memoryview(loaded.payload)
        (head_len,) = _LEN.unpack_from(payload, 0)
        head = json.loads(bytes(payload[4 : 4 + head_len]))
        pos = 4 + head_len
        groups: dict[str, GroupCounters] = {}
        for g in head["groups"]:
            counters = GroupCounters(int(g["redeliveries"]), int(g["dlq"]))
            for q in g["queues"]:
                pq = PopQueue(int(q["base"]))
                n = int(q["window"])
                pq.cursor = pq.base + n
                for name, dtype in (("until", np.int64), ("count", np.uint16), ("tag", np.uint64), ("done", np.bool_)):
                    size = n * np.dtype(dtype).itemsize
                    if pos + size > len(payload):
                        raise ValueError("pop checkpoint shorter than its header says")
                    setattr(pq, name, np.frombuffer(payload[pos : pos + size], dtype=dtype).copy())
                    pos += size
                counters.queues[(str(q["topic"]), int(q["queue"]))] = pq
            groups[str(g["group"])] = counters
        self.groups = groups
        self.applied_offset = int(head["applied_offset"])
        return True

    def reset(self) -> None:
        self.groups = {}
        self.applied_offset = 0

    # -- applying ---------------------------------------------------------------------------------
    def apply(self, header: bf.BatchHeader, batch: memoryview) -> None:
        if header.topic == pr.POP_TOPIC:
            with self.lock:
                for _, key, _, body in bf.iter_records(batch, header):
                    self._apply_record(bytes(key).decode(), json.loads(bytes(body)))
        elif header.topic == system_records.METADATA_TOPIC:
            for _, key, _, body in bf.iter_records(batch, header):
                if bytes(key) in _TOPIC_CHANGES:  # a deleted or re-created topic restarts its offsets
                    self._drop_topic(str(json.loads(bytes(body))["topic"]))

    def _drop_topic(self, topic: str) -> None:
        with self.lock:
            for g in self.groups.values():
                for key in [k for k in g.queues if k[0] == topic]:
                    del g.queues[key]

    def _apply_record(self, kind: str, r: dict) -> None:  # type: ignore[type-arg]
        group = str(r["g"])
        g = self.groups.setdefault(group, GroupCounters())
        if kind == pr.LEASE:
            topic = str(r["t"])
            for entry in r["queues"]:
                key = (topic, int(entry["q"]))
                if "from" in entry:
                    g.queues[key] = PopQueue(int(entry["from"]))
                pq = g.queues.get(key)
                if pq is None:
                    continue
                g.redeliveries += pq.lease(pr.from_runs(entry["runs"]), int(r["until"]), int(r["tag"]))
                dead = pr.from_runs(entry["dead"])
                g.dlq += int(dead.size)
                pq.finish(np.concatenate((dead, pr.from_runs(entry["gone"]))))
        elif kind in (pr.ACK, pr.NACK):
            for topic, q, runs in r["acks" if kind == pr.ACK else "nacks"]:
                pq = g.queues.get((str(topic), int(q)))
                if pq is None:
                    continue
                if kind == pr.ACK:
                    pq.finish(pr.from_runs(runs))
                else:
                    pq.make_visible(pr.from_runs(runs), int(r["until"]))
        elif kind == pr.INVISIBLE:
            pq = g.queues.get((str(r["t"]), int(r["q"])))
            if pq is not None:
                pq.move(int(r["o"]), int(r["until"]), int(r["tag"]))

    def end_round(self, offset: int) -> None:
        with self.lock:
            self.applied_offset = offset

    def checkpoint(self) -> None:
        with self.lock:
            head: dict[str, object] = {"applied_offset": self.applied_offset, "groups": []}
            arrays: list[bytes] = []
            groups: list[dict[str, object]] = []
            for name, g in self.groups.items():
                queues = []
                for (topic, q), pq in g.queues.items():
                    n = pq.window
                    queues.append({"topic": topic, "queue": q, "base": pq.base, "window": n})
                    arrays += [pq.until[:n].tobytes(), pq.count[:n].tobytes(), pq.tag[:n].tobytes(),
                               pq.done[:n].tobytes()]
                groups.append({"group": name, "redeliveries": g.redeliveries, "dlq": g.dlq, "queues": queues})
            head["groups"] = groups
        raw = json.dumps(head, separators=(",", ":")).encode()
        atomic_file.persist(self.checkpoint_path, CHECKPOINT_MAGIC, CHECKPOINT_VERSION,
                            b"".join([_LEN.pack(len(raw)), raw, *arrays]))

    def stage(self, data_dir: str, staging: str) -> None:
        copy_prefix(self.checkpoint_path, data_dir, staging)
