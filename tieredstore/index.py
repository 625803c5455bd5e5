"""The in-memory list of tiered log objects, refreshed from the backend's listing."""

from __future__ import annotations

import bisect
import threading
import time

from tieredstore.backend import Backend
from tieredstore.objects import LOG_PREFIX, TieredObject, parse_key, run_end, runs

OVERLAP_LOOKBACK = 8  # objects before the last one starting at or below an offset that find() also asks


class ObjectIndex:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._objects: list[TieredObject] = []
        self._starts: list[int] = []
        self._lock = threading.Lock()
        self._added: list[TieredObject] = []
        self._removed: set[str] = set()  # keys removed while a listing ran
        self._listing = 0  # refreshes in progress
        self.refreshed_at = 0.0  # monotonic time of the last listing (0: never)

    def refresh(self) -> list[TieredObject]:
        """List the backend; return every tiered log object, sorted by (start, end).

        Objects added while the listing runs are kept, and objects removed while it runs stay
        removed: the listing may predate either (a listing that began before tiered retention
        deleted an object must not bring it back, where a read would find it in the cache).
        """
        with self._lock:
            if not self._listing:
                self._added = []
                self._removed = set()
            self._listing += 1
        try:
            listed = self.backend.list(LOG_PREFIX)
        except BaseException:
            with self._lock:
                self._listing -= 1
            raise
        found = {o.key: o for o in (parse_key(i.key, i.modified_s) for i in listed) if o is not None}
        with self._lock:
            self._listing -= 1
            for o in self._added:
                found.setdefault(o.key, o)
            for key in self._removed:
                found.pop(key, None)
            objs = sorted(found.values(), key=lambda o: (o.start, o.end))
            self._objects = objs
            self._starts = [o.start for o in objs]
            self.refreshed_at = time.monotonic()
        return list(objs)

    def objects(self) -> list[TieredObject]:
        with self._lock:
            return list(self._objects)

    def add(self, obj: TieredObject) -> None:
        with self._lock:
            if self._listing:
                self._added.append(obj)
                self._removed.discard(obj.key)
            i = bisect.bisect_right(self._starts, obj.start)
            self._objects.insert(i, obj)
            self._starts.insert(i, obj.start)

    def remove(self, obj: TieredObject) -> None:
        with self._lock:
            if self._listing:
                self._removed.add(obj.key)
            if obj in self._objects:
                i = self._objects.index(obj)
                del self._objects[i]
                del self._starts[i]

    def find(self, offset: int) -> TieredObject | None:
        """The object holding ``offset``: of those that do (one, unless two masters uploaded over
        each other around a failover), the newest epoch's, whose history is the one that stands;
        among equals the one starting last. Looks back ``OVERLAP_LOOKBACK`` objects at most."""
        with self._lock:
            i = bisect.bisect_right(self._starts, offset) - 1
            best: TieredObject | None = None
            for o in self._objects[max(0, i - OVERLAP_LOOKBACK + 1) : i + 1]:
                if offset < o.end and (best is None or o.epoch >= best.epoch):
                    best = o
            return best

    def contiguous_from(self, upto: int) -> int:
        """Lowest offset from which objects cover every byte up to ``upto`` (``upto`` when none do)."""
        with self._lock:
            for run in runs(self._objects):
                if run[0].start <= upto <= run_end(run):
                    return run[0].start
        return upto

    def end(self) -> int:
        """End of the newest object (0 when there is none)."""
        with self._lock:
            return max((o.end for o in self._objects), default=0)
