"""The timer log: fixed-size 32-byte records in their own segmented file (docs/formats/timer-log.md).

It is a view's file: derived from the commit log, never fsynced on the write path, fsynced
before a wheel snapshot that points into it. Records are written in **groups**, each closed by a
MARK record carrying the commit offset the view has applied and the CRC32C of the whole group,
so a torn or garbage tail is found by checking groups, and replay knows which commit offset the
surviving records reflect.

Record (little-endian)::

    0  u64 timer_offset   the timer (commit offset of its scheduled record); MARK: applied offset
    8  i64 deliver_at_ms  MARK: wall-clock ms when written
    16 u64 prev           SCHEDULED/RELINK: the previous record of the same wheel-slot chain, NONE
                          when this one starts the chain; MARK: the group's start position
    24 u8  type           SCHEDULED, RELINK, DELIVERED, FIRED_EVENT, CANCELLED, DROPPED, MARK
    25 u8  flags          0
    26 u16 reserved
    28 u32 crc            MARK only: CRC32C of the group's bytes up to this field
"""

from __future__ import annotations

import struct

import crc32c
import numpy as np

from broker.storage.commitlog import CommitLog

RECORD_BYTES = 32
NONE = (1 << 64) - 1
SCHEDULED, RELINK, DELIVERED, FIRED_EVENT, CANCELLED, DROPPED, MARK = 1, 2, 3, 4, 5, 6, 7
RECORD = struct.Struct("<QqQBBHI")
DTYPE = np.dtype([("off", "<u8"), ("at", "<i8"), ("prev", "<u8"), ("type", "u1"), ("flags", "u1"),
                  ("reserved", "<u2"), ("crc", "<u4")])
if not RECORD.size == RECORD_BYTES == DTYPE.itemsize:  # the spec's byte table; a changed format must not go unnoticed
    raise ImportError(f"timer-log record is {RECORD.size} bytes, the format says {RECORD_BYTES}")
LINKED = (SCHEDULED, RELINK)  # the record types that are links of a slot chain
# what each record type does to the pending count of its slot
COUNT_DELTA = {SCHEDULED: 1, DELIVERED: -1, CANCELLED: -1, DROPPED: -1}
# the index state a record moves its timer to (states only grow; see TimerIndex)
STATE_OF = {DELIVERED: 1, FIRED_EVENT: 2, CANCELLED: 3, DROPPED: 4}


def close_group(records: np.ndarray, group_start: int, applied_offset: int, now_ms: int) -> bytes:
    """The bytes of one group: ``records`` (a DTYPE array) then its MARK."""
    body = records.tobytes()
    mark = bytearray(RECORD.pack(applied_offset, now_ms, group_start, MARK, 0, 0, 0))
    crc = crc32c.crc32c(body + bytes(mark[:28]))
    struct.pack_into("<I", mark, 28, crc)
    return body + bytes(mark)


class GroupScan:
    """Result of checking groups from a start position: where the valid prefix ends, and the
    commit offset the last valid MARK carries (None when no group was valid)."""

    def __init__(self, valid_end: int, applied_offset: int | None, groups: int) -> None:
        self.valid_end = valid_end
        self.applied_offset = applied_offset
        self.groups = groups


def scan_groups(log: CommitLog, start: int) -> GroupScan:
    """Check every group from ``start`` (a group boundary); stop at the first bad one."""
    end = log.max_offset
    data = log.read(start, end - start) if end > start else b""
    arr = np.frombuffer(data, dtype=DTYPE, count=len(data) // RECORD_BYTES)
    pos = start
    applied: int | None = None
    groups = 0
    for m in np.flatnonzero(arr["type"] == MARK).tolist():
        group_start = int(arr["prev"][m])
        mark_at = start + m * RECORD_BYTES
        if group_start != pos:
            break  # a MARK that does not close the group that starts here: garbage from here on
        if crc32c.crc32c(data[group_start - start : m * RECORD_BYTES + 28]) != int(arr["crc"][m]):
            break
        pos = mark_at + RECORD_BYTES
        applied = int(arr["off"][m])
        groups += 1
    return GroupScan(pos, applied, groups)


def read_records(log: CommitLog, start: int, end: int) -> np.ndarray:
    """Records in [start, end) as a DTYPE array (a copy owned by the caller)."""
    if end <= start:
        return np.empty(0, dtype=DTYPE)
    data = log.read(start, end - start)
    return np.frombuffer(data, dtype=DTYPE, count=len(data) // RECORD_BYTES)


def new_records(n: int) -> np.ndarray:
    arr = np.zeros(n, dtype=DTYPE)
    arr["prev"] = NONE
    return arr
