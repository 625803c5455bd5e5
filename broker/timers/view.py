"""The timer view: applies ``__timer`` records and timer deliveries to the timer log, the wheel
and the index; checkpoints are wheel snapshots (DESIGN §5, problem S1).

What it applies (docs/formats/timer-records.md):

- scheduled records → SCHEDULED, linked into the slot of their deliver time;
- a delivery batch (``FLAG_TIMER_DELIVERY``), the authoritative fire marker → DELIVERED;
- ``fired`` events → FIRED_EVENT (a DELIVERED timer without one is re-announced by the master);
- ``cancelled`` / ``dropped`` events → CANCELLED / DROPPED; ``forwarded`` (its queue had moved to
  another shard, which stored it: docs/shards.md) → DROPPED.

Each dispatcher round's records are written as one timer-log group closed by a MARK carrying
the applied commit offset. Recovery (``load``): the newest valid snapshot at or below the
recovered timer-log end, then the timer-log tail from its position, counts included; without
a snapshot, the wheel is rebuilt from the timer log alone; without either, from the commit log.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import structlog

from broker import clock, metrics
from broker.config import Config
from broker.logformat import batch as bf
from broker.logformat import timer_props as tr
from broker.storage.commitlog import CommitLog
from broker.storage.failpoints import failpoint
from broker.timers import snapshot as snaps
from broker.timers import timerlog as tl
from broker.timers.index import DELIVERED, PENDING, TimerIndex
from broker.timers.wheel import Wheel
from broker.views.base import View, copy_prefix

log = structlog.get_logger("timer.view")


class TimerView(View):
    name = "timer"

    def __init__(self, directory: str, config: Config) -> None:
        self.directory = directory
        self.snapshot_dir = os.path.join(directory, "snapshots")
        self.log = CommitLog(os.path.join(directory, "log"), config["timer.log_segment_bytes"])
        self.precision_ms = config["timer.precision_ms"]
        self.wheel = Wheel(self.precision_ms, config["timer.wheel_slots"])
        self.index = TimerIndex()
        self.snapshot_enabled = bool(config["timer.snapshot_enabled"])
        self.snapshot_interval_s = config["timer.snapshot_interval_ms"] / 1000.0
        self.snapshot_keep = config["timer.snapshot_keep"]
        self.applied_offset = 0
        self._marked_offset = -1  # commit offset of the newest MARK in the timer log
        self._pending: list[np.ndarray] = []  # records linked this round, written at end_round
        self._pending_count = 0
        self._last_snapshot = time.monotonic()
        self._kept: list[tuple[int, int, int]] = []  # kept snapshots: (position, commit offset, low-water position)
        self.late: list[tuple[int, int]] = []  # (timer offset, deliver time) scheduled behind the firing cursor
        self.fire_floor_ms: int | None = None  # set by the firing service: its cursor's start time
        self.loaded_from = ""
        self.cut_bytes = 0  # timer-log bytes recovery cut off (a torn or damaged tail)
        self.lock = threading.Lock()  # guards ``late`` against the firing thread
        self._body_hold: int | None = None  # ``body_hold()`` as of the last checkpoint

    # -- recovery -------------------------------------------------------------------------------
    def load(self) -> bool:
        self.log.ensure_active(0)
        snap = snaps.load_newest(self.snapshot_dir, self.log.max_offset, self.precision_ms, self.wheel.slots)
        if snap is not None:
            scan = tl.scan_groups(self.log, snap.timer_log_position)
            self._cut(scan.valid_end)
            self.wheel.restore(snap.slots)
            tail = tl.read_records(self.log, snap.timer_log_position, scan.valid_end)
            self.wheel.link(tail, snap.timer_log_position, set_prev=False)
            self._rebuild_index(max(snap.low_water_position, self.log.min_offset), scan.valid_end)
            self.applied_offset = scan.applied_offset if scan.applied_offset is not None else snap.commit_offset
            self._kept = [(snap.timer_log_position, snap.commit_offset, snap.low_water_position)]
            self.loaded_from = f"snapshot@{snap.timer_log_position}+{scan.valid_end - snap.timer_log_position}B tail"
        else:
            start = self.log.min_offset
            scan = tl.scan_groups(self.log, start)
            self._cut(scan.valid_end)
            if scan.applied_offset is None:
                self.loaded_from = "nothing"
                return False
            records = tl.read_records(self.log, start, scan.valid_end)
            self._rebuild_index(start, scan.valid_end, records)
            self.applied_offset = scan.applied_offset
            self._relink_all()
            self.loaded_from = f"timer log rebuild ({scan.valid_end - start}B)"
        self._marked_offset = self.applied_offset
        self._body_hold = self.body_hold()
        log.info("timer_view_loaded", source=self.loaded_from, applied_offset=self.applied_offset,
                 pending=self.index.pending, timer_log_end=self.log.max_offset)
        return True

    def _relink_all(self) -> None:
        """Without a snapshot: fresh chains for every pending timer, in one RELINK group. The
        stored links cannot be trusted here: the wheel's shape (slots, precision) may differ from
        the one that wrote them, and links into deleted segments are gone."""
        live = slice(self.index.low, self.index.size)
        pending = self.index.state[live] == PENDING
        offs, ats = self.index.off[live][pending], self.index.at[live][pending]
        self.wheel.restore(np.zeros(0, dtype=snaps.SLOT_DTYPE))
        recs = tl.new_records(len(offs))
        recs["off"] = offs
        recs["at"] = ats
        recs["type"] = tl.RELINK
        self._emit(recs)
        self._write_group(self.applied_offset)
        np.add.at(self.wheel.count, self.wheel.ring_of(ats), 1)

    def _cut(self, valid_end: int) -> None:
        if valid_end < self.log.max_offset:
            self.cut_bytes = self.log.max_offset - valid_end
            log.warning("timer_log_tail_cut", offset=valid_end, bytes=self.log.max_offset - valid_end)
            self.log.truncate(valid_end)

    def _rebuild_index(self, start: int, end: int, records: np.ndarray | None = None) -> None:
        if records is None or start != self.log.min_offset:
            records = tl.read_records(self.log, start, end)
        self.index.rebuild(records, start)

    def reset(self) -> None:
        """Forget everything (rebuild from the commit log)."""
        self.log.truncate(self.log.min_offset)
        self.wheel.restore(np.zeros(0, dtype=snaps.SLOT_DTYPE))
        self.index = TimerIndex()
        self.applied_offset = 0
        self._body_hold = None

    # -- apply ------------------------------------------------------------------------------------
    def apply(self, header: bf.BatchHeader, batch: memoryview) -> None:
        if header.topic == tr.TIMER_TOPIC:
            if tr.is_event_batch(batch, header):
                self._apply_events(header, batch)
            else:
                self._apply_scheduled(header, batch)
                if self._body_hold is None:  # the first pending body since the last checkpoint
                    self._body_hold = header.base_offset
        elif header.flags & bf.FLAG_TIMER_DELIVERY:
            offs = np.array(tr.leading_offsets(batch, header, skip_first=False), dtype=np.uint64)
            self._finish(offs, tl.DELIVERED, PENDING)

    def _apply_scheduled(self, header: bf.BatchHeader, batch: memoryview) -> None:
        positions, times = tr.deliver_times(batch, header)
        recs = tl.new_records(len(positions))
        offs = np.array(positions, dtype=np.uint64) + np.uint64(header.base_offset)
        recs["off"] = offs
        recs["at"] = times
        recs["type"] = tl.SCHEDULED
        base = self._emit(recs)
        self.index.add(offs, recs["at"], np.uint64(base) + np.arange(len(recs), dtype=np.uint64) * np.uint64(tl.RECORD_BYTES))
        floor = self.fire_floor_ms
        if floor is not None:
            behind = recs["at"] < floor
            if behind.any():
                with self.lock:
                    self.late.extend(zip(offs[behind].tolist(), recs["at"][behind].tolist(), strict=True))

    def _apply_events(self, header: bf.BatchHeader, batch: memoryview) -> None:
        if header.flags & bf.FLAG_TIMER_FIRED:  # the common case: a round's fired events, offsets only
            fired = np.array(tr.leading_offsets(batch, header, skip_first=True), dtype=np.uint64)
            self._finish(fired, tl.FIRED_EVENT, DELIVERED)
            return
        # a forwarded timer (its queue moved to another shard, which stored it) ends as a dropped one here
        kinds = {tr.FIRED: (tl.FIRED_EVENT, DELIVERED), tr.CANCELLED: (tl.CANCELLED, PENDING), tr.DROPPED: (tl.DROPPED, PENDING),
                 tr.FORWARDED: (tl.DROPPED, PENDING)}
        by_kind: dict[str, list[int]] = {}
        for kind, off, _ in tr.event_refs(batch, header):
            by_kind.setdefault(kind, []).append(off)
        for kind, offs in by_kind.items():  # one kind per batch in practice: vectorised per kind
            rtype, required = kinds[kind]
            self._finish(np.array(offs, dtype=np.uint64), rtype, required)

    def _finish(self, offs: np.ndarray, rtype: int, required_state: int) -> None:
        """Record ``rtype`` for timers now in ``required_state``; others are ignored (a repeat)."""
        idx = self.index.find(offs)
        ok = idx >= 0
        ok[ok] = self.index.state[idx[ok]] == required_state
        if not ok.all():
            log.warning("timer_event_ignored", kind=rtype, timer_offsets=offs[~ok][:10].tolist(),
                        note="unknown timer or not in the expected state")
        idx = idx[ok]
        if not len(idx):
            return
        recs = tl.new_records(len(idx))
        recs["off"] = self.index.off[idx]
        recs["at"] = self.index.at[idx]
        recs["type"] = rtype
        self._emit(recs)
        self.index.advance(idx, tl.STATE_OF[rtype])

    def _emit(self, recs: np.ndarray) -> int:
        """Link ``recs`` into the wheel now; they are written at the end of the round."""
        base = self.log.max_offset + self._pending_count * tl.RECORD_BYTES
        self.wheel.link(recs, base, set_prev=True)
        self._pending.append(recs)
        self._pending_count += len(recs)
        return base

    def end_round(self, offset: int) -> None:
        if self._pending:
            self._write_group(offset)
        self.applied_offset = offset

    def _write_group(self, offset: int) -> None:
        records = np.concatenate(self._pending) if self._pending else tl.new_records(0)
        start = self.log.max_offset
        self.log.append([[tl.close_group(records, start, offset, clock.wall_ms())]])
        self._pending.clear()
        self._pending_count = 0
        self._marked_offset = offset

    # -- the firing service's writes (under the store's views lock) -------------------------------
    def relink(self, ring: int, offs: np.ndarray, ats: np.ndarray) -> None:
        """Start a new chain for ``ring`` holding only these (pending, later-turn) timers."""
        recs = tl.new_records(len(offs))
        recs["off"] = offs
        recs["at"] = ats
        recs["type"] = tl.RELINK
        saved = int(self.wheel.first[ring]), int(self.wheel.last[ring])
        self.wheel.last[ring] = tl.NONE  # the first RELINK starts the new chain
        self.wheel.first[ring] = tl.NONE
        self._emit(recs)
        try:
            self._write_group(self.applied_offset)
        except OSError:  # nothing was written (a failed append is undone): keep the old chain
            self.wheel.first[ring], self.wheel.last[ring] = saved
            self._pending.clear()
            self._pending_count = 0
            raise

    def read_block(self, pos: int, block_bytes: int = 64 << 10) -> tuple[int, bytes]:
        """(start, bytes) of the timer log up to and including the record at ``pos`` (chains
        point backwards, so the block ends there)."""
        start = max(self.log.min_offset, pos + tl.RECORD_BYTES - block_bytes)
        start -= (start - self.log.min_offset) % tl.RECORD_BYTES
        return start, self.log.read(start, pos + tl.RECORD_BYTES - start)

    # -- checkpoint -------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        self._body_hold = self.body_hold()
        if self._marked_offset != self.applied_offset:
            self._write_group(self.applied_offset)  # a MARK: replay after a crash starts here
        due = time.monotonic() - self._last_snapshot >= self.snapshot_interval_s
        # with no timer pending a snapshot is a few bytes: take one at every checkpoint, so that
        # the timer view holds back log retention no more than the other views do
        idle = self.index.low_water() is None and self.wheel.pending == 0
        if self.snapshot_enabled and (due or idle or not self._kept):
            self.write_snapshot()
        elif not self.snapshot_enabled:
            self.log.sync()

    def checkpoint_due(self) -> bool:
        """The wheel snapshot runs on its own clock, whether the log moves or not."""
        return self.snapshot_due()

    def snapshot_due(self) -> bool:
        """A snapshot would say something the kept ones do not, and its interval has passed."""
        if not self.snapshot_enabled or time.monotonic() - self._last_snapshot < self.snapshot_interval_s:
            return False
        return not self._kept or self._kept[0][0] != self.log.max_offset or len(self._kept) > 1

    def write_snapshot(self) -> None:
        t0 = time.perf_counter()
        position = self.log.max_offset
        keep = self.snapshot_keep
        if self._kept and self._kept[0][0] == position:
            self._last_snapshot = time.monotonic()
            if len(self._kept) == 1:
                return
            # nothing changed since the newest snapshot: a second copy of it (its .bak) replaces
            # the older fallbacks, so they stop holding back log retention
            keep = 1
        self.log.sync()  # every record the snapshot points at is durable first
        low = self.index.low_water()
        low_pos = low[1] if low is not None else position
        snap = snaps.Snapshot(position, self.applied_offset, low_pos, self.precision_ms, self.wheel.slots,
                              self.index.pending, self.wheel.occupied())
        failpoint("timer_before_snapshot")
        kept = snaps.write(self.snapshot_dir, snap, keep)
        failpoint("timer_after_snapshot")
        entries = [(position, self.applied_offset, low_pos), *self._kept]
        self._kept = [e for i, e in enumerate(entries) if e[0] in kept and e[0] not in [x[0] for x in entries[:i]]]
        self._last_snapshot = time.monotonic()
        floor = min(w for _, _, w in self._kept)
        for path in self.log.delete_segments_below(min(floor, low_pos)):
            log.info("timer_log_segment_deleted", path=path)
        metrics.TIMER_SNAPSHOT_SECONDS.set(time.perf_counter() - t0)

    def stage(self, data_dir: str, staging: str) -> None:
        """A fresh wheel snapshot at the applied offset and the timer log up to its position."""
        if self._marked_offset != self.applied_offset:
            self._write_group(self.applied_offset)
        self.write_snapshot()
        position = self.log.max_offset
        copy_prefix(snaps.path_for(self.snapshot_dir, position), data_dir, staging)
        for seg in self.log.segments:
            copy_prefix(seg.path, data_dir, staging, min(seg.end_offset, position) - seg.start_offset)

    def replay_floor(self) -> int:
        return self.recovery_floor()

    def read_floor(self) -> int | None:
        """Pending timers' bodies stay readable (locally, or in tiered storage): the oldest pending one
        as of the last checkpoint (or load), read without touching the live index, which only the
        dispatcher changes. A timer scheduled since is above it: its body is newer still."""
        return self._body_hold

    def recovery_floor(self) -> int:
        """The lowest commit offset a restart may replay from: the oldest kept snapshot's."""
        if self.snapshot_enabled and self._kept:
            return min(c for _, c, _ in self._kept)
        return self._marked_offset if self._marked_offset >= 0 else 0

    def body_hold(self) -> int | None:
        """Commit offset of the oldest pending timer's body (retention must keep it)."""
        low = self.index.low_water()
        return None if low is None else low[0]

    def close(self) -> None:
        self.log.close()
