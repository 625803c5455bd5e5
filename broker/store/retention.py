"""Local log retention (``retention.local_bytes`` / ``retention.local_ms``): whole old segments go,
never one that something may still need.

Two floors, one for each kind of need:
- ``read_floor``: records at or above it must stay readable, locally or in tiered storage (a
  snapshot being streamed; the bodies of pending timers, ``View.read_floor``). Tiered
  retention honours it too.
- ``local_floor``: the read floor, plus what a restart may replay from (each view's previous
  checkpoint, ``View.replay_floor``) and what plugins need locally (with tiered storage, only
  uploaded ranges may go: ``register_floor``).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable

import structlog

from broker import clock, metrics
from broker.config import Config
from broker.ports import RetentionFloor
from broker.storage.commitlog import CommitLog
from broker.store.viewset import ViewSet

log = structlog.get_logger("store")


class Retention:
    def __init__(self, config: Config, log_: CommitLog, views: ViewSet, checkpoint_floor: Callable[[], int]) -> None:
        self.config = config
        self.log = log_
        self.views = views
        self.checkpoint_floor = checkpoint_floor
        self._holds: dict[int, int] = {}  # hold id -> offset (snapshot streams)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._floors: list[RetentionFloor] = []
        self._last_run = time.monotonic()

    def register_floor(self, floor: RetentionFloor) -> None:
        self._floors.append(floor)

    def hold(self, offset: int) -> int:
        """Keep everything at or above ``offset`` until ``release``; return the hold's id."""
        with self._lock:
            hold_id = next(self._ids)
            self._holds[hold_id] = offset
        return hold_id

    def release(self, hold_id: int) -> None:
        with self._lock:
            self._holds.pop(hold_id, None)

    def read_floor(self) -> int | None:
        """Lowest offset whose records must stay readable anywhere; None when nothing is held."""
        with self._lock:
            floors = list(self._holds.values())
        floors += [f for f in (v.read_floor() for v in self.views.all) if f is not None]
        return min(floors) if floors else None

    def local_floor(self) -> int:
        """Nothing at or above it may be deleted locally."""
        floors = [self.checkpoint_floor(), *(f() for f in self._floors)]
        floors += [f for f in (v.replay_floor() for v in self.views.all) if f is not None]
        read = self.read_floor()
        if read is not None:
            floors.append(read)
        return min(floors)

    def maybe_enforce(self) -> None:
        """Run ``enforce`` every ``retention.check_interval_ms`` (the dispatcher calls this)."""
        now = time.monotonic()
        if now - self._last_run < self.config["retention.check_interval_ms"] / 1000.0:
            return
        self._last_run = now
        try:
            self.enforce()
        except OSError as exc:  # retention can wait; the dispatcher must not die
            log.warning("retention_failed", error=str(exc))

    def enforce(self) -> list[str]:
        """Delete the oldest segments that are too big or too old and below ``local_floor``."""
        local_bytes = self.config["retention.local_bytes"]
        local_ms = self.config["retention.local_ms"]
        if not local_bytes and not local_ms:
            return []
        floor = self.local_floor()
        segs = self.log.segments
        total = sum(s.size_bytes for s in segs)
        cut = 0
        now = clock.wall_s()
        for seg in segs[:-1]:
            too_big = bool(local_bytes) and total > local_bytes
            too_old = bool(local_ms) and (now - os.path.getmtime(seg.path)) * 1000 > local_ms
            if not (too_big or too_old) or seg.end_offset > floor:
                break
            cut = seg.end_offset
            total -= seg.size_bytes
        removed = self.log.delete_segments_below(cut) if cut else []
        for path in removed:
            log.info("segment_deleted", path=path, reason="retention")
        metrics.SEGMENTS.set(len(self.log.segments))
        return removed
