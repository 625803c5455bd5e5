"""The rolling timer wheel: a ring of slots over the timer log.

A timer due at ``at`` belongs to the absolute slot ``at // precision_ms`` and to the ring slot
``(at // precision_ms) % slots``. The ring covers ``slots * precision_ms`` (default 262,144 x
100 ms ≈ 7.3 h); a timer further out waits in its ring slot for later turns (a rolling wheel:
30 days at 100 ms would otherwise be 26 million slots). Each ring slot holds three numbers:
``first`` and ``last``, the timer-log positions of its chain (each SCHEDULED or RELINK record
points to the previous one of its slot; ``prev == NONE`` starts a chain), and ``count``, the
pending timers in it. A chain whose count drops to 0 is reset: the next link starts a new one.

All state changes go through ``link`` — for new records and for replaying the timer log — so
live operation and recovery cannot disagree. Nothing here reads a clock or a file: the caller
passes times and a record reader (unit tests run in simulated time).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from broker.timers import timerlog as tl

_NONE = np.uint64(tl.NONE)
_DELTAS = np.zeros(256, dtype=np.int64)
for _t, _d in tl.COUNT_DELTA.items():
    _DELTAS[_t] = _d
_DONE_TYPES = [t for t, d in tl.COUNT_DELTA.items() if d < 0]
SLOT_DTYPE = np.dtype([("ring", "<u4"), ("reserved", "<u4"), ("first", "<u8"), ("last", "<u8"), ("count", "<i8")])


class Wheel:
    def __init__(self, precision_ms: int, slots: int) -> None:
        self.precision_ms = precision_ms
        self.slots = slots
        self.first = np.full(slots, _NONE, dtype=np.uint64)
        self.last = np.full(slots, _NONE, dtype=np.uint64)
        self.count = np.zeros(slots, dtype=np.int64)

    def ring_of(self, at_ms: np.ndarray) -> np.ndarray:
        return (np.asarray(at_ms, dtype=np.int64) // self.precision_ms) % self.slots

    # -- the one mutation ---------------------------------------------------------------------
    def link(self, records: np.ndarray, base_pos: int, *, set_prev: bool) -> None:
        """Apply records that sit at ``base_pos`` onwards in the timer log (any type; MARK and
        FIRED_EVENT change nothing here).

        ``set_prev``: new records about to be written; each linked record's ``prev`` is filled
        in. Otherwise (replay) the stored ``prev`` says where chains start.
        """
        if not len(records):
            return
        types = records["type"]
        linked = np.flatnonzero((types == tl.SCHEDULED) | (types == tl.RELINK))
        done = np.flatnonzero(np.isin(types, _DONE_TYPES))  # SCHEDULED counts in _link_chain
        if not set_prev:
            self._replay(records, linked, done, base_pos)
            return
        if len(linked) and len(done):  # never in one live emit; kept exact for any caller
            for i in range(len(records)):
                self.link(records[i : i + 1], base_pos + i * tl.RECORD_BYTES, set_prev=True)
            return
        if len(linked):
            self._link_chain(records, linked, base_pos, set_prev=True)
        if len(done):
            rings = self.ring_of(records["at"][done])
            np.add.at(self.count, rings, _DELTAS[types[done]])
            emptied = np.unique(rings[self.count[rings] <= 0])
            self.first[emptied] = _NONE
            self.last[emptied] = _NONE

    def _replay(self, records: np.ndarray, linked: np.ndarray, done: np.ndarray, base_pos: int) -> None:
        """The state live linking reached, from stored records: a chain was reset exactly when its
        count reached 0, and every link after a reset was written with ``prev`` NONE."""
        if len(linked):
            self._link_chain(records, linked, base_pos, set_prev=False)
        if len(done):
            rings = self.ring_of(records["at"][done])
            np.add.at(self.count, rings, _DELTAS[records["type"][done]])
        touched = np.unique(self.ring_of(records["at"][np.concatenate([linked, done])]))
        emptied = touched[self.count[touched] <= 0]
        self.first[emptied] = _NONE
        self.last[emptied] = _NONE

    def _link_chain(self, records: np.ndarray, linked: np.ndarray, base_pos: int, *, set_prev: bool) -> None:
        rings = self.ring_of(records["at"][linked])
        poss = np.uint64(base_pos) + linked.astype(np.uint64) * np.uint64(tl.RECORD_BYTES)
        order = np.argsort(rings, kind="stable")
        r_sorted = rings[order]
        p_sorted = poss[order]
        starts = np.ones(len(order), dtype=bool)
        starts[1:] = r_sorted[1:] != r_sorted[:-1]
        prev = np.empty(len(order), dtype=np.uint64)
        prev[1:] = p_sorted[:-1]
        prev[starts] = self.last[r_sorted[starts]]
        if set_prev:
            stored = prev
            records["prev"][linked[order]] = stored
        else:
            stored = records["prev"][linked[order]]
        # a record with prev NONE starts its slot's chain
        new_chain = stored == _NONE
        self.first[r_sorted[new_chain]] = p_sorted[new_chain]
        ends = np.ones(len(order), dtype=bool)
        ends[:-1] = r_sorted[1:] != r_sorted[:-1]
        self.last[r_sorted[ends]] = p_sorted[ends]
        sched = records["type"][linked[order]] == tl.SCHEDULED
        np.add.at(self.count, r_sorted[sched], 1)

    # -- reading a chain ----------------------------------------------------------------------
    def walk(self, ring: int, read_block: Callable[[int], tuple[int, bytes]], *, stop_at: int = tl.NONE,
             floor: int = 0) -> np.ndarray:
        """The linked records of a ring slot, newest first, down to its chain start, ``stop_at``
        (exclusive: a position already walked) or a position below ``floor`` (deleted).

        ``read_block(pos)`` returns (start, bytes) of a stretch of the timer log holding the
        record at ``pos``: links of one slot usually sit close together, so one read serves many.
        """
        out: list[bytes] = []
        pos = int(self.last[ring])
        start, block = 0, b""
        unpack = tl.RECORD.unpack_from
        while pos != tl.NONE and pos != stop_at and pos >= floor:  # noqa: PLR1714
            at = pos - start
            if at < 0 or at + tl.RECORD_BYTES > len(block):
                start, block = read_block(pos)
                at = pos - start
            raw = block[at : at + tl.RECORD_BYTES]
            if len(raw) != tl.RECORD_BYTES:
                raise ValueError(f"timer-log record at {pos} is not readable")
            out.append(raw)
            pos = unpack(raw, 0)[2]
        if not out:
            return np.empty(0, dtype=tl.DTYPE)
        return np.frombuffer(b"".join(out), dtype=tl.DTYPE)

    # -- snapshot -----------------------------------------------------------------------------
    def occupied(self) -> np.ndarray:
        """The non-empty slots as a SLOT_DTYPE array."""
        rings = np.flatnonzero((self.count != 0) | (self.last != _NONE))
        out = np.zeros(len(rings), dtype=SLOT_DTYPE)
        out["ring"] = rings
        out["first"] = self.first[rings]
        out["last"] = self.last[rings]
        out["count"] = self.count[rings]
        return out

    def restore(self, slots: np.ndarray) -> None:
        self.first[:] = _NONE
        self.last[:] = _NONE
        self.count[:] = 0
        rings = slots["ring"].astype(np.int64)
        if len(rings) and int(rings.max()) >= self.slots:
            raise ValueError(f"slot {int(rings.max())} outside a wheel of {self.slots}")
        self.first[rings] = slots["first"]
        self.last[rings] = slots["last"]
        self.count[rings] = slots["count"]

    @property
    def pending(self) -> int:
        return int(self.count.sum())
