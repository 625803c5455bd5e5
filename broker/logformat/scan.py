"""The one walker of the batch format: whole batches in a byte range. Spec: docs/formats/commitlog.md.

Every reader of log bytes goes through ``scan`` (a range read through a callable: the commit log,
a segment, an object) or ``scan_bytes`` (bytes already in memory: a replication chunk, a pulled
blob). Both yield ``(header, batch)`` for each whole batch in order and say, in ``Scan.stop``,
where and why they stopped early. What an early stop means is the caller's choice of mode:

- ``STRICT``: the range holds whole, valid batches only; anything else raises ``CorruptionError``.
  For ranges that were verified before (the dispatcher below the confirm offset) or must be
  exact (a replicated chunk, an object to upload).
- ``TORN_TAIL``: stop at the first batch that is cut short or fails its checks, and describe it
  (``Stop``). Recovery tells a torn write (the last batch of the last segment, or a zeroed
  tail) from corruption with it; ``log verify`` reports it and goes on.
- ``PREFIX``: whole batches that fit in the range; a batch cut by the range's end ends the scan
  quietly (its declared length is in ``stop``). A batch that fails its checks still raises.
  For cutting a read at a batch boundary (replication shipping, tiered objects).

Checks on each batch: the header's magic, version, length and CRC32C; with ``verify_body`` also
the records' CRC32C; with ``check_offsets`` its ``base_offset`` must equal its position (the
range's offsets are commit offsets).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

from broker.logformat.batch import HEADER_BYTES, MAGIC, VERSION, BatchHeader, decode_header, peek_batch_bytes, verify_batch
from broker.logformat.errors import CorruptionError

Reader = Callable[[int, int], "bytes | memoryview"]
CHUNK_BYTES = 4 << 20  # one read of the range; a batch larger than this is read whole by itself
TOPIC_LEN_AT = 58  # the header's topic_len byte (docs/formats/commitlog.md)
_MAGIC_VERSION = struct.pack("<HB", MAGIC, VERSION)  # header bytes [8, 11)


class Mode(enum.Enum):
    STRICT = "strict"
    TORN_TAIL = "torn_tail"
    PREFIX = "prefix"


class Problem(enum.Enum):
    INCOMPLETE = "incomplete"  # the batch (or its header) runs past the end of the range
    INVALID = "invalid"  # the batch is whole but fails a check


@dataclass(frozen=True, slots=True)
class Stop:
    """Where a scan stopped before the end of its range, and why."""

    offset: int  # the valid prefix ends here
    problem: Problem
    declared_bytes: int  # the length field at ``offset`` (0 in a zero-filled tail; -1 if unreadable)
    error: str  # what failed, for logs and refusals
    at_range_end: bool  # the bad batch would end exactly where the range ends (a torn last write)

    @property
    def ends_walk(self) -> bool:
        """Nothing past this stop can be found: the batch is cut short, or its length cannot be one's."""
        return self.problem is Problem.INCOMPLETE or self.declared_bytes < HEADER_BYTES


@dataclass(frozen=True, slots=True)
class Damage:
    """Adjacent whole batches that fail their checks, stepped over by ``scan_past_damage``."""

    first: Stop  # the first of them: where and why
    end: int  # where the next batch starts
    batches: int

    @property
    def more(self) -> str:
        """What follows the first one's description: the rest of the run, if any."""
        if self.batches == 1:
            return ""
        return f"; {self.batches - 1} more damaged batches after it, up to offset {self.end}"


class Scan:
    """Iterate once for ``(header, batch memoryview)``; then ``end`` and ``stop`` tell the outcome."""

    def __init__(self, read: Reader, start: int, end: int, *, mode: Mode, verify_body: bool, check_offsets: bool,
                 chunk_bytes: int, path: str) -> None:
        self._read = read
        self.start = start
        self.range_end = end
        self.mode = mode
        self.verify_body = verify_body
        self.check_offsets = check_offsets
        self.chunk_bytes = chunk_bytes
        self.path = path
        self.end = start  # after the last batch yielded
        self.batches = 0
        self.stop: Stop | None = None

    def __iter__(self) -> Iterator[tuple[BatchHeader, memoryview]]:
        return cast("Iterator[tuple[BatchHeader, memoryview]]", self._walk(step_over=False))  # yields no Stop

    def _walk(self, *, step_over: bool) -> Iterator[tuple[BatchHeader, memoryview] | Damage | Stop]:
        """The walk. Without ``step_over`` the first stop ends it (kept in ``stop``, raised by the
        modes that raise). With it (``scan_past_damage``) a whole batch that fails its checks is
        stepped over (the walk goes on where its length field says the next one starts, in the chunk
        already read: one pass, linear in the bytes of the range), each run of them yielded as one
        ``Damage``, and the stop that ends the walk is yielded too.

        A length is trusted with a read of its own (a batch larger than a chunk) only once the
        header it belongs to passed its checks (magic, version, header CRC) and it fits in the range:
        garbage never sizes an allocation beyond the range's bytes."""
        check = verify_batch if self.verify_body else decode_header
        end = self.range_end
        pos = self.start
        run: Stop | None = None  # step_over: the first damaged batch of the run being stepped over
        run_batches = 0
        while pos < end:
            data = memoryview(self._read(pos, min(end - pos, self.chunk_bytes)))
            short = pos + len(data) < min(end, pos + self.chunk_bytes)  # the reader had less than the range
            limit = pos + len(data) if short else end
            i = 0
            n = len(data)
            while i < n:
                at = pos + i
                avail = n - i
                size = peek_batch_bytes(data, i) if avail >= 4 else -1
                bad: CorruptionError | None = None
                if avail < HEADER_BYTES or size > avail:
                    if size > limit - at or limit - at < HEADER_BYTES:
                        stop = self._problem(Problem.INCOMPLETE, at, size,
                                             f"batch at {at} declares {size} bytes; {limit - at} remain", False)
                        if step_over:
                            yield from _last(run, run_batches, at, stop)
                        return
                    if i > 0:
                        break  # the rest of this batch is in the next chunk
                    bad = _header_error(data, self.path)
                    if bad is None:  # one batch larger than a chunk, its header valid: read exactly it
                        data = memoryview(self._read(at, size))
                        n = len(data)
                        if n < size:
                            stop = self._problem(Problem.INCOMPLETE, at, size, f"batch at {at} declares {size} bytes; "
                                                 f"{n} could be read", False)
                            if step_over:
                                yield from _last(run, run_batches, at, stop)
                            return
                        continue
                elif run is not None and size >= HEADER_BYTES and data[i + 8 : i + 11] != _MAGIC_VERSION:
                    run_batches += 1  # in a run of damage a bad magic is all there is to know (only the first is described)
                    i += size
                    continue
                else:
                    try:
                        header = check(data, i, path=self.path)
                        if self.check_offsets and header.base_offset != at:
                            raise CorruptionError(f"batch claims offset {header.base_offset}", path=self.path, offset=at)
                    except CorruptionError as exc:
                        bad = exc
                if bad is not None:
                    if bad.offset not in (-1, at):  # the checks name a position in the chunk: say where in the range
                        bad = CorruptionError(bad.message, path=bad.path, offset=at)
                    stop = self._problem(Problem.INVALID, at, size, str(bad), at + size == end, bad)
                    if not step_over:
                        return
                    if stop.ends_walk:
                        yield from _last(run, run_batches, at, stop)
                        return
                    if run is None:
                        run, run_batches = stop, 0
                    run_batches += 1
                    i += size  # stepped over: the next batch starts where this one's length says
                    continue
                if run is not None:
                    yield Damage(run, at, run_batches)
                    run = None
                yield header, data[i : i + size]
                i += size
                self.end = at + size
                self.batches += 1
            if i == 0:  # nothing whole in what the reader returned
                stop = self._problem(Problem.INCOMPLETE, pos, peek_batch_bytes(data, 0) if n >= 4 else -1,
                                     f"no whole batch readable at {pos}", False)
                if step_over:
                    yield from _last(run, run_batches, pos, stop)
                return
            pos += i
        if run is not None:
            yield Damage(run, end, run_batches)

    def _problem(self, problem: Problem, at: int, size: int, why: str, at_range_end: bool,
                 exc: CorruptionError | None = None) -> Stop:
        self.stop = Stop(at, problem, size, why, at_range_end)
        if self.mode is Mode.STRICT or (self.mode is Mode.PREFIX and problem is Problem.INVALID):
            raise exc or CorruptionError(f"incomplete batch: {why}", path=self.path, offset=at)
        return self.stop


def _last(run: Stop | None, run_batches: int, at: int, stop: Stop) -> Iterator[Damage | Stop]:
    """How a walk past damage ends: the run of damaged batches stepped over up to ``at``, if any, then ``stop``."""
    if run is not None:
        yield Damage(run, at, run_batches)
    yield stop


def _header_error(data: memoryview, path: str) -> CorruptionError | None:
    """What is wrong with the header (magic, version, topic length, CRC) of the batch at the start of
    ``data``; None when it is valid, or when ``data`` is too short to hold it and its topic."""
    if len(data) < HEADER_BYTES or len(data) < HEADER_BYTES + data[TOPIC_LEN_AT]:
        return None
    try:
        decode_header(data, 0, path=path)
    except CorruptionError as exc:
        return exc
    return None


def scan(read: Reader, start: int, end: int, *, mode: Mode, verify_body: bool = False, check_offsets: bool = True,
         chunk_bytes: int = CHUNK_BYTES, path: str = "") -> Scan:
    """Walk the batches in [start, end) read through ``read(offset, length)`` (which may return
    less at the end of what it holds)."""
    return Scan(read, start, end, mode=mode, verify_body=verify_body, check_offsets=check_offsets,
                chunk_bytes=chunk_bytes, path=path)


def scan_past_damage(read: Reader, start: int, end: int, *, chunk_bytes: int = CHUNK_BYTES,
                     path: str = "") -> Iterator[tuple[BatchHeader, memoryview] | Damage | Stop]:
    """Every batch in [start, end) for a reader of damaged bytes (``log verify``, ``log quarantine``):
    each valid batch (both CRCs, its offset) as ``(header, batch)``; each run of adjacent whole
    batches that fail a check, stepped over (a length field says where the next one starts), as one
    ``Damage``; a batch cut short, or a length that cannot be one's, as the ``Stop`` that ends the
    walk. One pass over the range: time linear in its bytes, memory one chunk (or one batch)."""
    walk = Scan(read, start, end, mode=Mode.TORN_TAIL, verify_body=True, check_offsets=True, chunk_bytes=chunk_bytes,
                path=path)
    return walk._walk(step_over=True)


def scan_bytes(data: bytes | memoryview, base_offset: int = 0, *, mode: Mode, verify_body: bool = False,
               check_offsets: bool = True, path: str = "") -> Scan:
    """Walk the batches in ``data``, whose first byte is at commit offset ``base_offset``."""
    mv = memoryview(data)
    return Scan(lambda at, n: mv[at - base_offset : at - base_offset + n], base_offset, base_offset + len(mv),
                mode=mode, verify_body=verify_body, check_offsets=check_offsets, chunk_bytes=max(len(mv), 1), path=path)


def batch_boundary(data: bytes | memoryview, base_offset: int, limit: int) -> int:
    """Where to cut ``data`` (whose first byte is at commit offset ``base_offset``) so that it
    holds whole batches only and at most ``limit`` bytes. When even the first batch is longer than
    ``limit`` its whole length is returned, which may exceed ``len(data)``: read that much."""
    walk = scan_bytes(memoryview(data)[:limit], base_offset, mode=Mode.PREFIX)
    for _ in walk:
        pass
    if walk.end == base_offset and len(data) >= 4:  # not even the first batch fits: all of it
        first = peek_batch_bytes(data, 0)
        return first if first >= HEADER_BYTES else 0
    return walk.end - base_offset
