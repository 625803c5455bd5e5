"""Wheel snapshots (docs/formats/timer-snapshot.md): only the non-empty slots, with a header
naming the timer-log position and the commit offset they reflect.

Each snapshot is its own small file ``snapshots/<timer-log position, 20 digits>.snap`` written
through ``atomic_file.persist`` (magic ``TMWS``, generation, CRC32C). The newest
``timer.snapshot_keep`` are kept. Loading tries them newest first: one above the recovered
timer-log end is set aside (it describes records that are gone), an invalid one is quarantined
by ``atomic_file.load``, and the next older one is used.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import numpy as np
import structlog

from broker.storage import atomic_file
from broker.storage.segment import parse_segment_name
from broker.timers.wheel import SLOT_DTYPE

log = structlog.get_logger("timer.snapshot")

MAGIC = b"TMWS"
VERSION = 1
SUFFIX = ".snap"
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class Snapshot:
    timer_log_position: int
    commit_offset: int
    low_water_position: int
    precision_ms: int
    wheel_slots: int
    pending: int
    slots: np.ndarray

    def encode(self) -> bytes:
        head = json.dumps({
            "timer_log_position": self.timer_log_position, "commit_offset": self.commit_offset,
            "low_water_position": self.low_water_position, "precision_ms": self.precision_ms,
            "wheel_slots": self.wheel_slots, "pending": self.pending, "slot_count": len(self.slots),
        }).encode()
        return _LEN.pack(len(head)) + head + self.slots.tobytes()

    @classmethod
    def decode(cls, payload: bytes) -> Snapshot:
        (n,) = _LEN.unpack_from(payload, 0)
        head = json.loads(payload[4 : 4 + n])
        body = payload[4 + n :]
        if len(body) != head["slot_count"] * SLOT_DTYPE.itemsize:
            raise ValueError(f"snapshot holds {len(body)} slot bytes for {head['slot_count']} slots")
        slots = np.frombuffer(body, dtype=SLOT_DTYPE).copy()
        return cls(int(head["timer_log_position"]), int(head["commit_offset"]), int(head["low_water_position"]),
                   int(head["precision_ms"]), int(head["wheel_slots"]), int(head["pending"]), slots)


def path_for(directory: str, position: int) -> str:
    return os.path.join(directory, f"{position:020d}{SUFFIX}")


def positions(directory: str) -> list[int]:
    """Timer-log positions of the snapshot files present, newest first."""
    if not os.path.isdir(directory):
        return []
    found = (parse_segment_name(name, SUFFIX) for name in os.listdir(directory))
    return sorted((p for p in found if p is not None), reverse=True)


def write(directory: str, snap: Snapshot, keep: int) -> list[int]:
    """Persist ``snap``; remove all but the newest ``keep``; return the positions kept."""
    os.makedirs(directory, exist_ok=True)
    atomic_file.persist(path_for(directory, snap.timer_log_position), MAGIC, VERSION, snap.encode())
    kept = positions(directory)
    for old in kept[keep:]:
        for suffix in ("", ".bak"):
            path = path_for(directory, old) + suffix
            if os.path.exists(path):
                os.unlink(path)
    return kept[:keep]


def load_newest(directory: str, timer_log_end: int, precision_ms: int, wheel_slots: int) -> Snapshot | None:
    """The newest valid snapshot at or below ``timer_log_end`` made for this wheel shape."""
    for position in positions(directory):
        path = path_for(directory, position)
        if position > timer_log_end:
            for copy in (path, path + ".bak"):
                if os.path.exists(copy):
                    atomic_file.quarantine(copy, f"snapshot at timer-log position {position} is beyond the timer "
                                                 f"log's recovered end {timer_log_end}")
            continue
        loaded = atomic_file.load(path, MAGIC, VERSION)  # an invalid copy is quarantined here
        if loaded is None:
            continue
        try:
            snap = Snapshot.decode(loaded.payload)
        except (ValueError, KeyError, struct.error) as exc:
            atomic_file.quarantine(loaded.path, f"undecodable snapshot: {exc}")
            continue
        if (snap.precision_ms, snap.wheel_slots) != (precision_ms, wheel_slots):
            log.warning("timer_snapshot_other_shape", path=path, precision_ms=snap.precision_ms,
                        wheel_slots=snap.wheel_slots, note="the wheel is rebuilt from the timer log")
            continue
        if snap.timer_log_position != position:
            atomic_file.quarantine(loaded.path, f"snapshot names position {snap.timer_log_position}, file says {position}")
            continue
        return snap
    return None
