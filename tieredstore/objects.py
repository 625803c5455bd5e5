"""Tiered objects: names, metadata and checks. Spec: docs/formats/tiered-objects.md.

An object holds whole commit-log batches ``[start, end)``, byte for byte as in the log. Its key
says everything needed to place it, so a listing alone gives the uploaded ranges in offset order::

    log/<start, 20 digits>-<end, 20 digits>-e<epoch, 10 digits>-c<crc32c, 8 hex>

``epoch`` is the leader epoch of the object's last batch (from its header), ``crc32c`` the CRC32C
of the whole object: both are functions of the bytes, so two uploads of the same range are the
same key. The same fields (plus batch count and store times) are repeated in the metadata.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import crc32c

from broker.invariant import CorruptionError
from broker.logformat.scan import Mode, batch_boundary, scan_bytes

LOG_PREFIX = "log/"
QUARANTINE_PREFIX = "quarantine/"
FORMAT_VERSION = "1"
_KEY_RE = re.compile(r"^log/(\d{20})-(\d{20})-e(\d{10})-c([0-9a-f]{8})$")


@dataclass(frozen=True, slots=True)
class TieredObject:
    start: int
    end: int
    epoch: int
    crc: int
    modified_s: float = field(default=0.0, compare=False)  # as listed; not part of the identity

    @property
    def key(self) -> str:
        return object_key(self.start, self.end, self.epoch, self.crc)

    @property
    def size_bytes(self) -> int:
        return self.end - self.start


def object_key(start: int, end: int, epoch: int, crc: int) -> str:
    return f"{LOG_PREFIX}{start:020d}-{end:020d}-e{epoch:010d}-c{crc:08x}"


def parse_key(key: str, modified_s: float = 0.0) -> TieredObject | None:
    """The object a key names; None for keys that are not tiered log objects."""
    m = _KEY_RE.match(key)
    if m is None:
        return None
    start, end = int(m.group(1)), int(m.group(2))
    if end <= start:
        return None
    return TieredObject(start, end, int(m.group(3)), int(m.group(4), 16), modified_s)


@dataclass(frozen=True, slots=True)
class Described:
    """An object about to be uploaded: its place, checksum and metadata."""

    obj: TieredObject
    batches: int
    first_store_time_ms: int
    last_store_time_ms: int

    def metadata(self, node_id: str) -> dict[str, str]:
        o = self.obj
        return {"tm-format": FORMAT_VERSION, "tm-start": str(o.start), "tm-end": str(o.end), "tm-epoch": str(o.epoch),
                "tm-crc32c": f"{o.crc:08x}", "tm-batches": str(self.batches),
                "tm-first-store-time-ms": str(self.first_store_time_ms),
                "tm-last-store-time-ms": str(self.last_store_time_ms), "tm-node": node_id}


def describe(data: bytes | memoryview, start: int) -> Described:
    """Verify every batch of ``data`` (whole batches from commit offset ``start``) and describe it.

    Raises CorruptionError on a bad CRC, a wrong offset or a cut batch: nothing corrupt is uploaded.
    """
    mv = memoryview(data)
    batches = 0
    epoch = first_ms = last_ms = 0
    for header, _ in scan_bytes(mv, start, mode=Mode.STRICT, verify_body=True, path="tiered upload"):
        if batches == 0:
            first_ms = header.store_time_ms
        epoch, last_ms = header.epoch, header.store_time_ms
        batches += 1
    if batches == 0:
        raise CorruptionError(f"object [{start}, {start + len(mv)}) holds no batch", path="tiered upload")
    obj = TieredObject(start, start + len(mv), epoch, crc32c.crc32c(mv))
    return Described(obj, batches, first_ms, last_ms)


def whole_batches(data: bytes | memoryview, start: int, limit: int) -> int:
    """Length of the longest prefix of ``data`` (from commit offset ``start``) made of whole batches
    and at most ``limit`` bytes, or exactly the first batch when it alone is longer (0 when even
    that is not wholly in ``data``)."""
    n = batch_boundary(data, start, limit)
    return n if n <= len(data) else 0


def runs(objects: list[TieredObject]) -> list[list[TieredObject]]:
    """Split objects (sorted by start) into runs that cover their range without a hole. An object
    that starts at or before the end of its run so far continues it: adjacent, or overlapping.
    Overlaps happen around a failover: a deposed master's put that passed its checks lands after
    the next master resumed from the same break point (chaos run 11: two objects from one start).
    ``ObjectIndex.find`` reads an overlap from the newest epoch's object."""
    out: list[list[TieredObject]] = []
    end = 0
    for o in objects:
        if out and o.start <= end:
            out[-1].append(o)
            end = max(end, o.end)
        else:
            out.append([o])
            end = o.end
    return out


def run_end(run: list[TieredObject]) -> int:
    """Where a run's coverage ends (its last object need not be the one that ends last)."""
    return max(o.end for o in run)
