"""Consumer-offset double buffer (DESIGN §4).

Commits land in the *active* map. Every ``flush_interval_ms`` (or when the map holds
``entries_max`` entries) the maps swap and the *flushing* map is written as ONE batched
``offsets.commit`` metadata record. Reads look at active, then flushing, then the view, so a
consumer always reads its own latest commit. A crash loses at most one interval of commits:
the consumer re-reads at most that much.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

OffsetKey = tuple[str, str, int]


class OffsetBuffer:
    def __init__(
        self,
        flush_interval_ms: int,
        entries_max: int,
        write: Callable[[list[tuple[str, str, int, int]]], None],
        on_error: Callable[[str], None] = lambda _message: None,
    ) -> None:
        """``on_error``: told each background flush's outcome (a message when it failed, "" when it worked)."""
        self.flush_interval_ms = flush_interval_ms
        self.on_error = on_error
        self.entries_max = entries_max
        self._write = write
        self._lock = threading.Lock()
        self._active: dict[OffsetKey, int] = {}
        self._flushing: dict[OffsetKey, int] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="offset-flush", daemon=True)
        self.records_written = 0

    def start(self) -> None:
        self._thread.start()

    def commit(self, entries: list[tuple[str, str, int, int]]) -> None:
        with self._lock:
            for group, topic, queue, offset in entries:
                self._active[(group, topic, queue)] = offset
            full = len(self._active) >= self.entries_max
        if full:
            self._wake.set()

    def drop_topic(self, topic: str) -> None:
        """Forget buffered offsets of a deleted topic (they must not land on a re-created one)."""
        with self._lock:
            for d in (self._active, self._flushing):
                for key in [k for k in d if k[1] == topic]:
                    del d[key]

    def get(self, group: str, topic: str, queue: int) -> int | None:
        key = (group, topic, queue)
        with self._lock:
            if key in self._active:
                return self._active[key]
            return self._flushing.get(key)

    def buffered(self) -> dict[OffsetKey, int]:
        """Every commit still in the buffer (newer than the metadata view)."""
        with self._lock:
            return {**self._flushing, **self._active}

    def flush(self) -> None:
        """Swap and write now (also called at shutdown)."""
        with self._lock:
            if not self._active:
                return
            self._flushing, self._active = self._active, {}
            batch = [(g, t, q, o) for (g, t, q), o in self._flushing.items()]
        try:
            self._write(batch)  # returns once the metadata view has applied the record
        except Exception:
            with self._lock:  # not written: put back what was not superseded meanwhile
                for key, offset in self._flushing.items():
                    self._active.setdefault(key, offset)
                self._flushing = {}
            raise
        with self._lock:
            self._flushing = {}
        self.records_written += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval_ms / 1000.0)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.flush()
            except Exception as exc:  # kept in the buffer and retried next interval; never silent
                self.on_error(f"{type(exc).__name__}: {exc}")
            else:
                self.on_error("")

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
