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

from broker.logformat.batch import HEADER, HEADER_BYTES, MAGIC, VERSION, build_header, record_span

_U32 = struct.Struct("<I")
_SEQUENCE_MAX = 0x7FFFFFFF

Blob = tuple[bytes | memoryview, ...]  # one blob of batches, in pieces to write one after another


def cut_run(blobs: Sequence[bytes], skip_first: int, count: int) -> tuple[list[Blob], int, str | None]:
    """``blobs`` (runs of whole, adjacent batches) holding ``count`` records after the first
    ``skip_first``, as blobs of batches that hold just those, the records to skip in them (0), and
    None. Nothing after the run's last record is kept. When a batch's length, CRCs or framing do
    not check, every blob as read, ``skip_first``, and what did not check (for the caller's log).

    Its cost, on the thread that answers: the CRC of each batch it cuts, about half of copying
    it, while the answer then copies only the records kept; whole batches are not checked here."""
    out: list[Blob] = []
    skip, left = skip_first, count
    for blob in blobs:
        if left <= 0:
            break
        mv = memoryview(blob)
        pos = whole = 0
        while pos < len(mv) and left > 0:
            if len(mv) - pos < HEADER_BYTES:
                return [(b,) for b in blobs], skip_first, "a batch header shorter than 64 bytes"
            size, records = _U32.unpack_from(mv, pos)[0], _U32.unpack_from(mv, pos + 12)[0]
            if size < HEADER_BYTES or size > len(mv) - pos or skip >= records:
                why = f"a batch length ({size}) or record count ({records}) that does not fit"
                return [(b,) for b in blobs], skip_first, why
            if skip == 0 and records <= left:  # the whole batch is the run's
                left -= records
                pos += size
                continue
            keep = min(records - skip, left)
            cut = cut_batch(mv[pos : pos + size], skip, keep)
            if cut is None:
                return [(b,) for b in blobs], skip_first, "a batch whose magic, CRCs or framing do not check"
            if pos > whole:
                out.append((mv[whole:pos],))
            out.append(cut)
            left -= keep
            skip = 0
            pos += size
            whole = pos
        if pos > whole:
            out.append((mv[whole:pos],))
    if left > 0:
        return [(b,) for b in blobs], skip_first, f"{left} records fewer than the answer names"
    return out, 0, None


def cut_batch(batch: memoryview, skip: int, keep: int) -> tuple[bytes, memoryview] | None:
    """The ``keep`` records of ``batch`` after its first ``skip`` as a batch of their own: a new
    header (and topic), then the records as they lie in ``batch``. None when the batch does not
    check (magic, version, either CRC, framing) or the cut's first sequence would not fit."""
    (batch_bytes, header_crc, magic, version, flags, _count, base_offset, base_queue_offset, store_time_ms,
     producer_id, base_sequence, epoch, queue_id, topic_len, _reserved, body_crc) = HEADER.unpack_from(batch, 0)
    records_at = HEADER_BYTES + topic_len
    if magic != MAGIC or version != VERSION or batch_bytes != len(batch) or records_at > batch_bytes:
        return None
    if crc32c.crc32c(batch[8:records_at]) != header_crc or crc32c.crc32c(batch[records_at:]) != body_crc:
        return None
    span = record_span(batch, records_at, batch_bytes, skip, keep)
    if span is None or (base_sequence >= 0 and base_sequence + skip > _SEQUENCE_MAX):
        return None
    begin, stop = span
    records = batch[begin:stop]
    head = build_header(
        batch_bytes=records_at + stop - begin, record_count=keep, base_offset=base_offset + begin - records_at,
        base_queue_offset=base_queue_offset + skip, store_time_ms=store_time_ms, producer_id=producer_id,
        base_sequence=base_sequence + skip if base_sequence >= 0 else base_sequence, epoch=epoch, queue_id=queue_id,
        topic_raw=bytes(batch[HEADER_BYTES:records_at]), body_crc=crc32c.crc32c(records), flags=flags)
    return head, records
