"""A run of records cut out of the batches a read returned (docs/formats/commitlog.md, "Cut batches").

A read returns whole batches: a pull of 100 messages from batches of 1,000 would carry ten times
the bytes it answers, and a pop's run of 500 that straddles two such batches four times.
``cut_run`` keeps only the answered records: the first and last batches are cut to them, each
with a header of its own (record count, offsets, sequence and both CRCs of what it holds), and
the batches between stay as they are. A cut batch holds records exactly as the log does and says
where they are in it, so every reader of batches reads it unchanged. The log's CRCs are checked
before a batch is cut, so a cut never puts a fresh CRC on bytes that changed since they were
written: an answer with a batch that does not check is sent as read, and the caller logs why.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import crc32c

from broker.logformat.batch import HEADER_BYTES, build_header, peek_batch_bytes, record_span, verify_batch
from broker.logformat.errors import CorruptionError

_U32 = struct.Struct("<I")
_COUNT_AT = 12  # a batch header's record_count (u32)
_SEQUENCE_MAX = 0x7FFFFFFF

Blob = tuple[bytes | memoryview, ...]  # one blob of batches, in pieces to write one after another


class _Uncut(Exception):
    """What did not check: the answer goes as read."""


def cut_run(blobs: Sequence[bytes], skip_first: int, count: int) -> tuple[list[Blob], int, str | None]:
    """``blobs`` (runs of whole, adjacent batches) holding ``count`` records after the first
    ``skip_first``, as blobs of batches that hold just those, the records to skip in them (0), and
    None. Nothing after the run's last record is kept. When a batch's length, CRCs or framing do
    not check, every blob as read, ``skip_first``, and what did not check (for the caller's log).

    Its cost, on the thread that answers: the CRC of each batch it cuts, about half of copying
    it, while the answer then copies only the records kept; whole batches are not checked here."""
    try:
        return _cut(blobs, skip_first, count), 0, None
    except _Uncut as exc:
        return [(b,) for b in blobs], skip_first, str(exc)


def _cut(blobs: Sequence[bytes], skip: int, left: int) -> list[Blob]:
    out: list[Blob] = []
    for blob in blobs:
        if left <= 0:
            break
        mv = memoryview(blob)
        pos = whole = 0
        while pos < len(mv) and left > 0:
            if len(mv) - pos < HEADER_BYTES:
                raise _Uncut("a batch header shorter than 64 bytes")
            size, records = peek_batch_bytes(mv, pos), _U32.unpack_from(mv, pos + _COUNT_AT)[0]
            if size < HEADER_BYTES or size > len(mv) - pos or skip >= records:
                raise _Uncut(f"a batch length ({size}) or record count ({records}) that does not fit")
            if skip == 0 and records <= left:  # the whole batch is the run's
                left -= records
                pos += size
                continue
            keep = min(records - skip, left)
            if pos > whole:
                out.append((mv[whole:pos],))
            out.append(cut_batch(mv[pos : pos + size], skip, keep))
            left -= keep
            skip = 0
            pos += size
            whole = pos
        if pos > whole:
            out.append((mv[whole:pos],))
    if left > 0:
        raise _Uncut(f"{left} records fewer than the answer names")
    return out


def cut_batch(batch: memoryview, skip: int, keep: int) -> Blob:
    """The ``keep`` records of ``batch`` after its first ``skip`` as a batch of their own: a new
    header (and topic), then the records as they lie in ``batch``. ``_Uncut`` when the batch does
    not check (``verify_batch``: magic, version, both CRCs; the framing) or the cut's first
    sequence would not fit."""
    try:
        h = verify_batch(batch, 0)
    except CorruptionError as exc:
        raise _Uncut(f"a batch whose magic, CRCs or lengths do not check ({exc})") from None
    records_at = h.records_at
    span = record_span(batch, records_at, h.batch_bytes, skip, keep)
    if span is None or h.batch_bytes != len(batch) or (h.base_sequence >= 0 and h.base_sequence + skip > _SEQUENCE_MAX):
        raise _Uncut("a batch whose framing, length or sequence does not hold the cut")
    begin, stop = span
    records = batch[begin:stop]
    head = build_header(
        batch_bytes=records_at + stop - begin, record_count=keep, base_offset=h.base_offset + begin - records_at,
        base_queue_offset=h.base_queue_offset + skip, store_time_ms=h.store_time_ms, producer_id=h.producer_id,
        base_sequence=h.base_sequence + skip if h.base_sequence >= 0 else h.base_sequence, epoch=h.epoch,
        queue_id=h.queue_id, topic_raw=bytes(batch[HEADER_BYTES:records_at]), body_crc=crc32c.crc32c(records),
        flags=h.flags)
    return head, records
