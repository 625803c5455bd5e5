"""Consume queues: per topic queue, one fixed-size entry per batch. Spec: docs/formats/consume-queue.md.

Entry (32 bytes, little-endian)::

    u64 base_queue_offset | u64 commit_offset | u32 batch_bytes | u32 record_count | u64 store_time_ms

Entries are ordered by queue offset, commit offset and store time alike (the master assigns store
times monotonically), so one binary search answers "where is queue offset q" and another "which
offset was stored at time t": the entries are also the time index. Files live in
``cq/<topic>.<topic id>/<queue>.cq``; the topic id is the commit offset of the record that created
it, so a deleted and re-created topic never reuses a file. A file (and its topic's directory) is
created with the queue's first entry: creating a topic touches no file here.

Checkpoint (atomic file ``consume_queue.ckpt``, JSON payload): applied offset, topics known to
this view, and each file's length. Recovery truncates files to those lengths and replays.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from broker.errors import not_found
from broker.invariant import CorruptionError, invariant
from broker.logformat import system_records
from broker.logformat.batch import BatchHeader, iter_records
from broker.storage import atomic_file
from broker.storage.failpoints import durable_sync_many, failpoint, note_created, note_truncated
from broker.storage.handles import HANDLES
from broker.storage.regular import open_regular, regular_stat
from broker.views.base import View, copy_prefix

ENTRY = struct.Struct("<QQIIQ")
ENTRY_BYTES = ENTRY.size
CHECKPOINT_MAGIC = b"TMCQ"
CHECKPOINT_VERSION = 1
SEARCH_WINDOW_ENTRIES = 256  # a binary search reads the last this many entries at once (8 KiB)


_U64_AT = {0: 0, 1: 1, 4: 3}  # entry fields that are u64s: their place among an entry's four 8-byte words


def _field_of(entries: bytes, field: int) -> Sequence[int]:
    """One field of every entry in ``entries``, as a sequence to bisect (no tuple per entry)."""
    if sys.byteorder == "little" and field in _U64_AT:
        return memoryview(entries).cast("Q")[_U64_AT[field] :: ENTRY_BYTES // 8]
    return [t[field] for t in ENTRY.iter_unpack(entries)]


@dataclass(frozen=True, slots=True)
class Entry:
    base_queue_offset: int
    commit_offset: int
    batch_bytes: int
    record_count: int
    store_time_ms: int


_FILE_FLAGS = os.O_RDWR | os.O_APPEND


class QueueFile:
    """One queue's entry file. Written by the dispatcher thread, read by any thread. Its descriptor
    comes from the bounded set of open files (``storage.handles``), opened again when evicted.

    The file is created with its first entry (``publish``): a queue without entries has no file,
    so creating a topic touches no file system (docs/formats/consume-queue.md, "Files")."""

    __slots__ = ("_pending", "_pending_count", "_pending_entries", "dirty", "entries", "exists", "key",
                 "next_queue_offset", "path", "rel")

    def __init__(self, path: str, *, exists: bool, key: tuple[str, int] = ("", 0), rel: str = "",
                 known: tuple[int, int] | None = None, size: int | None = None) -> None:
        """``exists``: whether the file is on disk (else it is created at the first ``publish``).
        ``size``: its size in bytes when the caller knows it (else a stat, or ``known``).
        ``rel``: its name in the checkpoint (``<topic dir>/<queue>.cq``).
        ``known``: (size in bytes, next queue offset) from a checkpoint, so that opening a queue at
        start costs no descriptor (100,000 queues start in a second, not in 100,000 opens)."""
        self.path = path
        self.key = key  # (topic, queue)
        self.rel = rel
        self.exists = exists  # set once, by the dispatcher, before the first entry is published
        if exists:
            HANDLES.register(path, _FILE_FLAGS)
        if size is None:
            size = known[0] if known is not None else regular_stat(path).st_size if exists else 0
        invariant(size % ENTRY_BYTES == 0, f"{path}: size {size} is not a multiple of {ENTRY_BYTES}")
        self.entries = size // ENTRY_BYTES  # published: visible to readers
        self._pending = bytearray()
        self._pending_entries = 0
        self._pending_count = 0
        self.next_queue_offset = 0
        self.dirty = False
        if known is not None:
            self.next_queue_offset = known[1]
        elif self.entries:
            last = self.entry(self.entries - 1)
            self.next_queue_offset = last.base_queue_offset + last.record_count

    @classmethod
    def checkpointed(cls, path: str, key: tuple[str, int], rel: str, size: int, next_queue_offset: int) -> QueueFile:
        """An existing file as a checkpoint knows it (``__init__`` with ``known``, minus its checks
        and its registration: 100,000 of them at start-up, registered in one call)."""
        qf = cls.__new__(cls)
        qf.path, qf.key, qf.rel, qf.exists = path, key, rel, True
        qf.entries = size // ENTRY_BYTES
        qf._pending, qf._pending_entries, qf._pending_count = bytearray(), 0, 0
        qf.next_queue_offset, qf.dirty = next_queue_offset, False
        return qf

    def _pread(self, length: int, position: int) -> bytes:
        try:
            with HANDLES.use(self.path) as fd:
                return os.pread(fd, length, position)
        except FileNotFoundError:  # its topic was deleted under a reader
            raise not_found(f"queue file {os.path.basename(self.path)} is gone (its topic was deleted)") from None

    def add(self, header: BatchHeader) -> None:
        invariant(
            header.base_queue_offset == self.next_queue_offset + self._pending_count,
            f"{self.path}: batch at {header.base_offset} has queue offset {header.base_queue_offset}, "
            f"expected {self.next_queue_offset + self._pending_count}",
        )
        self._pending += ENTRY.pack(
            header.base_queue_offset, header.base_offset, header.batch_bytes, header.record_count, header.store_time_ms
        )
        self._pending_entries += 1
        self._pending_count += header.record_count

    def publish(self) -> None:
        if not self._pending:
            return
        if not self.exists:
            self._create()
        with HANDLES.use(self.path) as fd:
            written = os.write(fd, self._pending)
            if written != len(self._pending):  # never leave a partial entry; the pending ones stay queued
                os.ftruncate(fd, self.entries * ENTRY_BYTES)
                raise OSError(28, f"short write to {self.path}: {written} of {len(self._pending)} bytes")
        self.entries += self._pending_entries
        self.next_queue_offset += self._pending_count
        self._pending = bytearray()
        self._pending_entries = 0
        self._pending_count = 0
        self.dirty = True

    def _create(self) -> None:
        """Create the file (its directory exists); made durable with the next checkpoint."""
        fd = open_regular(self.path, _FILE_FLAGS | os.O_CREAT)
        note_created(self.path)
        HANDLES.register(self.path, _FILE_FLAGS, fd)
        self.exists = True

    def entry(self, index: int) -> Entry:
        at = index * ENTRY_BYTES
        return Entry(*ENTRY.unpack(self._whole(self._pread(ENTRY_BYTES, at), ENTRY_BYTES, at)))

    def entries_from(self, index: int, count: int) -> list[Entry]:
        data = self._pread(count * ENTRY_BYTES, index * ENTRY_BYTES)
        return [Entry(*t) for t in ENTRY.iter_unpack(data[: len(data) - len(data) % ENTRY_BYTES])]

    def batch_bytes(self, index: int) -> int:
        """Bytes of the batches of entries ``index`` .. the end (their ``batch_bytes`` summed)."""
        total = 0
        step = 1 << 15
        end = self.entries
        while index < end:
            data = self._pread(min(step, end - index) * ENTRY_BYTES, index * ENTRY_BYTES)
            total += sum(t[2] for t in ENTRY.iter_unpack(data[: len(data) - len(data) % ENTRY_BYTES]))
            index += step
        return total

    def _search(self, field: int, value: int, count: int) -> int:
        """Index of the first published entry whose ``field`` exceeds ``value`` (bisect_right): one
        entry a probe until ``SEARCH_WINDOW_ENTRIES`` are left, then those in one read (a queue of a
        few hundred batches, every pull's and every pop's lookup: one read, not nine)."""
        lo, hi = 0, count
        if not count:  # nothing published: a queue's file is made with its first entry (it may not exist)
            return 0
        try:
            with HANDLES.use(self.path) as fd:  # one descriptor look-up for every probe
                while hi - lo > SEARCH_WINDOW_ENTRIES:
                    mid = (lo + hi) // 2
                    at = mid * ENTRY_BYTES
                    if ENTRY.unpack(self._whole(os.pread(fd, ENTRY_BYTES, at), ENTRY_BYTES, at))[field] <= value:
                        lo = mid + 1
                    else:
                        hi = mid
                size, at = (hi - lo) * ENTRY_BYTES, lo * ENTRY_BYTES
                window = self._whole(os.pread(fd, size, at), size, at)
        except FileNotFoundError:  # its topic was deleted under a reader
            raise not_found(f"queue file {os.path.basename(self.path)} is gone (its topic was deleted)") from None
        return lo + bisect.bisect_right(_field_of(window, field), value)

    def _whole(self, data: bytes, length: int, position: int) -> bytes:
        """``data``, read as ``length`` bytes of published entries at ``position``: fewer is a
        truncated file."""
        if len(data) != length:
            raise CorruptionError("consume queue entry truncated", path=self.path, offset=position)
        return data

    def locate(self, queue_offset: int) -> int:
        """Index of the entry holding ``queue_offset`` (or ``entries`` when past the end)."""
        count = self.entries
        if count and queue_offset >= self.entry(count - 1).base_queue_offset:
            return count - 1 if queue_offset < self.next_queue_offset else count
        return max(0, self._search(0, queue_offset, count) - 1)

    def first_at_time(self, timestamp_ms: int) -> int:
        """Index of the first entry stored at or after ``timestamp_ms``."""
        return self._search(4, timestamp_ms - 1, self.entries)

    def first_at_commit(self, commit_offset: int) -> int:
        """Index of the first entry whose batch starts at or after ``commit_offset``."""
        return self._search(1, commit_offset - 1, self.entries)

    def close(self) -> None:
        HANDLES.forget(self.path)


@dataclass
class TopicInfo:
    topic_id: int
    queues: int


class CheckpointJson:
    """The checkpoint's JSON, encoded once per topic and per queue state and joined each time.

    A node with 100,000 queues checkpoints every second while anything moves; ``json.dumps`` of
    every topic and queue took ~200 ms of the GIL each time. Each fragment is remembered with the
    values it encodes and reused while they are unchanged (memoization by value: a truncated or
    re-created queue simply encodes again), so a checkpoint costs a join plus what changed. The
    text is the same JSON object as before (docs/formats/consume-queue.md); key order differs."""

    def __init__(self) -> None:
        self._topics: dict[str, tuple[TopicInfo, str]] = {}
        self._files: dict[str, tuple[int, int, str, str]] = {}  # rel -> (bytes, next, files part, next part)

    def state(self, applied_offset: int, topics: list[tuple[str, TopicInfo]], files: list[QueueFile],
              last_store_time_ms: int, sealed: list[tuple[tuple[str, int], int]]) -> bytes:
        topic_parts: list[str] = []
        seen_topics: dict[str, tuple[TopicInfo, str]] = {}
        for name, info in topics:
            cached = self._topics.get(name)
            if cached is None or cached[0] != info:
                cached = (info, f'{json.dumps(name)}: {{"id": {info.topic_id}, "queues": {info.queues}}}')
            seen_topics[name] = cached
            topic_parts.append(cached[1])
        file_parts: list[str] = []
        next_parts: list[str] = []
        seen_files: dict[str, tuple[int, int, str, str]] = {}
        for qf in files:
            size, nxt = qf.entries * ENTRY_BYTES, qf.next_queue_offset
            entry = self._files.get(qf.rel)
            if entry is None or entry[0] != size or entry[1] != nxt:
                rel = json.dumps(qf.rel)
                entry = (size, nxt, f"{rel}: {size}", f"{rel}: {nxt}")
            seen_files[qf.rel] = entry
            file_parts.append(entry[2])
            next_parts.append(entry[3])
        self._topics, self._files = seen_topics, seen_files  # forget deleted topics and queues
        return (f'{{"applied_offset": {int(applied_offset)}, "topics": {{{", ".join(topic_parts)}}}, '
                f'"files": {{{", ".join(file_parts)}}}, "next": {{{", ".join(next_parts)}}}, '
                f'"last_store_time_ms": {int(last_store_time_ms)}, '
                f'"sealed": {json.dumps([[t, q, end] for (t, q), end in sealed])}}}').encode()


def _system_topics() -> dict[str, TopicInfo]:
    return {name: TopicInfo(0, 1) for name in system_records.SYSTEM_TOPICS}


class ConsumeQueueView(View):
    """All queues' entry files plus the topics this view has seen created."""

    name = "consume_queue"

    def __init__(self, directory: str, checkpoint_path: str) -> None:
        self.directory = directory
        self.checkpoint_path = checkpoint_path
        os.makedirs(directory, exist_ok=True)
        self.applied_offset = 0
        self.topics: dict[str, TopicInfo] = _system_topics()
        self._files: dict[tuple[str, int], QueueFile] = {}
        self._round: set[QueueFile] = set()
        self._grown: set[tuple[str, int]] = set()
        self._unsynced_dirs: set[str] = set()
        self.last_store_time_ms = 0  # of the newest batch applied (store times never go back)
        self._doomed: list[str] = []  # dirs of deleted topics, removed once a checkpoint forgets them
        self._lock = threading.Lock()  # guards topics/_files against concurrent readers
        self._json = CheckpointJson()
        self.sealed: dict[tuple[str, int], int] = {}  # queues a move sealed in this log -> their end

    # -- recovery ------------------------------------------------------------------------------
    def load(self) -> bool:
        """Load the newest valid checkpoint; False when none exists (fresh view at offset 0)."""
        loaded = atomic_file.load(self.checkpoint_path, CHECKPOINT_MAGIC, CHECKPOINT_VERSION)
        if loaded is None:
            return False  # recovery resets the view (or refuses to start)
        state = json.loads(loaded.payload)
        self.applied_offset = int(state["applied_offset"])
        self.topics = {name: TopicInfo(int(t["id"]), int(t["queues"])) for name, t in state["topics"].items()}
        for name, info in _system_topics().items():  # a system topic newer than the checkpoint's format
            self.topics.setdefault(name, info)
        lengths: dict[str, int] = state["files"]
        nexts: dict[str, int] = state.get("next", {})  # absent in checkpoints written before it existed
        self.last_store_time_ms = int(state.get("last_store_time_ms", 0))
        self.sealed = {(str(t), int(q)): int(end) for t, q, end in state.get("sealed", [])}
        directory = self.directory
        dirs = {name: f"{name}.{info.topic_id}" for name, info in self.topics.items()}
        expected = set(dirs.values())
        present = set(os.listdir(directory))
        for entry in present - expected:  # topic dirs the checkpoint does not know: newer than it
            shutil.rmtree(os.path.join(directory, entry))
        # 100,000 queues: one stat each and no other system call, no descriptor (files are opened
        # at their first read or write), so that start-up stays well under 2 s; an lstat, so that a
        # FIFO or a symlink in a queue file's place is refused before it is truncated or opened
        files: dict[tuple[str, int], QueueFile] = {}
        registered: list[str] = []  # registered with the open-file set in one call, after the loop
        for name, info in self.topics.items():
            tdir = dirs[name]
            if tdir not in present:  # no entries yet: no directory, no file (lazy)
                self._add_lazy_files(name, lengths, nexts, files)
                continue
            for q in range(info.queues):
                rel = f"{tdir}/{q}.cq"
                path = f"{directory}/{rel}"
                want = lengths.get(rel, 0)
                try:
                    size: int | None = regular_stat(path).st_size
                except FileNotFoundError:
                    size = None
                if size is None:
                    if want:
                        raise CorruptionError(f"consume queue missing ({want} bytes checkpointed)", path=path)
                    files[(name, q)] = QueueFile(path, exists=False, key=(name, q), rel=rel)
                    files[(name, q)].next_queue_offset = nexts.get(rel, 0)  # a queue started by a move
                    continue
                if size < want:
                    raise CorruptionError(f"consume queue shorter than its checkpoint ({want} bytes)", path=path)
                cut = size > want
                if cut:  # entries the checkpoint does not cover: replay writes them again
                    # durable with the next checkpoint (the file is dirty): a power cut before it
                    # brings the old tail back, which the next start cuts again
                    os.truncate(path, want)
                    note_truncated(want, path)
                invariant(want % ENTRY_BYTES == 0, f"{path}: checkpointed size {want} is not a multiple of {ENTRY_BYTES}")
                nxt = nexts.get(rel)
                if nxt is not None:
                    registered.append(path)
                    qf = QueueFile.checkpointed(path, (name, q), rel, want, nxt)
                else:  # a checkpoint without next offsets: the constructor reads the last entry
                    qf = QueueFile(path, exists=True, key=(name, q), rel=rel, size=want)
                qf.dirty = cut
                files[(name, q)] = qf
        HANDLES.register_many(registered, _FILE_FLAGS)
        with self._lock:
            self._files = files
        return True

    def _add_lazy_files(self, name: str, lengths: dict[str, int], nexts: dict[str, int],
                        files: dict[tuple[str, int], QueueFile]) -> None:
        """A checkpointed topic without a directory: every queue must be empty (created lazily); a
        queue that a move started here keeps its next offset."""
        tdir = f"{name}.{self.topics[name].topic_id}"
        for q in range(self.topics[name].queues):
            rel = f"{tdir}/{q}.cq"
            if lengths.get(rel, 0):
                raise CorruptionError(f"consume queue missing ({lengths[rel]} bytes checkpointed)",
                                      path=os.path.join(self.directory, rel))
            files[(name, q)] = QueueFile(f"{self.directory}/{rel}", exists=False, key=(name, q), rel=rel)
            files[(name, q)].next_queue_offset = nexts.get(rel, 0)

    def reset(self) -> None:
        for qf in self._files.values():
            qf.close()
        self._files.clear()
        shutil.rmtree(self.directory, ignore_errors=True)
        os.makedirs(self.directory, exist_ok=True)
        self.applied_offset = 0
        self.topics = _system_topics()
        for name in self.topics:
            self._create_files(name)
        self.last_store_time_ms = 0
        self.sealed = {}

    def _topic_dir(self, name: str) -> str:
        return f"{name}.{self.topics[name].topic_id}"  # topic names are file-name safe

    def _create_files(self, name: str) -> None:
        """The queues of a new topic: in memory only; each file (and the topic's directory) is
        created with the queue's first entry (``_publish_round``)."""
        for q in range(self.topics[name].queues):
            self._add_file(name, q, exists=False)

    def _add_file(self, name: str, q: int, *, exists: bool, known: tuple[int, int] | None = None) -> None:
        rel = f"{self._topic_dir(name)}/{q}.cq"
        self._files[(name, q)] = QueueFile(os.path.join(self.directory, rel), exists=exists, key=(name, q), rel=rel,
                                           known=known)

    # -- apply --------------------------------------------------------------------------------
    def apply(self, header: BatchHeader, batch: memoryview) -> None:
        self.last_store_time_ms = max(self.last_store_time_ms, header.store_time_ms)
        qf = self._files.get((header.topic, header.queue_id))
        if qf is not None:
            qf.add(header)
            self._round.add(qf)
        if header.topic == system_records.METADATA_TOPIC:
            for _, key, _, body in iter_records(batch, header):
                if bytes(key) not in system_records.TOPIC_CHANGE_KEYS:
                    continue  # offsets.commit bodies can be large: not decoded here
                change, fields = system_records.decode(key, body)
                if change == system_records.TOPIC_CREATE and fields["topic"] not in self.topics:
                    self._publish_round()
                    with self._lock:
                        self.topics[fields["topic"]] = TopicInfo(header.base_offset, int(fields["queues"]))
                        self._create_files(fields["topic"])
                elif change == system_records.TOPIC_DELETE and fields["topic"] in self.topics:
                    self._publish_round()
                    self._drop_topic(fields["topic"])
                elif change in (system_records.QUEUE_SEAL, system_records.QUEUE_START):
                    self._apply_move(change, fields)

    def _apply_move(self, change: str, fields: dict[str, object]) -> None:
        """A seal marks the queue's end in this log; a start lifts it and moves the queue's next
        offset to where its new segment begins (entries after it start there)."""
        key = (str(fields["topic"]), int(str(fields["queue"])))
        qf = self._files.get(key)
        if qf is None:
            return
        if change == system_records.QUEUE_SEAL:
            self.sealed[key] = int(str(fields["end"]))
            return
        self._publish_round()  # entries pending for the queue land before its offsets jump
        self.sealed.pop(key, None)
        start = int(str(fields["start"]))
        qf.next_queue_offset = max(qf.next_queue_offset, start)

    def _drop_topic(self, name: str) -> None:
        with self._lock:
            info = self.topics.pop(name)
            for q in range(info.queues):
                self.sealed.pop((name, q), None)
                qf = self._files.pop((name, q), None)
                if qf is not None:
                    self._round.discard(qf)
                    qf.close()  # a pull that holds it still reads it; it closes after that pull
        self._doomed.append(os.path.join(self.directory, f"{name}.{info.topic_id}"))

    def _publish_round(self) -> None:
        for qf in self._round:
            if not qf.exists:
                self._make_dir_for(qf)
            qf.publish()
            self._grown.add(qf.key)
        self._round.clear()

    def _make_dir_for(self, qf: QueueFile) -> None:
        """Before a queue's first file is created: its topic directory. Both entries (the file's in
        the topic directory, the directory's in ``cq/``) are made durable at the next checkpoint,
        all at once: recovery removes topic directories a checkpoint does not know and truncates
        files to their checkpointed lengths, so nothing relies on them before that."""
        tdir = os.path.dirname(qf.path)
        try:
            os.mkdir(tdir)
            self._unsynced_dirs.add(self.directory)
        except FileExistsError:
            pass
        self._unsynced_dirs.add(tdir)

    def take_grown(self) -> set[tuple[str, int]]:
        """The queues that received entries since the last call (long-polls wait for these)."""
        grown, self._grown = self._grown, set()
        return grown

    def end_round(self, offset: int) -> None:
        self._publish_round()
        self.applied_offset = offset

    def checkpoint(self) -> None:
        with self._lock:
            # queues without entries are left out (an absent file counts as 0 bytes, and may not exist),
            # but for one a move started at an offset above 0
            files = [qf for qf in self._files.values() if qf.entries or qf.next_queue_offset]
            topics = list(self.topics.items())  # TopicInfo is replaced, never changed in place
            sealed = sorted(self.sealed.items())
        dirty = [qf for qf in files if qf.dirty]
        dirs = sorted(self._unsynced_dirs)
        durable_sync_many([qf.path for qf in dirty], dirs, self.directory)
        self._unsynced_dirs.difference_update(dirs)  # only once durable: a failed sync is retried whole
        for qf in dirty:
            qf.dirty = False
        failpoint("cq_before_checkpoint")
        payload = self._json.state(self.applied_offset, topics, files, self.last_store_time_ms, sealed)
        atomic_file.persist(self.checkpoint_path, CHECKPOINT_MAGIC, CHECKPOINT_VERSION, payload)
        failpoint("cq_after_checkpoint")
        doomed, self._doomed = self._doomed, []
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    def stage(self, data_dir: str, staging: str) -> None:
        """The checkpoint and every queue file up to its checkpointed length."""
        copy_prefix(self.checkpoint_path, data_dir, staging)
        with self._lock:
            files = list(self._files.values())
        for qf in files:
            if qf.exists:  # a queue without entries may have no file
                copy_prefix(qf.path, data_dir, staging, qf.entries * ENTRY_BYTES)

    # -- reads --------------------------------------------------------------------------------
    def tail_state(self) -> tuple[dict[tuple[str, int], int], set[str], int, dict[tuple[str, int], int]]:
        """(next queue offset of every queue, topic names, newest store time, sealed queues and their
        ends) as applied: what the
        append side starts from (``TailState.rebuild``). Consistent only while nothing applies
        (the caller holds the dispatcher's lock, or runs before it starts)."""
        with self._lock:
            files = dict(self._files)
            topics = set(self.topics)
        newest = self.last_store_time_ms
        if not newest:  # a checkpoint from before it was kept: the newest entry of any queue
            for qf in files.values():
                if qf.entries:
                    newest = max(newest, qf.entry(qf.entries - 1).store_time_ms)
        return {key: qf.next_queue_offset for key, qf in files.items()}, topics, newest, dict(self.sealed)

    def queue(self, topic: str, queue_id: int) -> QueueFile | None:
        with self._lock:
            return self._files.get((topic, queue_id))

    def close(self) -> None:
        with self._lock:
            for qf in self._files.values():
                qf.close()
            self._files.clear()
