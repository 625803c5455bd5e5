"""Batch and record framing: round trips and every validation that guards the log."""

from __future__ import annotations

import crc32c
import pytest

from broker.invariant import CorruptionError
from broker.logformat import batch as bf


def _batch(n: int = 3, topic: str = "orders") -> bytes:
    records, _ = bf.encode_records([(b"body%d" % i, b"k%d" % i, bf.encode_props({"p": str(i)})) for i in range(n)])
    head = bf.build_header(
        batch_bytes=bf.HEADER_BYTES + len(topic) + len(records), record_count=n, base_offset=4096,
        base_queue_offset=10, store_time_ms=123, producer_id=9, base_sequence=5, epoch=2, queue_id=1,
        topic_raw=topic.encode(), body_crc=crc32c.crc32c(records),
    )
    return head + records


def test_roundtrip() -> None:
    """Every header field and record survives encode → verify → iterate."""
    data = _batch()
    h = bf.verify_batch(data, 0)
    assert (h.topic, h.queue_id, h.base_offset, h.base_queue_offset, h.record_count) == ("orders", 1, 4096, 10, 3)
    assert (h.producer_id, h.base_sequence, h.epoch, h.store_time_ms) == (9, 5, 2, 123)
    recs = [(bytes(k), bf.decode_props(p), bytes(b)) for _, k, p, b in bf.iter_records(data, h)]
    assert recs == [(b"k%d" % i, {"p": str(i)}, b"body%d" % i) for i in range(3)]


@pytest.mark.parametrize("where", [8, 20, 64, 80, -1])
def test_any_flipped_byte_is_detected(where: int) -> None:
    """A single flipped bit in header, topic or body fails a CRC."""
    data = bytearray(_batch())
    data[where] ^= 0x10
    with pytest.raises(CorruptionError):
        bf.verify_batch(bytes(data), 0)


def test_record_framing_checks() -> None:
    """Record walking rejects a wrong count and lengths that run past the end."""
    records, positions = bf.encode_records([(b"a", b"", b""), (b"bb", b"", b"")])
    assert bf.record_positions(records, 2) == positions
    with pytest.raises(ValueError, match="declares 3"):
        bf.record_positions(records, 3)
    with pytest.raises(ValueError, match="declares 1 records but holds more"):  # stops at the declared count
        bf.record_positions(records, 1)
    with pytest.raises(ValueError, match="bad length"):
        bf.record_positions(records[:-1], 2)
    with pytest.raises(ValueError):
        bf.record_positions(b"\xff\xff\xff\x7f\0\0\0\0", 1)
