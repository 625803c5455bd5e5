"""Producer state for idempotent sends: per (producer id, topic, queue) the last few batches.

A retried batch (same producer id and base sequence) gets its original receipt back and is
stored once. The store keeps two instances: this view, applied up to the confirm offset and
checkpointed, and a *tail* copy updated at append time (it must also see unconfirmed batches).
The table is bounded: the least recently used producers are forgotten past ``producers_max``.

Checkpoint: atomic file ``producer_state.ckpt``, JSON payload; docs/formats/producer-state.md.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from broker.logformat import system_records
from broker.logformat.batch import FLAG_FORWARDED, NO_SEQUENCE, BatchHeader, iter_records
from broker.storage import atomic_file
from broker.views.base import View, copy_prefix

CHECKPOINT_MAGIC = b"TMPS"
CHECKPOINT_VERSION = 1
BATCHES_KEPT_PER_PRODUCER = 5
PRODUCERS_MAX = 100_000
_QUEUE_START = system_records.QUEUE_START.encode()

Key = tuple[int, str, int]
# (base_sequence, record_count, base_offset, base_queue_offset)
Remembered = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class SequenceVerdict:
    """What to do with an incoming batch: append it, or answer with ``duplicate_of``."""

    duplicate_of: Remembered | None = None
    error: str = ""


class ProducerTable:
    """Clients' producers, and apart from them the forwarded timers of queues that moved here
    (``forwarded``: one pseudo-producer per timer, docs/shards.md), so that those never push a
    client's producer out nor count among a queue's latest producers."""

    def __init__(self, producers_max: int = PRODUCERS_MAX) -> None:
        self.producers_max = producers_max
        self.table: OrderedDict[Key, list[Remembered]] = OrderedDict()
        self.forwarded: OrderedDict[Key, list[Remembered]] = OrderedDict()
        self._undo: dict[tuple[Key, bool], list[Remembered] | None] | None = None

    def check(self, producer_id: int, topic: str, queue_id: int, base_sequence: int,
              forwarded: bool = False) -> SequenceVerdict:
        if producer_id == 0 or base_sequence == NO_SEQUENCE:
            return SequenceVerdict()
        batches = (self.forwarded if forwarded else self.table).get((producer_id, topic, queue_id))
        if not batches:
            return SequenceVerdict()
        for remembered in batches:
            if remembered[0] == base_sequence:
                return SequenceVerdict(duplicate_of=remembered)
        last = batches[-1]
        expected = last[0] + last[1]
        if base_sequence != expected:
            return SequenceVerdict(error=f"out-of-order sequence {base_sequence} for producer {producer_id}, expected {expected}")
        return SequenceVerdict()

    def record(self, header: BatchHeader) -> None:
        self.record_batch(header.producer_id, header.topic, header.queue_id, header.base_sequence,
                          header.record_count, header.base_offset, header.base_queue_offset,
                          forwarded=bool(header.flags & FLAG_FORWARDED))

    def record_batch(self, producer_id: int, topic: str, queue_id: int, base_sequence: int, record_count: int,
                     base_offset: int, base_queue_offset: int, *, forwarded: bool = False) -> None:
        if producer_id == 0 or base_sequence == NO_SEQUENCE:
            return
        table = self.forwarded if forwarded else self.table
        key = (producer_id, topic, queue_id)
        batches = table.pop(key, None)
        if self._undo is not None and (key, forwarded) not in self._undo:
            self._undo[(key, forwarded)] = batches
        remembered = (base_sequence, record_count, base_offset, base_queue_offset)
        # a new list, never one changed in place: copies of the table share the lists
        table[key] = [*batches[1 - BATCHES_KEPT_PER_PRODUCER:], remembered] if batches else [remembered]
        while len(table) > self.producers_max:
            table.popitem(last=False)

    def of_queue(self, topic: str, queue_id: int, most: int) -> list[list[int]]:
        """The last batch of each producer that wrote ``queue_id`` of ``topic``, the ``most`` most
        recent of them, oldest first: ``[producer id, base sequence, count, base offset, base queue
        offset]`` (what a move carries to the queue's next shard, docs/shards.md)."""
        rows = [[pid, *batches[-1]] for (pid, t, q), batches in self.table.items() if t == topic and q == queue_id]
        return rows[-most:] if most else []

    def seed(self, topic: str, queue_id: int, rows: list[list[int]], at: int) -> None:
        """Remember batches another shard's log holds (``of_queue`` there): a retry of one of them
        sent here after the queue moved is answered as a duplicate, and the next sequence follows it.
        Their log offset here is ``at`` (the record that started the queue): a duplicate's answer
        waits for this log, not for an offset of the other one."""
        for pid, seq, count, _, queue_offset in rows:
            self.record_batch(int(pid), topic, queue_id, int(seq), int(count), at, int(queue_offset))

    def savepoint(self) -> dict[tuple[Key, bool], list[Remembered] | None]:
        """Start remembering what ``record_batch`` changes, for ``rollback``."""
        self._undo = {}
        return self._undo

    def rollback(self, undo: dict[tuple[Key, bool], list[Remembered] | None]) -> None:
        """Undo every change since ``savepoint`` (a failed append must leave no trace)."""
        for (key, forwarded), batches in undo.items():
            table = self.forwarded if forwarded else self.table
            if batches is None:
                table.pop(key, None)
            else:
                table[key] = batches
        undo.clear()

    def copy(self) -> ProducerTable:
        """An independent table (the lists of remembered batches are shared: never changed in place)."""
        other = ProducerTable(self.producers_max)
        other.table = OrderedDict(self.table)
        other.forwarded = OrderedDict(self.forwarded)
        return other

    def to_json(self) -> list[list[object]]:
        return _rows(self.table)

    def forwarded_json(self) -> list[list[object]]:
        return _rows(self.forwarded)

    @classmethod
    def from_json(cls, rows: list[list[Any]], producers_max: int = PRODUCERS_MAX,
                  forwarded: list[list[Any]] | None = None) -> ProducerTable:
        t = cls(producers_max)
        # the payload is CRC-checked and written by ``to_json``: a wrong shape raises (unpacking)
        t.table = _table(rows)
        t.forwarded = _table(forwarded or [])
        return t


def _rows(table: OrderedDict[Key, list[Remembered]]) -> list[list[object]]:
    return [[k[0], k[1], k[2], [list(b) for b in v]] for k, v in table.items()]


def _table(rows: list[list[Any]]) -> OrderedDict[Key, list[Remembered]]:
    return OrderedDict(((int(pid), str(topic), int(queue)), [(a, b, c, d) for a, b, c, d in batches])
                       for pid, topic, queue, batches in rows)


class ProducerStateView(View):
    name = "producer_state"

    def __init__(self, checkpoint_path: str) -> None:
        self.checkpoint_path = checkpoint_path
        self.applied_offset = 0
        self.producers = ProducerTable()

    def load(self) -> bool:
        loaded = atomic_file.load(self.checkpoint_path, CHECKPOINT_MAGIC, CHECKPOINT_VERSION)
        if loaded is None:
            return False
        state = json.loads(loaded.payload)
        producers = ProducerTable.from_json(state["producers"], forwarded=state.get("forwarded"))
        applied = int(state["applied_offset"])
        self.producers, self.applied_offset = producers, applied
        return True

    def reset(self) -> None:
        self.producers = ProducerTable()
        self.applied_offset = 0

    def apply(self, header: BatchHeader, batch: memoryview) -> None:
        self.producers.record(header)
        if header.topic == system_records.METADATA_TOPIC:  # a queue moved here: its producers' last batches
            for _, key, _, body in iter_records(batch, header):
                if bytes(key) == _QUEUE_START:
                    _, fields = system_records.decode(key, body)
                    self.producers.seed(str(fields["topic"]), int(fields["queue"]), fields.get("producers", []),
                                        header.base_offset)

    def end_round(self, offset: int) -> None:
        self.applied_offset = offset

    def checkpoint(self) -> None:
        payload = json.dumps({"applied_offset": self.applied_offset, "producers": self.producers.to_json(),
                              "forwarded": self.producers.forwarded_json()})
        atomic_file.persist(self.checkpoint_path, CHECKPOINT_MAGIC, CHECKPOINT_VERSION, payload.encode())

    def stage(self, data_dir: str, staging: str) -> None:
        copy_prefix(self.checkpoint_path, data_dir, staging)
