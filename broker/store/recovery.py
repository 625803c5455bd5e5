"""Start-up recovery, as numbered passes. The same path serves a clean start, a crash and
(later) a slave bootstrap: load each view's newest valid checkpoint, then replay the log from
there up to the confirm offset.

1. Identity: load ``identity`` or create it in a new directory; refuse a non-new directory
   without a valid one.
2. Segment chain: every segment must start where the previous one ends.
3. View checkpoints: load each view's newest valid checkpoint. A view without one is rebuilt
   from offset 0 when the log still starts at 0; otherwise start-up is refused.
4. Log tail: after a clean shutdown (a valid ``clean_shutdown`` marker matching the log end) no
   scan is needed. Otherwise every batch from the lowest view checkpoint to the end is verified;
   a torn tail is saved to ``quarantine/`` and truncated; any other damage refuses start-up,
   naming segment and offset. Checkpoints above the log end (lost unsynced log bytes) refuse too.
5. Durability point: fsync the log; flushed = log end. A master confirms from its confirm
   source (alone: everything flushed); a slave keeps what its views already applied, since only
   its master knows what else is confirmed (an old master rejoining as a slave must not apply
   its unreplicated tail).
6. Replay: apply each view from its own applied offset up to the confirm offset.
7. Tail state: queue offsets and producer sequences for the next append; remove the marker.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import TYPE_CHECKING

import structlog

from broker.invariant import CorruptionError, StartupRefused
from broker.logformat import batch as bf
from broker.storage import atomic_file, identity
from broker.storage.failpoints import failpoint, fsync_dir
from broker.storage.segment import Segment

if TYPE_CHECKING:
    from broker.store import Store

log = structlog.get_logger("recovery")

CLEAN_MARKER = "clean_shutdown"
CLEAN_MAGIC = b"TMCS"
CLEAN_VERSION = 1
SCAN_CHUNK_BYTES = 8 << 20


def is_new_data_dir(data_dir: str) -> bool:
    """A directory is new when it holds no identity, no segment and no metadata database."""
    if atomic_file.exists_any(os.path.join(data_dir, identity.FILE_NAME)):
        return False
    log_dir = os.path.join(data_dir, "log")
    if os.path.isdir(log_dir) and any(n.endswith(".log") for n in os.listdir(log_dir)):
        return False
    return not os.path.exists(os.path.join(data_dir, "metadata", "data.mdb"))


def run(store: Store) -> dict[str, object]:
    t0 = time.monotonic()
    data_dir = store.data_dir
    is_new = store.is_new

    # 1. identity: loaded by load_identity() when the store was built, before any other file

    # 2. segment chain
    segs = store.log.segments
    for prev, nxt in itertools.pairwise(segs):
        if prev.end_offset != nxt.start_offset:
            raise StartupRefused(
                f"commit log gap or overlap: {prev.path} ends at {prev.end_offset} but {nxt.path} starts at "
                f"{nxt.start_offset}; run 'tidemark log verify {data_dir}'"
            )
    store.log.ensure_active(0)
    log_min = store.log.min_offset

    # 3. view checkpoints
    loaded: dict[str, bool] = {}
    for view in store.views:
        try:
            loaded[view.name] = view.load()  # type: ignore[attr-defined]
        except (CorruptionError, ValueError, KeyError) as exc:
            log.warning("view_checkpoint_unusable", view=view.name, error=str(exc))
            loaded[view.name] = False
            _reset_view(store, view.name)
    for name, ok in loaded.items():
        if not ok and not is_new:
            if log_min > 0:
                raise StartupRefused(
                    f"view {name}: no valid checkpoint and the log starts at {log_min} (older records were "
                    "removed by retention), so it cannot be rebuilt; restore the data directory from backup"
                )
            log.warning("view_rebuild_from_log", view=name)
    for view in store.views:
        if view.applied_offset < log_min:
            raise StartupRefused(f"view {view.name} needs the log from {view.applied_offset} but it starts at {log_min}")

    # 3b. epoch history: a master without one starts epoch 1 at its log end
    if not store.epochs.load() and not is_new and store.log.max_offset > 0:
        log.warning("epoch_history_missing", note="rebuilt from the log's batch headers")
        _rebuild_epochs(store)
    # 4. log tail
    log_end = store.log.max_offset
    marker = atomic_file.load(os.path.join(data_dir, CLEAN_MARKER), CLEAN_MAGIC, CLEAN_VERSION)
    clean = marker is not None and json.loads(marker.payload).get("log_end") == log_end
    scan_from = min(v.applied_offset for v in store.views)
    scanned = 0
    truncated_bytes = 0
    if not clean:
        if scan_from > log_end:
            raise StartupRefused(
                f"view checkpoints reach offset {scan_from} but the commit log ends at {log_end}: "
                "log bytes that were checkpointed are missing"
            )
        valid_end = _scan(store, scan_from)
        scanned = log_end - scan_from
        needed = max(v.applied_offset for v in store.views)
        if valid_end < needed:
            raise StartupRefused(
                f"commit log damaged at offset {valid_end}, below offset {needed} that views have already "
                "applied (confirmed data): refusing to truncate it; run 'tidemark log verify'"
            )
        if valid_end < log_end:
            truncated_bytes = log_end - valid_end
            _save_torn_tail(store, valid_end, log_end)
            failpoint("recovery_before_truncate")
            store.log.truncate(valid_end)
            log.warning("torn_tail_truncated", offset=valid_end, bytes=truncated_bytes)
            log_end = valid_end
    if max(v.applied_offset for v in store.views) > log_end:
        raise StartupRefused(f"a view checkpoint is above the commit log end {log_end}: log bytes are missing")

    # 5. durability point
    store.log.sync()
    store.flushed_offset = log_end
    if store.role == "slave":  # only the master knows what is confirmed: keep what the views applied
        store.confirm_offset = min(log_end, max(v.applied_offset for v in store.views))
    else:
        store.confirm_offset = min(store.confirm_source(log_end), log_end)

    # 6. replay
    replay_from = min(v.applied_offset for v in store.views)
    t_replay = time.monotonic()
    store.apply_until(store.confirm_offset)
    replay_s = time.monotonic() - t_replay
    store.applied_offset = min(v.applied_offset for v in store.views)

    # 7. tail state, epochs, marker
    store.rebuild_tail()
    store.epochs.truncate(store.log.max_offset)
    if store.role == "master" and not store.epochs.entries:
        store.epochs.start(1, store.log.max_offset)
    marker_path = os.path.join(data_dir, CLEAN_MARKER)
    for suffix in ("", ".bak"):
        if os.path.exists(marker_path + suffix):
            os.unlink(marker_path + suffix)
    fsync_dir(data_dir)
    report: dict[str, object] = {
        "clean": clean,
        "new": is_new,
        "scanned_bytes": scanned,
        "truncated_bytes": truncated_bytes,
        "replayed_bytes": store.confirm_offset - replay_from,
        "replay_seconds": round(replay_s, 4),
        "seconds": round(time.monotonic() - t0, 4),
    }
    log.info("recovery_done", **report)
    return report


def load_identity(store: Store) -> identity.Identity:
    """Pass 1, run first of all: an interrupted first start leaves a directory that is still new."""
    return identity.load_or_create(
        store.data_dir, is_new=store.is_new, cluster_id=store.config["node.cluster_id"],
        node_id=store.config["node.node_id"],
    )


def _rebuild_epochs(store: Store) -> None:
    entries: list[tuple[int, int]] = []
    for header, _ in store.iter_batches(store.log.min_offset, store.log.max_offset):
        if not entries or header.epoch > entries[-1][0]:
            entries.append((header.epoch, header.base_offset))
    store.epochs.replace(entries)


def _reset_view(store: Store, name: str) -> None:
    """Forget a view whose checkpoint could not be used; it rebuilds from offset 0 (if allowed)."""
    if name == "consume_queue":
        store.consume_queues._reset(0)
    elif name == "producer_state":
        store.producer_view.reset()
    elif name == "timer":
        store.timer_view.reset()


def _scan(store: Store, start: int) -> int:
    """Verify every batch from ``start``; return the end of the valid prefix (torn tail cut)."""
    segs = store.log.segments
    last = segs[-1]
    for seg in segs:
        if seg.end_offset <= start:
            continue
        pos = max(start, seg.start_offset) - seg.start_offset
        while pos < seg.size_bytes:
            data = seg.read(pos, min(SCAN_CHUNK_BYTES, seg.size_bytes - pos))
            mv = memoryview(data)
            i = 0
            while i < len(data):
                offset = seg.start_offset + pos + i
                remaining = seg.size_bytes - pos - i
                size = bf.peek_batch_bytes(mv, i) if len(data) - i >= 4 else 0
                if len(data) - i < bf.HEADER_BYTES or size > len(data) - i:
                    if size > remaining or remaining < bf.HEADER_BYTES:
                        return _torn_or_corrupt(seg, last, offset, "incomplete last batch")
                    if i == 0:  # batch bigger than the chunk
                        data = seg.read(pos, size)
                        mv = memoryview(data)
                        continue
                    break
                try:
                    header = bf.verify_batch(mv, i, path=seg.path)
                    if header.base_offset != offset:
                        raise CorruptionError(f"batch claims offset {header.base_offset}", path=seg.path, offset=offset)
                except CorruptionError as exc:
                    if size == 0 or (i + size == len(data) and pos + i + size == seg.size_bytes):
                        return _torn_or_corrupt(seg, last, offset, str(exc), zero_length=size == 0)
                    raise StartupRefused(
                        f"commit log corrupt in segment {seg.path} at offset {offset} "
                        f"(byte {pos + i} of the segment): {exc}; run 'tidemark log verify'"
                    ) from None
                i += size
            pos += i
    return last.end_offset


def _torn_or_corrupt(seg: Segment, last: Segment, offset: int, why: str, *, zero_length: bool = False) -> int:
    """A torn tail lies in the last segment; a zeroed length must be followed by zeros only."""
    if seg is not last:
        raise StartupRefused(f"commit log corrupt in segment {seg.path} at offset {offset}: {why}")
    if zero_length:
        pos = offset - seg.start_offset
        while pos < seg.size_bytes:
            chunk = seg.read(pos, min(SCAN_CHUNK_BYTES, seg.size_bytes - pos))
            if chunk.strip(b"\0"):
                raise StartupRefused(
                    f"commit log corrupt in segment {seg.path} at offset {offset}: a zeroed batch length "
                    "is followed by data (not a torn tail); run 'tidemark log verify'"
                )
            pos += len(chunk)
    log.warning("torn_tail_found", segment=seg.path, offset=offset, reason=why)
    return offset


def _save_torn_tail(store: Store, start: int, end: int) -> None:
    data = store.log.read(start, end - start)
    path = os.path.join(store.quarantine_dir(), f"torn-{start:020d}-{end:020d}.broken")
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_clean_marker(store: Store) -> None:
    payload = json.dumps({"log_end": store.log.max_offset, "time_ms": int(time.time() * 1000)}).encode()
    atomic_file.persist(os.path.join(store.data_dir, CLEAN_MARKER), CLEAN_MAGIC, CLEAN_VERSION, payload)
