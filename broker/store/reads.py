"""The read side: pulls, queue bounds, seek by time, and log reads that reach into tiered storage.

Readers see only what the views applied, which is below the confirm offset (DESIGN §2): a pull
finds batches through the queue's consume-queue entries and reads each run of adjacent batches
with one pread. Below the local log start, bytes come from a registered ``ColdReader``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from broker import metrics
from broker.errors import BrokerError, invalid, not_found, shown
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.logformat import timer_props as timer_records
from broker.ports import ColdReader
from broker.storage.commitlog import CommitLog
from broker.storage.failpoints import failpoint
from broker.store.viewset import ViewSet
from broker.store.watermarks import Watermarks
from broker.views.consume_queue import Entry, QueueFile

PULL_ENTRIES_PER_READ = 256
PULL_ENTRIES_FIRST_READ = 16  # then 256: a pull or pop within one batch of 1,000 made 256 entries to use one


@dataclass(frozen=True, slots=True)
class _Found:
    """What a pull answers: consume-queue entries (none at the end of the queue), the records of
    the first batch before the offset asked for, the records answered, the queue offset to go on
    from, the queue's bounds (``high``: its LSO for a read_committed pull)."""

    entries: list[Entry]
    skip: int
    count: int
    next_offset: int
    low: int
    high: int


@dataclass(frozen=True, slots=True)
class LocalPull:
    """A pull's answer as spans of segment files: (path, position in the file, bytes)."""

    spans: list[tuple[str, int, int]]
    skip_first: int
    count: int
    next_offset: int
    min_offset: int
    max_offset: int


@dataclass(frozen=True, slots=True)
class PullResult:
    batches: list[bytes]  # runs of whole, adjacent batches
    skip_first: int  # records of the first batch before the requested offset
    count: int
    next_offset: int
    min_offset: int
    max_offset: int


class Reads:
    def __init__(self, log_: CommitLog, views: ViewSet, watermarks: Watermarks, closing: Callable[[], bool]) -> None:
        self.log = log_
        self.views = views
        self.watermarks = watermarks
        self.closing = closing
        self.cold_reader: ColdReader | None = None
        self._stop: threading.Event = watermarks.stop

    def register_cold_reader(self, reader: ColdReader) -> None:
        self.cold_reader = reader

    def queue_file(self, topic: str, queue_id: int) -> QueueFile:
        metadata = self.views.metadata
        if not topic.startswith(system_records.SYSTEM_PREFIX) and metadata.topic(topic) is None:
            raise not_found(f"unknown topic {shown(topic)}")
        qf = self.views.queues.queue(topic, queue_id)
        if qf is None:
            if topic in system_records.SYSTEM_TOPICS or metadata.topic(topic) is not None:
                raise invalid(f"queue {queue_id} out of range for topic {shown(topic)}")
            raise not_found(f"unknown topic {shown(topic)}")
        return qf

    def queue_bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        """(min readable queue offset, next queue offset) below the confirm offset."""
        qf = self.queue_file(topic, queue_id)
        log_min = self.readable_min_offset()
        i = qf.first_at_commit(log_min) if log_min else 0
        low = qf.entry(i).base_queue_offset if i < qf.entries else qf.next_queue_offset
        return low, qf.next_queue_offset

    def committed_bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        """``queue_bounds`` as a read_committed reader sees them: the end is the queue's LSO (lag
        is measured to it)."""
        low, end = self.queue_bounds(topic, queue_id)
        return low, self.stable_end(topic, queue_id, end, True)

    def pull(self, topic: str, queue_id: int, offset: int, max_messages: int, max_bytes: int, max_wait_ms: int,
             committed: bool = True) -> PullResult:
        """The batches from queue offset ``offset``; ``committed`` (read_committed): only below the
        queue's LSO, aborted transactions' batches left out (their offsets are gaps)."""
        f = self._find(topic, queue_id, offset, max_messages, max_bytes, max_wait_ms, committed)
        batches = self._read_batches(f.entries)
        _count(f)
        return PullResult(batches, f.skip, f.count, f.next_offset, f.low, f.high)

    def pull_spans(self, topic: str, queue_id: int, offset: int, max_messages: int, max_bytes: int,
                   max_wait_ms: int, committed: bool = True) -> LocalPull:
        """What ``pull`` would answer, with each run of batches as spans of segment files (for a
        reader on this host, ``PullLocal``); FAILED_PRECONDITION when a run is not in local segments."""
        f = self._find(topic, queue_id, offset, max_messages, max_bytes, max_wait_ms, committed)
        spans: list[tuple[str, int, int]] = []
        for start, end in _runs(f.entries):
            located = self.log.locate(start, end - start)
            if sum(n for _, _, n in located) != end - start:
                raise BrokerError("FAILED_PRECONDITION", f"log range {start}..{end} is below the local log start "
                                  "(in tiered storage, or deleted by retention meanwhile): read it with Pull")
            spans += located
        _count(f)
        return LocalPull(spans, f.skip, f.count, f.next_offset, f.low, f.high)

    def stable_end(self, topic: str, queue_id: int, end: int, committed: bool) -> int:
        """Where a reader's view of the queue ends: ``end``, or for read_committed the LSO."""
        if not committed or topic.startswith(system_records.SYSTEM_PREFIX):
            return end
        return self.views.txns.last_stable_offset(topic, queue_id, end)

    def scheduled_in_transactions(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For scheduled timer records at these commit offsets: (in a transaction still open, in an
        aborted one), as masks. Their batches are ``__timer`` queue 0's; a transaction's ranges of
        queue offsets there are turned into commit-offset ranges (two lookups each)."""
        key = (system_records.TIMER_TOPIC, 0)
        none = np.zeros(len(offsets), dtype=bool)
        qf = self.views.queues.queue(*key)
        if qf is None or not len(offsets) or not self.views.txns.touches(key):  # the common case: no lookup
            return none, none
        held, aborted = self.views.txns.runs_on(key)
        return (_within(offsets, [self._commit_range(qf, a, b) for a, b in held]),
                _within(offsets, [self._commit_range(qf, a, b) for a, b in aborted]))

    @staticmethod
    def _commit_range(qf: QueueFile, start: int, end: int) -> tuple[int, int]:
        """The log bytes of the whole batches holding queue offsets ``[start, end)``."""
        last = qf.entry(qf.locate(end - 1))
        return qf.entry(qf.locate(start)).commit_offset, last.commit_offset + last.batch_bytes

    def aborted_mask(self, topic: str, queue_id: int, offsets: np.ndarray) -> np.ndarray:
        """Which of ``offsets`` (ascending queue offsets) belong to aborted transactions."""
        if not len(offsets):
            return np.zeros(0, dtype=bool)
        return _within(offsets, self.aborted_within(topic, queue_id, int(offsets[0]), int(offsets[-1]) + 1))

    def aborted_within(self, topic: str, queue_id: int, low: int, high: int) -> list[tuple[int, int]]:
        """Ranges ``[start, end)`` of aborted transactions' queue offsets that overlap ``[low, high)``."""
        if topic.startswith(system_records.SYSTEM_PREFIX):
            return []
        return self.views.txns.aborted_within(topic, queue_id, low, high)

    def _find(self, topic: str, queue_id: int, offset: int, max_messages: int, max_bytes: int, max_wait_ms: int,
              committed: bool = True) -> _Found:
        """What a pull from ``offset`` answers (no entries at the end of the queue, or of what
        read_committed may see)."""
        if offset < 0:
            raise invalid(f"offset {offset} is negative")
        if max_messages <= 0:
            raise invalid("max_messages must be positive")
        qf = self.queue_file(topic, queue_id)
        if max_wait_ms > 0 and offset >= self.stable_end(topic, queue_id, qf.next_queue_offset, committed):
            deadline = time.monotonic() + max_wait_ms / 1000.0
            cond = self.watermarks.cond
            with cond:
                cond.wait_for(lambda: self.stable_end(topic, queue_id, qf.next_queue_offset, committed) > offset
                              or self.closing() or self._stop.is_set(), max(0.0, deadline - time.monotonic()))
        low, end = self.queue_bounds(topic, queue_id)
        if offset > end:
            raise BrokerError("OUT_OF_RANGE", f"offset {offset} is beyond the end of {topic}/{queue_id} ({end})")
        if offset < low:
            raise BrokerError("OUT_OF_RANGE", f"offset {offset} of {topic}/{queue_id} was removed by retention; earliest is {low}")
        high = self.stable_end(topic, queue_id, end, committed)
        if offset >= high:
            return _Found([], 0, 0, offset, low, high)
        failpoint("reads_after_bounds")
        # bounded by ``high`` as read above, always: the dispatcher may publish more entries meanwhile
        # (a transaction's batch whose LSO was not in ``high``); an LSO is a batch's first offset
        entries = [e for e in _entries(qf, offset, max_messages, max_bytes) if e.base_queue_offset < high]
        if not entries:
            return _Found([], 0, 0, offset, low, high)
        if committed and not topic.startswith(system_records.SYSTEM_PREFIX):
            return _without_aborted(entries, offset, max_messages, low, high,
                                    self.aborted_within(topic, queue_id, offset, high))
        available = entries[-1].base_queue_offset + entries[-1].record_count - offset
        count = min(max_messages, available)
        return _Found(entries, offset - entries[0].base_queue_offset, count, offset + count, low, high)

    def _read_batches(self, entries: list[Entry]) -> list[bytes]:
        """Read the entries' batches: each run of adjacent batches is one pread and one blob."""
        out: list[bytes] = []
        for start, end in _runs(entries):
            data = self.read_log(start, end - start)
            if len(data) != end - start:
                raise BrokerError("OUT_OF_RANGE", f"log range {start}..{end} is no longer stored locally")
            out.append(data)
        return out

    def readable_min_offset(self) -> int:
        """Lowest commit offset a read can reach: the local log start, or lower through tiered storage."""
        local = self.log.min_offset
        if self.cold_reader is None or local == 0:
            return local
        return min(local, self.cold_reader.min_offset())

    def read_log(self, start: int, length: int) -> bytes:
        """Log bytes [start, start + length); the part below the local log start comes from the cold reader."""
        data = b""
        for _ in range(2):  # retention may delete a segment between the check and the read: look again
            local_min = self.log.min_offset
            if start >= local_min or self.cold_reader is None:
                data = self.log.read(start, length)
            else:
                cold_len = min(length, local_min - start)
                data = self.cold_reader.read(start, cold_len)
                if len(data) == cold_len < length:
                    data += self.log.read(local_min, length - cold_len)
            if len(data) == length or self.cold_reader is None:
                return data
        return data

    def offset_for_time(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        qf = self.queue_file(topic, queue_id)
        i = qf.first_at_time(timestamp_ms)
        if i >= qf.entries:
            return qf.next_queue_offset
        low, _ = self.queue_bounds(topic, queue_id)
        return max(low, qf.entry(i).base_queue_offset)

    def is_scheduled_record(self, offset: int) -> bool:
        """Whether ``offset`` is the start of a scheduled record in ``__timer`` (still stored)."""
        qf = self.views.queues.queue(system_records.TIMER_TOPIC, 0)
        if qf is None or offset < self.log.min_offset:
            return False
        i = qf.first_at_commit(offset + 1) - 1
        if i < 0 or i >= qf.entries:
            return False
        e = qf.entry(i)
        data = memoryview(self.log.read(e.commit_offset, e.batch_bytes))
        header = bf.decode_header(data, 0)
        if timer_records.is_event_batch(data, header):
            return False
        return any(e.commit_offset + pos == offset for pos, _, _, _ in bf.iter_records(data, header))


def _within(offsets: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    """Which ``offsets`` fall in one of ``ranges`` (``[start, end)``, disjoint)."""
    if not ranges:
        return np.zeros(len(offsets), dtype=bool)
    ranges = sorted(ranges)
    starts = np.array([a for a, _ in ranges], dtype=np.int64)
    ends = np.array([b for _, b in ranges], dtype=np.int64)
    offs = offsets.astype(np.int64)
    i = np.searchsorted(starts, offs, side="right") - 1
    return (i >= 0) & (offs < ends[np.maximum(i, 0)])


def _count(f: _Found) -> None:
    """An answered pull in the metrics."""
    if f.count:
        metrics.PULL_MESSAGES.inc(f.count)
        metrics.PULL_BYTES.inc(sum(e.batch_bytes for e in f.entries))


def _without_aborted(entries: list[Entry], offset: int, max_messages: int, low: int, high: int,
                     aborted: list[tuple[int, int]]) -> _Found:
    """A read_committed answer: ``entries`` without the batches of aborted transactions (whole
    batches: a transaction's range holds whole batches); the next offset passes the aborted ones
    at the end too, so that a reader never reads them again."""
    scanned_end = entries[-1].base_queue_offset + entries[-1].record_count
    if aborted:
        kept: list[Entry] = []
        i = 0
        for e in entries:
            while i < len(aborted) and aborted[i][1] <= e.base_queue_offset:
                i += 1
            if i < len(aborted) and aborted[i][0] <= e.base_queue_offset:
                continue
            kept.append(e)
        entries = kept
    if not entries:
        return _Found([], 0, 0, min(scanned_end, high), low, high)
    skip = max(0, offset - entries[0].base_queue_offset)
    count = 0
    next_offset = offset
    for used, e in enumerate(entries, 1):
        first = e.base_queue_offset + (skip if used == 1 else 0)
        take = min(e.base_queue_offset + e.record_count - first, max_messages - count)
        count += take
        next_offset = first + take
        if count >= max_messages:
            return _Found(entries[:used], skip, count, next_offset, low, high)
    return _Found(entries, skip, count, max(next_offset, min(scanned_end, high)), low, high)


def _runs(entries: list[Entry]) -> list[tuple[int, int]]:
    """The log ranges [start, end) of the entries' batches, adjacent batches joined."""
    runs: list[tuple[int, int]] = []
    for e in entries:
        if runs and runs[-1][1] == e.commit_offset:
            runs[-1] = (runs[-1][0], e.commit_offset + e.batch_bytes)
        else:
            runs.append((e.commit_offset, e.commit_offset + e.batch_bytes))
    return runs


def _entries(qf: QueueFile, offset: int, max_messages: int, max_bytes: int) -> list[Entry]:
    """The consume-queue entries a pull from ``offset`` returns: never past a gap in the queue's
    offsets (a queue that moved away and back has its segments in this log with another shard's
    between them, docs/shards.md: a read stops where its segment ends)."""
    index = qf.locate(offset)
    entries: list[Entry] = []
    wanted = offset + max_messages
    byte_total = 0
    per_read = PULL_ENTRIES_FIRST_READ  # most pulls need a batch or two: read more only when they do not
    while index < qf.entries:
        chunk = qf.entries_from(index, per_read)
        per_read = PULL_ENTRIES_PER_READ
        if not chunk:
            break
        for e in chunk:
            if entries and (byte_total + e.batch_bytes > max_bytes
                            or e.base_queue_offset != entries[-1].base_queue_offset + entries[-1].record_count):
                break
            entries.append(e)
            byte_total += e.batch_bytes
            if e.base_queue_offset + e.record_count >= wanted or byte_total >= max_bytes:
                break
        else:
            index += len(chunk)
            continue
        break
    return entries
