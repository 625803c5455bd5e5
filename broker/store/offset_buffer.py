"""Consumer-offset double buffer (DESIGN §4).

Commits land in the *active* map. Every ``flush_interval_ms`` (or when the map holds
``entries_max`` entries) the maps swap and the *flushing* map is written as ONE batched
``offsets.commit`` metadata record. Reads look at active, then flushing, then the view, so a
consumer always reads its own latest commit.

A commit that asks to be durable (``commit(..., wait_s=...)``, what CommitOffset does) wakes the
flush at once and returns only when a record holding it was applied, that is, confirmed: as
Kafka's commitSync, a commit answered ok survives a crash or a failover. Commits that arrive
while a flush is in flight share the next record (group commit). Without a wait (internal
callers), a crash loses at most one interval of commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from broker.errors import BrokerError
from broker.threads import NamedThread

OffsetKey = tuple[str, str, int]


class OffsetBuffer:
    def __init__(
        self,
        flush_interval_ms: int,
        entries_max: int,
        write: Callable[[list[tuple[str, str, int, int]]], None],
        on_error: Callable[[str], None] = lambda _message: None,
        gate: Callable[[set[str]], None] = lambda _groups: None,
    ) -> None:
        """``on_error``: told each background flush's outcome (a message when it failed, "" when it worked).
        ``gate``: raises unless offsets of these groups may be committed here now (a group slot moving
        away: ``replication/slot_moves.py``); called under the buffer's lock, so a flush after the gate
        closed holds every offset it let in."""
        self.flush_interval_ms = flush_interval_ms
        self.on_error = on_error
        self.entries_max = entries_max
        self._write = write
        self._gate = gate
        self._lock = threading.Lock()
        self._flushed = threading.Condition(self._lock)
        self._generation = 0  # of the active map; each swap starts the next one
        self._done = -1  # every generation up to this one is written and applied
        self._failed = (-1, "")  # the last generation whose write failed, and why
        self._active: dict[OffsetKey, int] = {}
        self._flushing: dict[OffsetKey, int] = {}
        self._discards = 0  # on_role calls that dropped the buffer: a failed write must not restore it
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = NamedThread(target=self._run, name="offset-flush", daemon=True)
        self.records_written = 0

    def start(self) -> None:
        self._thread.start()

    def commit(self, entries: list[tuple[str, str, int, int]], wait_s: float | None = None) -> None:
        """Buffer ``entries``; with ``wait_s``, flush now and return once they are applied (raise
        ``UNAVAILABLE`` when that write failed, ``DEADLINE_EXCEEDED`` after ``wait_s``: either way
        they stay buffered and are written later, so the outcome is unknown, not refused)."""
        with self._lock:
            if entries:
                self._gate({g for g, _, _, _ in entries})
            for group, topic, queue, offset in entries:
                self._active[(group, topic, queue)] = offset
            full = len(self._active) >= self.entries_max
            generation = self._generation
        if full or wait_s is not None:
            self._wake.set()
        if wait_s is None:
            return
        deadline = time.monotonic() + wait_s
        with self._lock:
            while self._done < generation:
                if self._failed[0] >= generation:
                    raise BrokerError("UNAVAILABLE", f"consumer offsets not written: {self._failed[1]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BrokerError("DEADLINE_EXCEEDED", "consumer offsets buffered but not written in time")
                self._flushed.wait(left)

    def drop_topic(self, topic: str) -> None:
        """Forget buffered offsets of a deleted topic (they must not land on a re-created one)."""
        with self._lock:
            for d in (self._active, self._flushing):
                for key in [k for k in d if k[1] == topic]:
                    del d[key]

    def on_role(self, role: str) -> None:
        """A node that is not the master forgets what it buffered: it can no longer write it, and
        once the new master takes commits, the old values are stale (chaos seed 448474327: a slave
        answered a committed offset 6,938 messages behind the one both logs held, from a buffer
        left over from its time as master, and retried its write every 100 ms for good). Durable
        commits were answered only once applied; the others are lost as in a crash (one interval)."""
        if role == "master":
            return
        with self._lock:
            if not self._active and not self._flushing:
                return
            self._active, self._flushing = {}, {}
            self._discards += 1
            self._failed = (self._generation, "this node stopped being the master; commit to the new master")
            self._generation += 1
            self._flushed.notify_all()

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
            generation = self._generation
            self._generation += 1
            if not self._active:  # nothing to write (a dropped topic's entries, or none at all)
                self._done = generation
                self._flushed.notify_all()
                return
            self._flushing, self._active = self._active, {}
            batch = [(g, t, q, o) for (g, t, q), o in self._flushing.items()]
            discards = self._discards
        try:
            self._write(batch)  # returns once the metadata view has applied the record
        except Exception as exc:
            with self._lock:  # not written: put back what was not superseded (or dropped) meanwhile
                if discards == self._discards:
                    for key, offset in self._flushing.items():
                        self._active.setdefault(key, offset)
                self._flushing = {}
                self._failed = (generation, f"{type(exc).__name__}: {exc}"[:300])
                self._flushed.notify_all()
            raise
        with self._lock:
            self._flushing = {}
            self._done = generation
            self._flushed.notify_all()
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
