"""The aborted-transaction index (DESIGN §14): which queue offsets belong to aborted transactions.

A ``read_committed`` reader skips them (offsets with gaps, as Kafka's). In memory: per queue, the
sorted, disjoint ranges ``[start, end)`` of queue offsets of aborted batches (a transaction's
adjacent batches on a queue are one range). On disk: ``txn/aborted.idx``, an append-only file of
entries written by the transactions view's checkpoint; the checkpoint says how many bytes of it
are valid, so a crash between the two only leaves bytes that are cut and replayed again (AKIP-2:
the index is appended to, never rebuilt, and recovery replays only past its checkpoint).

Entry (little-endian)::

    u64 producer id | u64 first queue offset | u64 end queue offset (exclusive) | u32 queue id |
    u16 topic length | topic (UTF-8)

An entry with queue id ``0xFFFFFFFF`` is a topic's deletion: the ranges of that topic before it
are dropped (a topic created again restarts its queue offsets at 0). Spec: docs/formats/txn-records.md.
"""

from __future__ import annotations

import bisect
import os
import struct
from collections.abc import Iterable, Iterator

from broker.storage.failpoints import durable_sync, fsync_dir, note_created, note_truncated
from broker.storage.regular import open_regular, read_regular, regular_stat

ENTRY_HEAD = struct.Struct("<QQQIH")
TOPIC_DELETED = 0xFFFFFFFF
QueueKey = tuple[str, int]
Range = tuple[int, int]


def encode_entry(pid: int, topic: str, queue_id: int, start: int, end: int) -> bytes:
    raw = topic.encode()
    return ENTRY_HEAD.pack(pid, start, end, queue_id, len(raw)) + raw


def decode_entries(data: bytes, path: str) -> Iterator[tuple[int, str, int, int, int]]:
    """(pid, topic, queue id, start, end) of each entry of ``data`` (whole entries only)."""
    pos = 0
    while pos < len(data):
        if pos + ENTRY_HEAD.size > len(data):
            raise ValueError(f"{path}: an entry is cut at byte {pos}")
        pid, start, end, queue_id, n = ENTRY_HEAD.unpack_from(data, pos)
        pos += ENTRY_HEAD.size
        if pos + n > len(data):
            raise ValueError(f"{path}: an entry's topic is cut at byte {pos}")
        yield pid, data[pos : pos + n].decode(), queue_id, start, end
        pos += n


class AbortedRanges:
    """Per queue, the disjoint sorted ranges of aborted queue offsets. Not locked: its owner's lock."""

    def __init__(self) -> None:
        self._starts: dict[QueueKey, list[int]] = {}
        self._ends: dict[QueueKey, list[int]] = {}
        self.total = 0

    def add(self, key: QueueKey, start: int, end: int) -> None:
        starts = self._starts.setdefault(key, [])
        ends = self._ends.setdefault(key, [])
        i = bisect.bisect_left(starts, start)
        if i < len(starts) and starts[i] == start:
            return  # the same range again (replayed past a checkpoint)
        starts.insert(i, start)
        ends.insert(i, end)
        self.total += 1

    def drop_topic(self, topic: str) -> None:
        for key in [k for k in self._starts if k[0] == topic]:
            self.total -= len(self._starts.pop(key))
            del self._ends[key]

    def within(self, key: QueueKey, low: int, high: int) -> list[Range]:
        """The ranges that overlap queue offsets ``[low, high)``, in order."""
        starts = self._starts.get(key)
        if not starts:
            return []
        ends = self._ends[key]
        i = max(0, bisect.bisect_right(starts, low) - 1)
        out: list[Range] = []
        while i < len(starts) and starts[i] < high:
            if ends[i] > low:
                out.append((starts[i], ends[i]))
            i += 1
        return out

    def queues(self) -> int:
        return len(self._starts)

    def has(self, key: QueueKey) -> bool:
        return bool(self._starts.get(key))


class AbortedIndexFile:
    """``aborted.idx``: appended by checkpoints, cut back to the checkpoint's length at load."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, "aborted.idx")
        self.valid_bytes = 0

    def load(self, valid_bytes: int, into: AbortedRanges) -> None:
        """Cut the file to ``valid_bytes`` (what a crash left past the checkpoint is replayed
        again) and read its entries into ``into``."""
        self.truncate(valid_bytes)
        data = read_regular(self.path)[:valid_bytes] if valid_bytes else b""
        if len(data) != valid_bytes:
            raise ValueError(f"{self.path}: {len(data)} bytes, the checkpoint counts {valid_bytes}")
        apply_entries(decode_entries(data, self.path), into)

    def truncate(self, valid_bytes: int) -> None:
        os.makedirs(self.directory, exist_ok=True)
        exists = os.path.lexists(self.path)
        if exists and regular_stat(self.path).st_size < valid_bytes:
            raise ValueError(f"{self.path} is shorter than the checkpoint's {valid_bytes} bytes")
        if not exists:
            note_created(self.path)
        fd = open_regular(self.path, os.O_RDWR | os.O_CREAT)
        try:
            os.ftruncate(fd, valid_bytes)
            note_truncated(valid_bytes, self.path)
            durable_sync(fd, self.path)
        finally:
            os.close(fd)
        if not exists:
            fsync_dir(self.directory)
        self.valid_bytes = valid_bytes

    def append(self, entries: list[bytes]) -> None:
        """Append and make durable; on failure the file is cut back to what was valid."""
        if not entries:
            return
        data = b"".join(entries)
        try:
            fd = open_regular(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, data)
                durable_sync(fd, self.path)
            finally:
                os.close(fd)
        except OSError:
            self.truncate(self.valid_bytes)
            raise
        self.valid_bytes += len(data)


def apply_entries(entries: Iterable[tuple[int, str, int, int, int]], into: AbortedRanges) -> None:
    for _, topic, queue_id, start, end in entries:
        if queue_id == TOPIC_DELETED:
            into.drop_topic(topic)
        else:
            into.add((topic, queue_id), start, end)
