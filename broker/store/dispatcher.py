"""The dispatcher: applies the log to every view up to the confirm offset, and checkpoints them.

One thread (``loop``) waits for the confirm offset to pass the views, applies the new batches to
each view in log order (each from its own applied offset: ``apply_views``, shared with recovery),
and every ``checkpoint.interval_ms`` checkpoints the views that moved (or want it on their own
clock), then lets retention run when due. ``lock`` is held while it touches views: a snapshot
bundle or a timer round takes it to see the views standing still.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import lmdb
import structlog
from prometheus_client import Gauge

from broker import metrics
from broker.config import Config
from broker.logformat.scan import Mode, scan
from broker.storage.commitlog import CommitLog
from broker.storage.failpoints import failpoint
from broker.store.viewset import ViewSet
from broker.store.watermarks import Watermarks
from broker.views import View

log = structlog.get_logger("store")


def apply_views(log_: CommitLog, views: list[View], end: int) -> None:
    """Apply every view up to ``end``, each from its own applied offset (DESIGN §1)."""
    start = min(v.applied_offset for v in views)
    if start >= end:
        return
    for header, batch in scan(log_.read, start, end, mode=Mode.STRICT, path=log_.directory):
        for v in views:
            if header.base_offset >= v.applied_offset:
                v.apply(header, batch)
    for v in views:
        if v.applied_offset < end:
            v.end_round(end)


class Dispatcher:
    def __init__(self, config: Config, log_: CommitLog, views: ViewSet, watermarks: Watermarks) -> None:
        self.config = config
        self.log = log_
        self.views = views
        self.watermarks = watermarks
        self.lock = threading.Lock()  # held while the dispatcher touches views
        self.checkpointed: dict[str, int] = {}  # each view's newest checkpoint
        self.checkpointed_prev: dict[str, int] = {}  # the one before: the .bak recovery may fall back to
        self._last_ckpt = time.monotonic()
        self.queue_listeners: list[Callable[[set[tuple[str, int]]], None]] = []  # told which queues grew
        self._lag_gauges: dict[str, Gauge] = {}  # metrics.VIEW_LAG child per view

    def apply_until(self, end: int) -> None:
        """Apply every view up to ``end``, publish the new applied offset, tell queue listeners."""
        failpoint("views_before_apply")
        apply_views(self.log, self.views.all, end)
        self.watermarks.publish_applied(self.views.applied_min(), {v.name: v.applied_offset for v in self.views.all})
        grown = self.views.queues.take_grown() | self.views.txns.take_released()  # new records, or an LSO moved
        if grown:
            for listener in self.queue_listeners:
                listener(grown)

    def wait_applied(self, view: View, offset: int, timeout_s: float) -> bool:
        """Wait until ``view`` applied everything below ``offset``."""
        return self.watermarks.wait_view(view.name, lambda: view.applied_offset, offset, timeout_s)

    async def wait_applied_async(self, view: View, offset: int, timeout_s: float) -> bool:
        """``wait_applied`` for a coroutine on the server's event loop."""
        return await self.watermarks.wait_view_async(view.name, lambda: view.applied_offset, offset, timeout_s)

    def loop(self, after_round: list[Callable[[], None]]) -> None:
        """The dispatcher thread. ``after_round``: callables run after each round (retention)."""
        wm = self.watermarks
        self._last_ckpt = time.monotonic()
        while not wm.stop.is_set():
            with wm.cond:
                wm.cond.wait_for(lambda: wm.confirm_offset > wm.applied_offset or wm.stop.is_set(), 0.05)
                target = wm.confirm_offset
            if wm.stop.is_set():
                break
            with self.lock:
                self.round(target)
                for hook in after_round:
                    hook()

    def round(self, target: int) -> None:
        """Apply up to ``target``; checkpoint when due."""
        if target > self.watermarks.applied_offset:
            self.apply_until(target)
        for v in self.views.all:
            gauge = self._lag_gauges.get(v.name)
            if gauge is None:  # each view's child looked up once: this runs every round
                gauge = self._lag_gauges[v.name] = metrics.VIEW_LAG.labels(v.name)
            gauge.set(self.watermarks.confirm_offset - v.applied_offset)
        now = time.monotonic()
        if now - self._last_ckpt < self.config["checkpoint.interval_ms"] / 1000.0:
            return
        self._last_ckpt = now
        # also once more after the views went idle, so the previous checkpoint (the .bak that
        # recovery may fall back to, and so the retention floor) catches up as well
        moved = any(self.checkpointed.get(v.name) != v.applied_offset or self.checkpointed_prev.get(v.name) != v.applied_offset
                    for v in self.views.all)
        try:
            if moved:
                self.checkpoint_views()
            else:
                for v in self.views.all:
                    if v.checkpoint_due():  # e.g. the wheel snapshot, on its own clock
                        v.checkpoint()
        except (OSError, lmdb.Error) as exc:  # the previous checkpoint stays valid: retry later
            log.warning("checkpoint_failed", error=str(exc))

    def checkpoint_views(self) -> None:
        failpoint("views_before_checkpoint")
        for v in self.views.all:
            v.checkpoint()
            self.checkpointed_prev[v.name] = self.checkpointed.get(v.name, 0)
            self.checkpointed[v.name] = v.applied_offset
        failpoint("views_after_checkpoint")

    def checkpoint_floor(self) -> int:
        """Lowest offset a restart may replay from after a crash: a view may fall back to its
        previous checkpoint (0 until every view has checkpointed)."""
        if len(self.checkpointed_prev) < len(self.views.all):
            return 0
        return min(self.checkpointed_prev.values())
