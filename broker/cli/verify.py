"""``tidemark log verify DATA_DIR``: offline check of every segment, checkpoint and queue file.

Reads only (every file is opened read-only; it may run beside a live daemon); renames nothing.
Prints one line per problem and a summary; exit 1 when any.
"""

from __future__ import annotations

import os
import sys

from broker.logformat.scan import Stop, scan_past_damage
from broker.storage import atomic_file, dirlock, epochs, identity
from broker.storage.commitlog import CommitLog
from broker.storage.segment import parse_segment_name
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


def _verify_segment(path: str, start: int, problems: list[str]) -> tuple[int, int]:
    """Check every batch of one segment; return (batches, bytes valid from its start)."""
    size = os.path.getsize(path)
    end = start + size
    batches = 0
    with open(path, "rb") as f:

        def read(offset: int, length: int) -> bytes:
            f.seek(offset - start)
            return f.read(length)

        for item in scan_past_damage(read, start, end, chunk_bytes=CHUNK_BYTES, path=path):
            if isinstance(item, Stop) and item.ends_walk:
                problems.append(f"{path}: offset {item.offset}: torn or corrupt batch (length {item.declared_bytes}); "
                                f"{end - item.offset} bytes to the end of the segment")
                return batches, item.offset - start
            if isinstance(item, Stop):
                problems.append(f"{path}: offset {item.offset}: {item.error}")
            batches += 1
    return batches, size


def verify_data_dir(data_dir: str) -> int:
    problems: list[str] = []
    log_dir = os.path.join(data_dir, "log")
    if not os.path.isdir(log_dir):
        print(f"{data_dir}: no commit log directory")
        return 1
    pid = dirlock.holder(data_dir)
    if pid is not None:
        print(f"{data_dir}: in use by pid {pid}: checking a live directory (reads only); its tail may be "
              "moving, so damage reported at the very end can be a write in progress", file=sys.stderr)
    starts = sorted(s for s in (parse_segment_name(n) for n in os.listdir(log_dir)) if s is not None)
    expected = starts[0] if starts else 0
    total_batches = 0
    for start in starts:
        path = os.path.join(log_dir, f"{start:020d}.log")
        if start != expected:
            problems.append(f"{path}: starts at {start} but the previous segment ends at {expected}")
        n, valid = _verify_segment(path, start, problems)
        total_batches += n
        expected = start + valid
    for rel, magic, version in SMALL_FILES:
        for suffix in ("", ".bak"):
            path = os.path.join(data_dir, rel + suffix)
            if not os.path.exists(path):
                continue
            try:
                with open(path, "rb") as f:
                    atomic_file.decode(f.read(), magic, version)
            except atomic_file.InvalidFile as exc:
                problems.append(f"{path}: {exc}")
    cq_dir = os.path.join(data_dir, "cq")
    cq_files = 0
    for root, _, files in os.walk(cq_dir):
        for name in files:
            if name.endswith(".cq"):
                cq_files += 1
                size = os.path.getsize(os.path.join(root, name))
                if size % consume_queue.ENTRY_BYTES:
                    problems.append(f"{os.path.join(root, name)}: size {size} is not a whole number of entries")
    timer_groups = _verify_timer_state(data_dir, problems)
    for p in problems:
        print(p)
    print(f"{data_dir}: {len(starts)} segments, {total_batches} batches, {cq_files} queue files, "
          f"{timer_groups} timer-log groups, {len(problems)} problems")
    return 1 if problems else 0


def _verify_timer_state(data_dir: str, problems: list[str]) -> int:
    """Timer-log groups (MARK positions and CRCs) and every wheel snapshot; returns the groups."""

    log_dir = os.path.join(data_dir, "timer", "log")
    if not os.path.isdir(log_dir):
        return 0
    tlog = CommitLog(log_dir, 1 << 40, read_only=True)
    try:
        scan = timerlog.scan_groups(tlog, tlog.min_offset)
        end = tlog.max_offset
    finally:
        tlog.close()
    if scan.valid_end != end:
        problems.append(f"{log_dir}: timer log valid up to position {scan.valid_end} of {end} "
                        "(a torn or damaged tail; recovery cuts it and replays the commit log)")
    snap_dir = os.path.join(data_dir, "timer", "snapshots")
    for position in snaps.positions(snap_dir):
        path = snaps.path_for(snap_dir, position)
        try:
            with open(path, "rb") as f:
                loaded = atomic_file.decode(f.read(), snaps.MAGIC, snaps.VERSION)
            snaps.Snapshot.decode(loaded.payload)
        except (atomic_file.InvalidFile, ValueError, KeyError) as exc:
            problems.append(f"{path}: {exc}")
        if position > end:
            problems.append(f"{path}: beyond the timer log's end {end}")
    return scan.groups
