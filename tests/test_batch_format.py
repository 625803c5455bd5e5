"""Batch and record framing: round trips and every validation that guards the log."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable

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


def _outcome(walk: Callable[[bytes, int], object], records: bytes, count: int) -> str:
    try:
        walk(records, count)
    except ValueError as exc:
        return str(exc)
    return "ok"


def test_the_native_walk_is_built() -> None:
    """`make venv` builds the C walk (a missing compiler would otherwise leave the Python one in use
    silently, at about 100 times the cost per record)."""
    assert bf.NATIVE_FRAMING, "broker.logformat._framing is not built: pip install -e . with a C compiler"


def test_native_and_python_walks_agree_on_every_framing() -> None:
    """The C walk accepts and rejects exactly what the Python walk does, with the same message:
    valid batches, every truncation, flipped length bytes, wrong declared counts, odd buffers."""
    native = importlib.import_module("broker.logformat._framing")  # its absence fails the test above
    rng = random.Random(18)
    cases: list[tuple[bytes, int]] = [(b"", 0), (b"", 1), (b"\0" * 7, 1), (b"\0" * 8, 1), (b"\4\0\0\0\0\0\0\0", 1),
                                      (b"\xff\xff\xff\xff\xff\xff\xff\xff", 1), (b"\4\0\0\0\0\0\0\0", -1)]
    for _ in range(300):
        items = [(rng.randbytes(rng.randrange(0, 40)), rng.randbytes(rng.randrange(0, 5)),
                  bf.encode_props({"p": "v"}) if rng.random() < 0.3 else b"") for _ in range(rng.randrange(1, 8))]
        records, _ = bf.encode_records(items)
        n = len(items)
        cases += [(records, n), (records, n - 1), (records, n + 1), (records[: rng.randrange(len(records))], n)]
        broken = bytearray(records)
        broken[rng.randrange(len(broken))] = rng.randrange(256)
        cases.append((bytes(broken), n))
    big, _ = bf.encode_records([(b"x" * (1 << 20), b"", b"")] * 5)  # over 4 MiB: walked without the GIL
    cases += [(big, 5), (big[:-1], 5), (big, 4)]
    for records, count in cases:
        python = _outcome(bf.record_positions, records, count)
        assert _outcome(native.check, records, count) == python, (records[:32], count)
        assert _outcome(native.check, memoryview(records), count) == python  # any buffer, e.g. a view of a request
    assert sum(_outcome(bf.record_positions, r, c) == "ok" for r, c in cases) > 300  # the valid ones pass both
