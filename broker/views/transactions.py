"""The transactions view (DESIGN §14): open transactions, their decisions, each queue's last
stable offset, and the aborted-transaction index.

It applies ``__txn`` records (``txn.begin``, ``txn.end``), the batches of transactions
(``FLAG_TRANSACTIONAL``, their producer id naming the transaction) and topic deletions, and answers:

- **the last stable offset (LSO)** of a queue: the first queue offset of its oldest open
  transaction (the queue's end when none is open). ``read_committed`` readers stop there. The
  state changes as a batch is applied, before the consume-queue view publishes it at the end of
  the round, so a reader never sees a transaction's batch without seeing it open here, nor an
  aborted batch without its range in the index;
- **aborted ranges** of queue offsets (``aborted_index.py``): ``read_committed`` readers skip them;
- open and recent transactions by transactional id (begin, end, describe, list, fencing).

Persistence follows AKIP-2: the aborted index is an append-only file that grows by the aborts
since the last checkpoint; the checkpoint (an atomic small file) holds the applied offset, the open
transactions, the recent decisions and how many bytes of the index are valid. It is refreshed with
every checkpoint round (the view's applied offset moves with every round, aborts or not), so
recovery replays only from there and appends to the index instead of rebuilding it.
Spec: docs/formats/txn-records.md.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.logformat import txn_records as tr
from broker.storage import atomic_file
from broker.storage.failpoints import failpoint
from broker.views.aborted_index import TOPIC_DELETED, AbortedIndexFile, AbortedRanges, Range, encode_entry
from broker.views.base import View, copy_prefix

CHECKPOINT_MAGIC = b"TMTX"
CHECKPOINT_VERSION = 1
ENDED_MAX = 10_000  # decisions remembered (a retried end answers from here)
QueueKey = tuple[str, int]


@dataclass
class OpenTxn:
    pid: int
    tid: str
    epoch: int
    timeout_ms: int
    check: bool
    begun_ms: int
    first_write_ms: int = 0  # store time of its first batch (0: none yet)
    runs: dict[QueueKey, list[list[int]]] = field(default_factory=dict)  # per queue: [start, end) of its batches
    counted: bool = False  # its commit carries the producer's count of messages sent
    messages: int = 0  # messages of its batches in the log
    coordinator: str = ""  # a participant transaction: the shard deciding it (docs/shards.md)
    prepared: bool = False  # a participant that prepared: only its coordinator ends it now
    parties: list[tr.Party] = field(default_factory=list)  # on a coordinator: its participants

    def first_offset(self, key: QueueKey) -> int:
        return self.runs[key][0][0]

    def to_json(self) -> list[object]:
        return [self.pid, self.tid, self.epoch, self.timeout_ms, self.check, self.begun_ms, self.first_write_ms,
                [[t, q, runs] for (t, q), runs in self.runs.items()], self.counted, self.messages,
                self.coordinator, self.prepared, [p.to_json() for p in self.parties]]

    @classmethod
    def from_json(cls, row: list[Any]) -> OpenTxn:
        pid, tid, epoch, timeout, check, begun, first_write, runs = row[:8]
        counted, messages = row[8:10] if len(row) >= 10 else (False, 0)  # a checkpoint from before counts
        coordinator, prepared, parties = row[10:13] if len(row) >= 13 else ("", False, [])  # before shards
        return cls(int(pid), str(tid), int(epoch), int(timeout), bool(check), int(begun), int(first_write),
                   {(str(t), int(q)): [[int(a), int(b)] for a, b in r] for t, q, r in runs}, bool(counted),
                   int(messages), str(coordinator), bool(prepared), [tr.Party.from_json(p) for p in parties])


@dataclass(frozen=True)
class Ended:
    pid: int
    tid: str
    committed: bool
    reason: str
    ended_ms: int
    begun_ms: int

    def to_json(self) -> list[object]:
        return [self.pid, self.tid, self.committed, self.reason, self.ended_ms, self.begun_ms]

    @classmethod
    def from_json(cls, row: list[Any]) -> Ended:
        pid, tid, committed, reason, ended, begun = row
        return cls(int(pid), str(tid), bool(committed), str(reason), int(ended), int(begun))


@dataclass(frozen=True)
class Undelivered:
    """A coordinator's decision not yet delivered to every participant (docs/shards.md)."""

    pid: int
    tid: str
    commit: bool
    parties: tuple[tr.Party, ...]
    at: int  # the decision's commit offset: delivered only once confirmed (a promoted slave has it)

    def to_json(self) -> list[object]:
        return [self.pid, self.tid, self.commit, [p.to_json() for p in self.parties], self.at]

    @classmethod
    def from_json(cls, row: list[Any]) -> Undelivered:
        pid, tid, commit, parties, at = row
        return cls(int(pid), str(tid), bool(commit), tuple(tr.Party.from_json(p) for p in parties), int(at))


class TxnView(View):
    name = "transactions"

    def __init__(self, directory: str, log_min_offset: int = 0) -> None:
        self.directory = directory
        self.checkpoint_path = f"{directory}/txn.ckpt"
        self.index = AbortedIndexFile(directory)
        self.log_min_offset = log_min_offset
        self.applied_offset = 0
        self.lock = threading.Lock()  # readers (pulls, the master's service) against the dispatcher
        self._clear()

    def _clear(self) -> None:
        self.open: dict[int, OpenTxn] = {}
        self.queue_open: dict[QueueKey, dict[int, int]] = {}  # queue -> open pid -> its first queue offset
        self.latest: OrderedDict[str, tuple[int, int, int]] = OrderedDict()  # tid -> (its latest pid, epoch, begin_id)
        self.ended: OrderedDict[int, Ended] = OrderedDict()
        self.undelivered: dict[int, Undelivered] = {}
        self.aborted = AbortedRanges()
        self.counts = {"committed": 0, "aborted": 0, "timed_out": 0}
        self._pending: list[bytes] = []  # index entries not in the file yet
        self._released: set[QueueKey] = set()  # queues whose LSO moved this round

    # -- reads ------------------------------------------------------------------------------------
    def last_stable_offset(self, topic: str, queue_id: int, end: int) -> int:
        """The first queue offset of the oldest open transaction on the queue, else ``end``."""
        with self.lock:
            firsts = self.queue_open.get((topic, queue_id))
            return min(*firsts.values(), end) if firsts else end

    def aborted_within(self, topic: str, queue_id: int, low: int, high: int) -> list[Range]:
        """Aborted ranges of queue offsets that overlap ``[low, high)``."""
        with self.lock:
            return self.aborted.within((topic, queue_id), low, high)

    def touches(self, key: QueueKey) -> bool:
        """Whether an open transaction wrote to queue ``key``, or an aborted one ever did."""
        with self.lock:
            return key in self.queue_open or self.aborted.has(key)

    def holders(self, key: QueueKey) -> list[int]:
        """The open transactions (producer ids) that wrote to queue ``key``: what holds its LSO back."""
        with self.lock:
            return list(self.queue_open.get(key, ()))

    def runs_on(self, key: QueueKey) -> tuple[list[Range], list[Range]]:
        """Queue-offset ranges of queue ``key`` written by transactions open now, and by aborted ones."""
        with self.lock:
            held = [(a, b) for pid in self.queue_open.get(key, {}) for a, b in self.open[pid].runs.get(key, ())]
            return held, self.aborted.within(key, 0, 1 << 63)

    def take_released(self) -> set[QueueKey]:
        """Queues whose LSO moved since the last call (their parked readers are told)."""
        with self.lock:
            out, self._released = self._released, set()
            return out

    def open_for(self, tid: str) -> OpenTxn | None:
        with self.lock:
            latest = self.latest.get(tid)
            return self.open.get(latest[0]) if latest else None

    def ended_of(self, pid: int) -> Ended | None:
        with self.lock:
            return self.ended.get(pid)

    def latest_of(self, tid: str) -> tuple[int, int, int] | None:
        with self.lock:
            return self.latest.get(tid)

    def open_transactions(self) -> list[OpenTxn]:
        with self.lock:
            return sorted(self.open.values(), key=lambda t: t.begun_ms)

    def undelivered_decisions(self) -> list[Undelivered]:
        with self.lock:
            return list(self.undelivered.values())

    def lso_report(self, end_of: Callable[[QueueKey], int | None], now_ms: int) -> tuple[dict[str, int], float]:
        """Per topic, the queue ends minus their LSOs (``end_of``: a queue's end, None when gone);
        and the longest time an LSO has stood still while others' messages wait after it (the
        holding transaction's age since its first write, in seconds)."""
        lag: dict[str, int] = {}
        stalled_ms = 0
        with self.lock:
            for key, firsts in self.queue_open.items():
                end = end_of(key)
                if end is None:
                    continue
                pid = min(firsts, key=lambda p: firsts[p])
                lso = firsts[pid]
                lag[key[0]] = lag.get(key[0], 0) + max(0, end - lso)
                holder = self.open.get(pid)
                if holder is not None and key in holder.runs and end > holder.runs[key][-1][1]:
                    stalled_ms = max(stalled_ms, now_ms - (holder.first_write_ms or holder.begun_ms))
        return lag, stalled_ms / 1000.0

    def summary(self) -> dict[str, int]:
        with self.lock:
            oldest = min((t.begun_ms for t in self.open.values()), default=0)
            return {"open": len(self.open), "oldest_begun_ms": oldest, **self.counts,
                    "aborted_ranges": self.aborted.total, "prepared": sum(t.prepared for t in self.open.values()),
                    "undelivered": len(self.undelivered)}

    # -- recovery ---------------------------------------------------------------------------------
    def load(self) -> bool:
        loaded = atomic_file.load(self.checkpoint_path, CHECKPOINT_MAGIC, CHECKPOINT_VERSION)
        if loaded is None:
            if not atomic_file.exists_any(self.checkpoint_path) and self.log_min_offset > 0:
                # a data directory from before transactions: its log holds no __txn record
                self.applied_offset = self.log_min_offset
                self.index.truncate(0)
                return True
            return False
        state = json.loads(loaded.payload)
        self._clear()
        self.applied_offset = int(state["applied_offset"])
        self.open = {t.pid: t for t in map(OpenTxn.from_json, state["open"])}
        # a row of 3 fields, from before begin ids, reads as begin id 0
        self.latest = OrderedDict((str(row[0]), (int(row[1]), int(row[2]), int(row[3]) if len(row) > 3 else 0))
                                  for row in state["latest"])
        self.ended = OrderedDict((e.pid, e) for e in map(Ended.from_json, state["ended"]))
        self.counts = {k: int(v) for k, v in state["counts"].items()}
        self.undelivered = {u.pid: u for u in map(Undelivered.from_json, state.get("undelivered", ()))}
        for t in self.open.values():
            for key in t.runs:
                self.queue_open.setdefault(key, {})[t.pid] = t.first_offset(key)
        self.index.load(int(state["aborted_bytes"]), self.aborted)
        return True

    def reset(self) -> None:
        with self.lock:
            self._clear()
        self.applied_offset = 0
        self.index.truncate(0)

    # -- applying -------------------------------------------------------------------------------
    def apply(self, header: bf.BatchHeader, batch: memoryview) -> None:
        if header.topic == tr.TXN_TOPIC:
            for rec in tr.records(header, batch):
                with self.lock:
                    if isinstance(rec, tr.Begin):
                        self._begin(rec)
                    elif isinstance(rec, tr.End):
                        self._end(rec)
                    else:
                        self._coordination(rec)
        elif header.flags & bf.FLAG_TRANSACTIONAL:
            with self.lock:
                self._write(header)
        elif header.topic == system_records.METADATA_TOPIC:
            for _, key, _, body in bf.iter_records(batch, header):
                change, fields = system_records.decode(key, body)
                if change == system_records.TOPIC_DELETE:
                    with self.lock:
                        self._topic_deleted(str(fields["topic"]))

    def _begin(self, rec: tr.Begin) -> None:
        self.open[rec.pid] = OpenTxn(rec.pid, rec.tid, rec.epoch, rec.timeout_ms, rec.check, rec.at_ms,
                                     counted=rec.counted, coordinator=rec.coordinator)
        self.latest[rec.tid] = (rec.pid, rec.epoch, rec.begin_id)
        self.latest.move_to_end(rec.tid)
        if len(self.latest) > tr.TIDS_MAX:
            open_tids = {t.tid for t in self.open.values()}
            for tid in list(self.latest):  # oldest first; an open transaction's id is never forgotten
                if len(self.latest) <= tr.TIDS_MAX:
                    break
                if tid not in open_tids:
                    del self.latest[tid]

    def _end(self, rec: tr.End) -> None:
        t = self.open.pop(rec.pid, None)
        if t is None:
            return  # ended before (a record a crash separated from its answer and appended again)
        for key, runs in t.runs.items():
            firsts = self.queue_open.get(key)
            if firsts is not None:
                firsts.pop(rec.pid, None)
                if not firsts:
                    del self.queue_open[key]
            self._released.add(key)
            if not rec.commit:
                for start, end in runs:
                    self.aborted.add(key, start, end)
                    self._pending.append(encode_entry(rec.pid, key[0], key[1], start, end))
        if t.parties or rec.participants:  # a coordinator's decision: delivered to the participants it names
            self.undelivered[rec.pid] = Undelivered(rec.pid, rec.tid, rec.commit, rec.participants or tuple(t.parties),
                                                    rec.offset)
        self.ended[rec.pid] = Ended(rec.pid, rec.tid, rec.commit, rec.reason, rec.at_ms, t.begun_ms)
        while len(self.ended) > ENDED_MAX:
            self.ended.popitem(last=False)
        if rec.commit:
            self.counts["committed"] += 1
        else:
            self.counts["aborted"] += 1
            if rec.reason == "timeout":
                self.counts["timed_out"] += 1

    def _coordination(self, rec: tr.Participant | tr.Prepare | tr.Delivered) -> None:
        if isinstance(rec, tr.Delivered):
            self.undelivered.pop(rec.pid, None)
            return
        t = self.open.get(rec.pid)
        if t is None:
            return
        if isinstance(rec, tr.Participant):
            t.parties.append(rec.party)
        else:
            t.prepared = True

    def _write(self, header: bf.BatchHeader) -> None:
        key = (header.topic, header.queue_id)
        start, end = header.base_queue_offset, header.next_queue_offset
        t = self.open.get(header.producer_id)
        if t is None:  # a batch of a transaction that is not open (the appender refuses them): never visible
            self.aborted.add(key, start, end)
            self._pending.append(encode_entry(header.producer_id, key[0], key[1], start, end))
            return
        if not t.first_write_ms:
            t.first_write_ms = header.store_time_ms
        t.messages += header.record_count
        runs = t.runs.get(key)
        if runs is None:
            t.runs[key] = [[start, end]]
            self.queue_open.setdefault(key, {})[t.pid] = start
        elif runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end])

    def _topic_deleted(self, topic: str) -> None:
        """Its queue offsets restart at 0 if it is created again: forget its ranges and LSOs."""
        self.aborted.drop_topic(topic)
        self._pending.append(encode_entry(0, topic, TOPIC_DELETED, 0, 0))
        for key in [k for k in self.queue_open if k[0] == topic]:
            del self.queue_open[key]
            self._released.add(key)
        for t in self.open.values():
            for key in [k for k in t.runs if k[0] == topic]:
                del t.runs[key]

    def end_round(self, offset: int) -> None:
        self.applied_offset = offset

    # -- checkpoints ------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        with self.lock:
            pending, self._pending = self._pending, []
            state = {
                "applied_offset": self.applied_offset,
                "open": [t.to_json() for t in self.open.values()],
                "latest": [[tid, pid, epoch, begin_id] for tid, (pid, epoch, begin_id) in self.latest.items()],
                "ended": [e.to_json() for e in self.ended.values()],
                "counts": dict(self.counts),
                "undelivered": [u.to_json() for u in self.undelivered.values()],
            }
        try:
            self.index.append(pending)
        except OSError:
            with self.lock:  # written with the next checkpoint
                self._pending[:0] = pending
            raise
        if pending:
            failpoint("txn_after_index_append")
        state["aborted_bytes"] = self.index.valid_bytes
        atomic_file.persist(self.checkpoint_path, CHECKPOINT_MAGIC, CHECKPOINT_VERSION, json.dumps(state).encode())

    def stage(self, data_dir: str, staging: str) -> None:
        copy_prefix(self.checkpoint_path, data_dir, staging)
        copy_prefix(self.index.path, data_dir, staging, self.index.valid_bytes)
