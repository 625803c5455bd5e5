"""``tidemark log verify DATA_DIR``: offline check of every segment, checkpoint and queue file.

Reads only (every file is opened read-only; it may run beside a live daemon); renames nothing.
Opens data-directory files only as regular files (``broker/storage/regular.py``: a FIFO or a
symlink is a problem, never waited on or followed), and walks damage in one pass. Prints one line
per problem as it is found (a run of adjacent damaged batches is one) and a summary; exit 1 when any.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from broker.logformat.batch import BatchHeader
from broker.logformat.scan import Damage, Stop, scan_past_damage
from broker.storage import atomic_file, dirlock, epochs, identity
from broker.storage.commitlog import CommitLog
from broker.storage.regular import open_regular, regular_stat
from broker.storage.segment import parse_segment_name, segment_name
from broker.store import recovery
from broker.timers import snapshot as snaps
from broker.timers import timerlog
from broker.views import consume_queue, producer_state

SMALL_FILES = (
    ("identity", identity.MAGIC, identity.VERSION),
    (epochs.FILE_NAME, epochs.MAGIC, epochs.VERSION),
    ("checkpoints/consume_queue.ckpt", consume_queue.CHECKPOINT_MAGIC, consume_queue.CHECKPOINT_VERSION),
    ("checkpoints/producer_state.ckpt", producer_state.CHECKPOINT_MAGIC, producer_state.CHECKPOINT_VERSION),
    (recovery.CLEAN_MARKER, recovery.CLEAN_MAGIC, recovery.CLEAN_VERSION),
)
CHUNK_BYTES = 8 << 20
Walk = Iterator[tuple[BatchHeader, memoryview] | Damage | Stop]
STRAY = "not a segment name (20 ASCII digits and .log); not read"


class Problems:
    """Each problem printed as it is found, and counted (a segment full of damage is never held in memory)."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, line: str) -> None:
        print(line)
        self.count += 1


@contextmanager
def walk_file(path: str, start: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, Walk]]:
    """``(end offset, scan_past_damage's walk)`` of a file of log bytes whose first byte is at offset
    ``start`` (a segment, a quarantined range), opened as a regular file (``NotRegularFile``
    otherwise), read with ``pread``; closed when the block ends."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        end = start + os.fstat(fd).st_size
        yield end, scan_past_damage(lambda offset, length: os.pread(fd, length, offset - start), start, end,
                                    chunk_bytes=chunk_bytes, path=path)
    finally:
        os.close(fd)


def _verify_segment(path: str, start: int, problems: Problems) -> tuple[int, int]:
    """Check every batch of one segment; return (valid batches, bytes valid from its start). Raises
    ``OSError`` (``NotRegularFile``: a FIFO, a symlink) when the file cannot be read."""
    batches = 0
    with walk_file(path, start) as (end, walk):
        for item in walk:
            if isinstance(item, Stop):
                problems.add(f"{path}: offset {item.offset}: torn or corrupt batch (length {item.declared_bytes}); "
                             f"{end - item.offset} bytes to the end of the segment")
                return batches, item.offset - start
            if isinstance(item, Damage):
                problems.add(f"{path}: offset {item.first.offset}: {item.first.error}{item.more}")
                continue
            batches += 1
    return batches, end - start


def _unreadable(path: str, exc: OSError) -> str:
    return f"{path}: {exc.strerror or exc}"


def verify_data_dir(data_dir: str) -> int:
    problems = Problems()
    log_dir = os.path.join(data_dir, "log")
    if not os.path.isdir(log_dir):
        print(f"{data_dir}: no commit log directory")
        return 1
    pid = dirlock.holder(data_dir)
    if pid is not None:
        print(f"{data_dir}: in use by pid {pid}: checking a live directory (reads only); its tail may be "
              "moving, so damage reported at the very end can be a write in progress", file=sys.stderr)
    names = sorted(os.listdir(log_dir))
    for name in names:
        if parse_segment_name(name) is None:
            problems.add(f"{os.path.join(log_dir, name)}: {STRAY}")
    starts = sorted(s for s in (parse_segment_name(n) for n in names) if s is not None)
    expected: int | None = starts[0] if starts else 0
    total_batches = 0
    for start in starts:
        path = os.path.join(log_dir, segment_name(start))
        if expected is not None and start != expected:
            problems.add(f"{path}: starts at {start} but the previous segment ends at {expected}")
        try:
            n, valid = _verify_segment(path, start, problems)
        except OSError as exc:
            problems.add(_unreadable(path, exc))
            expected = None  # its end is unknown: the next segment's start is not checked against it
            continue
        total_batches += n
        expected = start + valid
    for rel, magic, version in SMALL_FILES:
        for suffix in ("", ".bak"):
            path = os.path.join(data_dir, rel + suffix)
            if not os.path.lexists(path):
                continue
            try:
                atomic_file.read_copy(path, magic, version)
            except atomic_file.InvalidFile as exc:
                problems.add(f"{path}: {exc}")
            except OSError as exc:
                problems.add(_unreadable(path, exc))
    cq_dir = os.path.join(data_dir, "cq")
    cq_files = 0
    for root, _, files in os.walk(cq_dir):
        for name in files:
            if name.endswith(".cq"):
                cq_files += 1
                path = os.path.join(root, name)
                try:
                    size = regular_stat(path).st_size
                except OSError as exc:
                    problems.add(_unreadable(path, exc))
                    continue
                if size % consume_queue.ENTRY_BYTES:
                    problems.add(f"{path}: size {size} is not a whole number of entries")
    timer_groups = _verify_timer_state(data_dir, problems)
    print(f"{data_dir}: {len(starts)} segments, {total_batches} batches, {cq_files} queue files, "
          f"{timer_groups} timer-log groups, {problems.count} problems")
    return 1 if problems.count else 0


def _verify_timer_state(data_dir: str, problems: Problems) -> int:
    """Timer-log groups (MARK positions and CRCs) and every wheel snapshot; returns the groups."""

    log_dir = os.path.join(data_dir, "timer", "log")
    if not os.path.isdir(log_dir):
        return 0
    try:
        tlog = CommitLog(log_dir, 1 << 40, read_only=True)
    except OSError as exc:  # a segment that is not a regular file, or cannot be read
        problems.add(_unreadable(exc.filename or log_dir, exc))
        return 0
    try:
        for name in tlog.stray_names:
            problems.add(f"{os.path.join(log_dir, name)}: {STRAY}")
        scan = timerlog.scan_groups(tlog, tlog.min_offset)
        end = tlog.max_offset
    finally:
        tlog.close()
    if scan.valid_end != end:
        problems.add(f"{log_dir}: timer log valid up to position {scan.valid_end} of {end} "
                     "(a torn or damaged tail; recovery cuts it and replays the commit log)")
    snap_dir = os.path.join(data_dir, "timer", "snapshots")
    for position in snaps.positions(snap_dir):
        path = snaps.path_for(snap_dir, position)
        try:
            loaded = atomic_file.read_copy(path, snaps.MAGIC, snaps.VERSION)
            if loaded is not None:
                snaps.Snapshot.decode(loaded.payload)
        except (atomic_file.InvalidFile, ValueError, KeyError) as exc:
            problems.add(f"{path}: {exc}")
        except OSError as exc:
            problems.add(_unreadable(path, exc))
        if position > end:
            problems.add(f"{path}: beyond the timer log's end {end}")
    return scan.groups
