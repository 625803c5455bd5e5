"""Start-up recovery, as numbered passes, run before the store is built (Kafka's ``LogLoader``
shape). The same path serves a clean start, a crash and a slave bootstrap (DESIGN §1): load each
view's newest valid checkpoint, then replay the log from there up to the confirm offset.

1. Identity (``load_identity``, run first of all by ``Store.open``): load ``identity`` or create
   it in a new directory; refuse a non-new directory without a valid one.
2. Segment chain: every segment must start where the previous one ends (a name in ``log/`` that
   is not a segment's is never read: logged once, ``log_file_ignored``).
3. View checkpoints: load each view's newest valid checkpoint (``View.load``). A view without a
   usable one is rebuilt from offset 0 (``View.reset``) when the log still starts at 0; otherwise
   start-up is refused *before* anything is reset. A missing epoch history is rebuilt from the log.
4. Log tail: after a clean shutdown (a valid ``clean_shutdown`` marker matching the log end) no
   scan is needed. Otherwise every batch from the lowest view checkpoint to the end is verified
   (``broker.logformat.scan``, torn-tail mode); a torn tail is saved to ``quarantine/`` and
   truncated; any other damage refuses start-up, naming segment and offset. Checkpoints above the
   log end (lost unsynced log bytes) refuse too.
5. Durability point: fsync the log; flushed = log end. A master confirms everything flushed; a
   slave keeps what its views already applied, since only its master knows what else is
   confirmed (an old master rejoining as a slave must not apply its unreplicated tail).
6. Replay: apply each view from its own applied offset up to the confirm offset.
7. Tail state: queue offsets and producer sequences for the next append; epochs; remove the marker.

Specs: docs/formats/commitlog.md (torn tail vs corruption), docs/formats/small-file.md (the
``clean_shutdown`` marker).
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from broker import clock
from broker.config import Config
from broker.invariant import CorruptionError, StartupRefused
from broker.logformat.scan import Mode, Problem, scan
from broker.storage import atomic_file, identity
from broker.storage.commitlog import CommitLog
from broker.storage.epochs import EpochHistory
from broker.storage.failpoints import failpoint, fsync_dir
from broker.storage.quarantine import keep_log_range
from broker.storage.segment import Segment, parse_segment_name
from broker.store.appender import TailState
from broker.store.dispatcher import apply_views
from broker.store.viewset import ViewSet

log = structlog.get_logger("recovery")

CLEAN_MARKER = "clean_shutdown"
CLEAN_MAGIC = b"TMCS"
CLEAN_VERSION = 1
SCAN_CHUNK_BYTES = 8 << 20


@dataclass
class Recovered:
    """What recovery established: the store starts from here."""

    flushed_offset: int
    confirm_offset: int
    applied_offset: int
    tail: TailState
    report: dict[str, object]


def is_new_data_dir(data_dir: str) -> bool:
    """A directory is new when it holds no identity, no segment and no metadata database."""
    if atomic_file.exists_any(os.path.join(data_dir, identity.FILE_NAME)):
        return False
    log_dir = os.path.join(data_dir, "log")
    if os.path.isdir(log_dir) and any(parse_segment_name(n) is not None for n in os.listdir(log_dir)):
        return False
    return not os.path.exists(os.path.join(data_dir, "metadata", "data.mdb"))


def recover(data_dir: str, *, is_new: bool, role: str, log_: CommitLog, views: ViewSet,
            epochs: EpochHistory) -> Recovered:
    """Passes 2-7 (pass 1, the identity, ran before any other file was opened)."""
    t0 = time.monotonic()

    # 2. segment chain (a name that is not a segment's is not read: said once, as log verify says it)
    for name in log_.stray_names:
        log.warning("log_file_ignored", path=os.path.join(log_.directory, name),
                    note="not a segment name (20 ASCII digits and .log)")
    for prev, nxt in itertools.pairwise(log_.segments):
        if prev.end_offset != nxt.start_offset:
            raise StartupRefused(
                f"commit log gap or overlap: {prev.path} ends at {prev.end_offset} but {nxt.path} starts at "
                f"{nxt.start_offset}; run 'tidemark log verify {data_dir}'"
            )
    log_.ensure_active(0)
    log_min = log_.min_offset

    # 3. view checkpoints, epoch history
    for view in views.all:
        unusable = ""
        try:
            ok = view.load()
        except (CorruptionError, ValueError, KeyError, TypeError, struct.error) as exc:  # a wrong shape too
            unusable, ok = str(exc), False
        if not ok and not is_new:
            if log_min > 0:  # decided before anything is reset: what cannot be rebuilt is never wiped
                raise StartupRefused(
                    f"view {view.name}: {'checkpoint unusable (' + unusable + ')' if unusable else 'no valid checkpoint'} "
                    f"and the log starts at {log_min} (older records were removed by retention), so it cannot be "
                    "rebuilt; restore the data directory from backup"
                )
            log.warning("view_rebuild_from_log", view=view.name)
        if unusable:
            log.warning("view_checkpoint_unusable", view=view.name, error=unusable)
        if not ok:
            view.reset()  # rebuilt from offset 0
    for view in views.all:
        if view.applied_offset < log_min:
            raise StartupRefused(f"view {view.name} needs the log from {view.applied_offset} but it starts at {log_min}")
    if not epochs.load() and not is_new and log_.max_offset > 0:  # a master without one starts epoch 1 (pass 7)
        log.warning("epoch_history_missing", note="rebuilt from the log's batch headers")
        _rebuild_epochs(log_, epochs)

    # 4. log tail
    log_end = log_.max_offset
    marker = atomic_file.load(os.path.join(data_dir, CLEAN_MARKER), CLEAN_MAGIC, CLEAN_VERSION)
    clean = marker is not None and json.loads(marker.payload).get("log_end") == log_end
    scan_from = views.applied_min()
    scanned = truncated_bytes = 0
    if not clean:
        if scan_from > log_end:
            raise StartupRefused(
                f"view checkpoints reach offset {scan_from} but the commit log ends at {log_end}: "
                "log bytes that were checkpointed are missing"
            )
        valid_end = _scan(log_, scan_from)
        scanned = log_end - scan_from
        needed = views.applied_max()
        if valid_end < needed:
            raise StartupRefused(
                f"commit log damaged at offset {valid_end}, below offset {needed} that views have already "
                "applied (confirmed data): refusing to truncate it; run 'tidemark log verify'"
            )
        if valid_end < log_end:
            truncated_bytes = log_end - valid_end
            keep_log_range(data_dir, log_, valid_end, log_end, "torn", ".broken")
            failpoint("recovery_before_truncate")
            log_.truncate(valid_end)
            log.warning("torn_tail_truncated", offset=valid_end, bytes=truncated_bytes)
            log_end = valid_end
    if views.applied_max() > log_end:
        raise StartupRefused(f"a view checkpoint is above the commit log end {log_end}: log bytes are missing")

    # 5. durability point
    log_.sync()
    flushed = log_end
    confirm = min(log_end, views.applied_max()) if role == "slave" else log_end

    # 6. replay
    replay_from = views.applied_min()
    t_replay = time.monotonic()
    apply_views(log_, views.all, confirm)
    replay_s = time.monotonic() - t_replay

    # 7. tail state, epochs, marker
    tail = TailState.rebuild(log_, views.queues, views.producers, views.txns)
    epochs.truncate(log_.max_offset)
    if role == "master" and not epochs.entries:
        epochs.start(1, log_.max_offset)
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
        "replayed_bytes": confirm - replay_from,
        "replay_seconds": round(replay_s, 4),
        "seconds": round(time.monotonic() - t0, 4),
    }
    log.info("recovery_done", **report)
    return Recovered(flushed, confirm, views.applied_min(), tail, report)


def load_identity(config: Config, data_dir: str, *, is_new: bool) -> identity.Identity:
    """Pass 1, run first of all: an interrupted first start leaves a directory that is still new."""
    return identity.load_or_create(data_dir, is_new=is_new, cluster_id=config["node.cluster_id"],
                                   node_id=config["node.node_id"])


def _rebuild_epochs(log_: CommitLog, epochs: EpochHistory) -> None:
    entries: list[tuple[int, int]] = []
    for header, _ in scan(log_.read, log_.min_offset, log_.max_offset, mode=Mode.STRICT, path=log_.directory):
        if not entries or header.epoch > entries[-1][0]:
            entries.append((header.epoch, header.base_offset))
    epochs.replace(entries)


def _scan(log_: CommitLog, start: int) -> int:
    """Verify every batch from ``start``; return the end of the valid prefix (torn tail cut)."""
    segs = log_.segments
    last = segs[-1]
    for seg in segs:
        if seg.end_offset <= start:
            continue
        walk = scan(_reader(seg), max(start, seg.start_offset), seg.end_offset, mode=Mode.TORN_TAIL, verify_body=True,
                    chunk_bytes=SCAN_CHUNK_BYTES, path=seg.path)
        for _ in walk:
            pass
        stop = walk.stop
        if stop is None:
            continue
        if stop.problem is Problem.INCOMPLETE:
            return _torn_or_corrupt(seg, last, stop.offset, f"incomplete last batch: {stop.error}")
        if stop.declared_bytes == 0 or stop.at_range_end:  # a zeroed length, or the last batch of the segment
            return _torn_or_corrupt(seg, last, stop.offset, stop.error, zero_length=stop.declared_bytes == 0)
        raise StartupRefused(
            f"commit log corrupt in segment {seg.path} at offset {stop.offset} "
            f"(byte {stop.offset - seg.start_offset} of the segment): {stop.error}; run 'tidemark log verify'"
        )
    return last.end_offset


def _reader(seg: Segment) -> Callable[[int, int], bytes]:
    """Reads of one segment by commit offset."""
    return lambda offset, length: seg.read(offset - seg.start_offset, length)


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


def write_clean_marker(data_dir: str, log_end: int) -> None:
    payload = json.dumps({"log_end": log_end, "time_ms": clock.wall_ms()}).encode()
    atomic_file.persist(os.path.join(data_dir, CLEAN_MARKER), CLEAN_MAGIC, CLEAN_VERSION, payload)
