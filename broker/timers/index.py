"""Every live timer by its ``timer_offset``: deliver time, timer-log position, state.

Scheduled records are applied in commit order, so timer offsets arrive increasing and the
arrays stay sorted: a lookup is a binary search, and no per-timer Python object exists (17 bytes
and a timer-log position per timer). States only grow: PENDING → DELIVERED → FIRED, or PENDING →
CANCELLED / DROPPED. The low-water mark is the first timer that is pending or delivered without
its ``fired`` event yet; everything below it is finished and is dropped from the arrays now
and then. It is derived state: rebuilt from the timer log at start-up (``rebuild``).
"""

from __future__ import annotations

import numpy as np

from broker.timers import timerlog as tl

PENDING, DELIVERED, FIRED, CANCELLED, DROPPED = 0, 1, 2, 3, 4
STATE_NAMES = {PENDING: "pending", DELIVERED: "delivered", FIRED: "fired", CANCELLED: "cancelled", DROPPED: "dropped"}
_INITIAL_CAPACITY = 1024


class TimerIndex:
    def __init__(self) -> None:
        self.off = np.zeros(_INITIAL_CAPACITY, dtype=np.uint64)
        self.at = np.zeros(_INITIAL_CAPACITY, dtype=np.int64)
        self.pos = np.zeros(_INITIAL_CAPACITY, dtype=np.uint64)
        self.state = np.zeros(_INITIAL_CAPACITY, dtype=np.uint8)
        self.size = 0
        self.low = 0  # every index below is finished
        self.pending = 0

    # -- growth -------------------------------------------------------------------------------
    def _reserve(self, extra: int) -> None:
        need = self.size + extra
        if need <= len(self.off):
            return
        if self.low > self.size // 2:  # reuse the finished prefix before growing
            self.compact()
            if self.size + extra <= len(self.off):
                return
        cap = max(need, 2 * len(self.off))
        for name in ("off", "at", "pos", "state"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)

    def compact(self) -> None:
        """Drop the finished prefix (indices shift down by ``low``)."""
        if self.low == 0:
            return
        n = self.size - self.low
        for name in ("off", "at", "pos", "state"):
            arr = getattr(self, name)
            arr[:n] = arr[self.low : self.size]
        self.size = n
        self.low = 0

    def add(self, offs: np.ndarray, ats: np.ndarray, poss: np.ndarray) -> None:
        """Append timers whose offsets are increasing and above every known one."""
        n = len(offs)
        if not n:
            return
        if self.size and int(offs[0]) <= int(self.off[self.size - 1]):
            raise ValueError(f"timer offset {int(offs[0])} is not above {int(self.off[self.size - 1])}")
        self._reserve(n)
        s = self.size
        self.off[s : s + n] = offs
        self.at[s : s + n] = ats
        self.pos[s : s + n] = poss
        self.state[s : s + n] = PENDING
        self.size += n
        self.pending += n

    # -- lookups ------------------------------------------------------------------------------
    def find(self, timer_offsets: np.ndarray) -> np.ndarray:
        """Index of each offset, -1 where unknown (finished and dropped, or never a timer)."""
        offs = np.asarray(timer_offsets, dtype=np.uint64)
        known = self.off[: self.size]  # finished timers stay findable until compact() drops them
        if not len(known):
            return np.full(len(offs), -1, dtype=np.int64)
        i = np.searchsorted(known, offs)
        found = (i < len(known)) & (known[np.minimum(i, len(known) - 1)] == offs)
        return np.where(found, i, -1).astype(np.int64)

    def state_of(self, timer_offset: int) -> int | None:
        i = int(self.find(np.array([timer_offset], dtype=np.uint64))[0])
        return None if i < 0 else int(self.state[i])

    # -- state changes ------------------------------------------------------------------------
    def advance(self, idx: np.ndarray, new_state: int) -> np.ndarray:
        """Raise the state of timers at ``idx`` (ignoring -1); return the mask of those that were pending."""
        idx = np.unique(idx[idx >= 0])
        was_pending = self.state[idx] == PENDING
        self.pending -= int(np.count_nonzero(was_pending))
        np.maximum.at(self.state, idx, new_state)
        self._raise_low()
        return was_pending

    def _raise_low(self) -> None:
        if self.low >= self.size or self.state[self.low] <= DELIVERED:
            return
        open_ = np.flatnonzero(self.state[self.low : self.size] <= DELIVERED)
        self.low = self.low + int(open_[0]) if len(open_) else self.size

    # -- views of the whole ---------------------------------------------------------------------
    def due(self, now_ms: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, deliver times) of pending timers due at ``now_ms``."""
        sl = slice(self.low, self.size)
        mask = (self.state[sl] == PENDING) & (self.at[sl] <= now_ms)
        return self.off[sl][mask], self.at[sl][mask]

    def undelivered_events(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, deliver times) of timers delivered whose ``fired`` event is missing."""
        sl = slice(self.low, self.size)
        mask = self.state[sl] == DELIVERED
        return self.off[sl][mask], self.at[sl][mask]

    def low_water(self) -> tuple[int, int] | None:
        """(timer offset, timer-log position) of the oldest unfinished timer, None if none."""
        if self.low >= self.size:
            return None
        return int(self.off[self.low]), int(self.pos[self.low])

    def memory_bytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in ("off", "at", "pos", "state"))

    # -- rebuild ------------------------------------------------------------------------------
    def rebuild(self, records: np.ndarray, base_pos: int) -> None:
        """Derive the index from timer-log records starting at position ``base_pos``."""
        sched = np.flatnonzero(records["type"] == tl.SCHEDULED)
        n = len(sched)
        self.off = np.array(records["off"][sched], dtype=np.uint64)
        self.at = np.array(records["at"][sched], dtype=np.int64)
        self.pos = (sched.astype(np.uint64) * np.uint64(tl.RECORD_BYTES)) + np.uint64(base_pos)
        self.state = np.zeros(n, dtype=np.uint8)
        self.size, self.low = n, 0
        for rtype, state in tl.STATE_OF.items():
            refs = records["off"][records["type"] == rtype]
            idx = self.find(refs)
            np.maximum.at(self.state, idx[idx >= 0], state)
        self.pending = int(np.count_nonzero(self.state == PENDING))
        self._raise_low()
        self._reserve(_INITIAL_CAPACITY)
