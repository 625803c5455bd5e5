"""Batch and record framing: round trips and every validation that guards the log."""

from __future__ import annotations

import importlib
import random
import struct
from collections.abc import Callable

import crc32c
import pytest

from broker.invariant import CorruptionError
from broker.logformat import batch as bf
from broker.logformat import timer_props as tr


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


def _outcome(fn: Callable[..., object], *args: object) -> str:
    """"ok", or the message of the ValueError ``fn(*args)`` raised."""
    try:
        fn(*args)
    except ValueError as exc:
        return str(exc)
    return "ok"


def test_the_native_walk_is_built() -> None:
    """`make venv` builds the C walk (a missing compiler would otherwise leave the Python one in use
    silently, at about 100 times the cost per record)."""
    assert bf.NATIVE_FRAMING, "broker.logformat._framing is not built: pip install -e . with a C compiler"
    importlib.import_module("broker.logformat._plainwire")  # plain messages' twin (tests/test_plain_native.py)


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


def _scheduled_records(rng: random.Random, n: int, topic: str, queue_id: int, base_ms: int) -> bytes:
    items = []
    for _ in range(n):
        user = {"u": "v" * rng.randrange(3)} if rng.random() < 0.3 else None
        props = tr.scheduled_props(base_ms + rng.randrange(10_000), topic, queue_id, user)
        items.append((rng.randbytes(rng.randrange(20)), rng.randbytes(rng.randrange(4)), props))
    return bf.encode_records(items)[0]


def test_the_native_scheduled_check_accepts_only_what_the_python_check_accepts() -> None:
    """``scheduled_ok`` says True only of a delayed batch that ``check_scheduled`` accepts (its False
    hands the batch to the Python check for the verdict and message), and True of valid batches."""
    native = importlib.import_module("broker.logformat._framing")
    rng = random.Random(33)
    now_ms, max_delay_ms = 1_700_000_000_000, 20_000
    name = bf.encode_props({tr.DELIVER_AT: ""})[:-2]  # u16 length + the property's name
    fast = valid = 0
    for i in range(1500):
        topic, queue_id = rng.choice([("t", 0), ("orders", 3), ("t", 12)])
        n = rng.randrange(1, 6)
        records = bytearray(_scheduled_records(rng, n, topic, queue_id, now_ms))
        if i % 3:  # damage one byte, or aim at another target or an earlier deadline
            if rng.random() < 0.6:
                records[rng.randrange(len(records))] = rng.choice([0, 0x30, 0x39, 0x3A, 0xFF, rng.randrange(256)])
            else:
                topic, queue_id = rng.choice([("t", 1), ("u", 0), ("orders", 30)])
        data = bytes(records)
        try:
            bf.record_positions(data, n)
        except ValueError:
            continue  # framing is checked before: the native check assumes it
        python = _outcome(tr.check_scheduled, data, bf.record_positions(data, n), topic, queue_id, now_ms, max_delay_ms)
        said = native.scheduled_ok(data, name, tr.target_props(topic, queue_id), now_ms + max_delay_ms)
        assert not said or python == "ok", (data[:40], python)
        fast += said
        valid += python == "ok"
        assert python == "ok" or _outcome(tr.check_scheduled_batch, data, n, topic, queue_id, now_ms, max_delay_ms) == python
    assert fast == valid > 500  # every valid batch takes the fast path


def _log_batch(records: bytes, count: int) -> tuple[memoryview, bf.BatchHeader]:
    head = bf.build_header(batch_bytes=bf.HEADER_BYTES + 7 + len(records), record_count=count, base_offset=4096,
                           base_queue_offset=0, store_time_ms=1, producer_id=0, base_sequence=-1, epoch=1, queue_id=0,
                           topic_raw=b"__timer", body_crc=crc32c.crc32c(records))
    data = memoryview(head + records)
    return data, bf.decode_header(data)


def test_native_and_python_leading_ints_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deliver times of scheduled batches and timer offsets of deliveries and fired events, read by
    the C walk, equal the Python walk's; whatever the C walk declines (None) the Python one decides."""
    rng = random.Random(7)
    cases: list[tuple[memoryview, bf.BatchHeader, str]] = []
    for i in range(600):
        n = rng.randrange(1, 6)
        kind = rng.choice(["scheduled", "delivery", "fired"])
        if kind == "scheduled":
            records = _scheduled_records(rng, n, "t", 0, 1_700_000_000_000)
        elif kind == "delivery":
            records = bf.encode_records([(b"b", b"", tr.delivery_props(rng.randrange(1 << 40), tr.scheduled_props(5, "t", 0, None)))
                                         for _ in range(n)])[0]
        else:
            records = bf.encode_records([(b"", b"", tr.event_props(tr.FIRED, rng.randrange(1 << 40), 5, tr.target_props("t", 0)))
                                         for _ in range(n)])[0]
        if i % 2:
            damaged = bytearray(records)
            damaged[rng.randrange(len(damaged))] = rng.choice([0x20, 0x2D, 0x5F, 0x39, rng.randrange(256)])
            records = bytes(damaged)
        cases.append((*_log_batch(records, n), kind))

    def read(batch: memoryview, header: bf.BatchHeader, kind: str) -> object:
        try:
            if kind == "scheduled":
                return tr.deliver_times(batch, header)
            return (tr.leading_offsets(batch, header, skip_first=kind == "fired"),)
        except (ValueError, struct.error) as exc:
            return type(exc).__name__

    native = importlib.import_module("broker.logformat._framing")
    for batch, header, kind in cases[::2]:  # undamaged: the C walk reads every one itself
        name = bf.encode_props({tr.DELIVER_AT if kind == "scheduled" else tr.TIMER_OFFSET: ""})[:-2]
        assert native.leading_ints(batch, header.records_at, header.batch_bytes, name, int(kind == "fired"),
                                   header.record_count) is not None
    native_results = [read(*c) for c in cases]
    monkeypatch.setattr(bf, "native", None)
    python_results = [read(*c) for c in cases]
    assert native_results == python_results
    assert sum(isinstance(r, tuple) for r in python_results) > 300


def test_native_and_python_encoders_agree() -> None:
    """The C encoder makes the bytes and positions the Python one makes; whatever it does not take
    (other sequences and buffers, a key or properties too long for their u16) goes to the Python
    one, which encodes it or raises as it always did."""
    native = importlib.import_module("broker.logformat._framing")
    rng = random.Random(18)
    for n in (0, 1, 2, 7, 1000):
        items = [(rng.randbytes(rng.choice((0, 1, 5, 1024, 70_000))), rng.randbytes(rng.choice((0, 3, 65_535))),
                  rng.randbytes(rng.choice((0, 9)))) for _ in range(n)]
        expected = bf._encode_records_py(items)
        assert native.encode_records(items) == expected
        assert native.encode_records(tuple(items)) == expected
        assert bf.encode_records(iter(items)) == expected  # a generator is listed first
        assert bf.record_positions(expected[0], n) == expected[1]
    left_to_python = [
        iter([(b"b", b"", b"")]),                    # not a list or tuple
        [(bytearray(b"b"), b"", b"")],              # not exact bytes
        [(b"b", b"", b"", b"")],                    # not a triple
        [[b"b", b"", b""]],                         # not a tuple
        [(b"b", b"k" * 65_536, b"")],               # key too long for u16
        [(b"b", b"", b"p" * 65_536)],               # props too long for u16
    ]
    for items in left_to_python:
        assert native.encode_records(items) is None
    assert bf.encode_records([(bytearray(b"b"), b"k", b"")]) == bf._encode_records_py([(b"b", b"k", b"")])
    with pytest.raises(struct.error):
        bf.encode_records([(b"b", b"k" * 65_536, b"")])


def test_native_and_python_content_checks_agree() -> None:
    """The C contents check (UTF-8 keys, names and values; properties filling their length; no
    ``__`` name past the leading ones) accepts and rejects exactly what the Python one does, with
    the same message, on valid records and on every byte of them flipped."""
    native = importlib.import_module("broker.logformat._framing")
    rng = random.Random(35)
    names = ["a", "é", "__x", "_y", "", "日本", "\U0001f600"]
    cases: list[tuple[bytes, int]] = []
    for _ in range(200):
        items = []
        for _ in range(rng.randrange(1, 5)):
            props = {rng.choice(names): rng.choice(names) for _ in range(rng.randrange(0, 4))}
            items.append((rng.randbytes(rng.randrange(0, 8)), rng.choice(names).encode(), bf.encode_props(props)))
        records, _ = bf.encode_records(items)
        cases += [(records, rng.randrange(0, 3))]
        for _ in range(4):  # bytes of keys and properties replaced, framing kept
            broken = bytearray(records)
            broken[rng.randrange(len(broken))] = rng.choice([0x80, 0xC0, 0xED, 0xF4, 0xFF, ord("_"), 0, 1, 2])
            try:
                bf.check_framing(bytes(broken), len(items))
            except ValueError:
                continue
            cases.append((bytes(broken), rng.randrange(0, 3)))
    for bad_utf8 in (b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe0\x80\x80", b"\xf0\x80\x80\x80", b"\xc3"):
        records, _ = bf.encode_records([(b"", bad_utf8, b"")])
        cases.append((records, 0))
    for records, leading in cases:
        python = _outcome(bf._check_record_contents_py, records, leading)
        assert _outcome(native.check_contents, records, leading) == python, (records[:40], leading)
    verdicts = {_outcome(bf._check_record_contents_py, r, lead).split(": ", 1)[-1][:20] for r, lead in cases}
    assert {"ok", "its key is not UTF-8", "property 0 has a res", "property 0 runs past"} <= verdicts, verdicts
