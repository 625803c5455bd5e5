"""The connector's batch decoder (spark_connector/decode.py): Spark-free, on synthetic and real batches.

Against a real daemon the decoder is checked against an independent reference: the same rows
built from the client's ``PulledMessage`` objects.
"""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Callable, Sequence

import crc32c
import numpy as np
import pyarrow as pa
import pytest

from broker.client import BrokerClient, Message, PullResult
from broker.logformat import batch as bf
from broker.logformat import scan
from spark_connector import decode as dc
from spark_connector import schema as sc
from spark_connector.batches import pull_batch, raw_batch
from spark_connector.partition import QueueRange, read_partition
from tests.procs import DaemonProcess

pytestmark = pytest.mark.xdist_group("spark")  # make test's workers: one Spark JVM at a time

Item = tuple[bytes, bytes, bytes]  # (body, key, encoded props)


def make_batch(items: Sequence[Item], *, base_queue_offset: int, topic: str = "t", queue_id: int = 0,
               store_time_ms: int = 1_700_000_000_000) -> bytes:
    records, _ = bf.encode_records(items)
    head = bf.build_header(batch_bytes=bf.HEADER_BYTES + len(topic) + len(records), record_count=len(items),
                           base_offset=0, base_queue_offset=base_queue_offset, store_time_ms=store_time_ms,
                           producer_id=0, base_sequence=-1, epoch=0, queue_id=queue_id, topic_raw=topic.encode(),
                           body_crc=crc32c.crc32c(records))
    return head + records


def items(count: int, *, uniform: bool, start: int = 0) -> list[Item]:
    out: list[Item] = []
    for i in range(start, start + count):
        body = b"%08d" % i + (b"" if uniform else b"x" * (i % 5))
        key = b"" if uniform or i % 3 == 0 else b"k%d" % i
        props = b"" if uniform or i % 4 else bf.encode_props({"i": str(i)})
        out.append((body, key, props))
    return out


def test_constants_match_the_broker_format() -> None:
    """The decoder keeps no copy of the framing: batches go through broker.logformat.scan."""

    assert dc.scan_bytes is scan.scan_bytes and dc.RECORD_HEAD_BYTES == bf.RECORD_HEAD_BYTES
    assert not any(hasattr(dc, name) for name in ("HEADER", "HEADER_BYTES", "MAGIC", "VERSION"))


@pytest.fixture(params=["c-gather", "arrow-take"])
def gather_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each decode test runs on both paths: the C gather and its twin, Arrow's take (no C module)."""
    if request.param == "arrow-take":
        monkeypatch.setattr(dc, "native_gather", None)
    else:
        assert dc.native_gather is not None, "the C module is not built"
    return str(request.param)


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize(("skip", "count"), [(0, 30), (4, 26), (7, 10), (0, 1), (11, 1), (11, 19)])
def test_decode_selects_the_requested_records(uniform: bool, skip: int, count: int, gather_path: str) -> None:
    """Keys (null when empty), values, props and times of records skip..skip+count, across batches and blobs."""
    everything = items(30, uniform=uniform)
    b1 = make_batch(everything[:12], base_queue_offset=100, store_time_ms=5)
    b2 = make_batch(everything[12:20], base_queue_offset=112, store_time_ms=6)
    b3 = make_batch(everything[20:], base_queue_offset=120, store_time_ms=7)
    cols = dc.decode([b1 + b2, b3], skip, count, topic="t", queue_id=0, first_offset=100 + skip, with_props=True)
    want = everything[skip:skip + count]
    assert cols.count == count
    assert cols.values.to_pylist() == [body for body, _, _ in want]
    assert cols.keys.to_pylist() == [key or None for _, key, _ in want]
    assert cols.props is not None and cols.props.to_pylist() == [props for _, _, props in want]
    times = [5] * 12 + [6] * 8 + [7] * 10
    assert cols.times_ms.tolist() == times[skip:skip + count]
    for column in (cols.values, cols.keys, cols.props):
        column.validate(full=True)


def test_raw_batch_builds_the_documented_rows() -> None:
    """raw_batch() builds the documented row shape (headers included) from synthetic batches."""
    everything = items(9, uniform=False)
    blob = make_batch(everything, base_queue_offset=0, topic="orders", queue_id=2, store_time_ms=42)
    batch = raw_batch([blob], 2, 6, "orders", 2, 2, True)
    assert batch.schema.equals(sc.arrow_schema(True))
    rows = batch.to_pylist()
    assert [r["offset"] for r in rows] == list(range(2, 8)) and {r["partition"] for r in rows} == {2}
    assert {r["topic"] for r in rows} == {"orders"} and {r["timestampType"] for r in rows} == {1}
    assert [r["headers"] for r in rows] == [
        [{"key": "i", "value": b"%d" % i}] if i % 4 == 0 else None for i in range(2, 8)]


@pytest.mark.parametrize("damage", ["body", "header", "topic", "overlap", "short", "skip"])
def test_decode_refuses_bad_batches(damage: str, gather_path: str) -> None:
    """Checksum mismatches, foreign topics, overlapping offsets and missing records are errors, never rows."""
    good = make_batch(items(5, uniform=False), base_queue_offset=0)
    blob, first, count, topic = good, 0, 5, "t"
    if damage == "body":
        blob = good[:-1] + bytes([good[-1] ^ 1])
    elif damage == "header":
        blob = good[:30] + bytes([good[30] ^ 1]) + good[31:]
    elif damage == "topic":
        topic = "u"
    elif damage == "overlap":  # a batch that starts before the one before it ended
        blob = good + make_batch(items(2, uniform=True), base_queue_offset=3)
        count = 7
    elif damage == "short":
        count = 6
    elif damage == "skip":  # skip_first reaches past the first batch
        blob = good + make_batch(items(2, uniform=True), base_queue_offset=5)
        first, count = 5, 1
    with pytest.raises(dc.BatchFormatError):
        dc.decode([blob], first, count, topic=topic, queue_id=0, first_offset=first, with_props=False)


def test_a_gap_between_batches_gives_each_record_its_offset(gather_path: str) -> None:
    """A read_committed pull leaves aborted transactions' batches out: the next batch starts later,
    and every row carries its own offset (the offset column is not first offset + row number)."""
    blob = make_batch(items(3, uniform=True), base_queue_offset=10) + make_batch(items(2, uniform=True, start=3),
                                                                                 base_queue_offset=20)
    cols = dc.decode([blob], 1, 4, topic="t", queue_id=0, first_offset=11, with_props=False)
    assert cols.offsets.tolist() == [11, 12, 20, 21]
    assert cols.values.to_pylist() == [b"%08d" % i for i in (1, 2, 3, 4)]
    gap_first = dc.decode([make_batch(items(2, uniform=True), base_queue_offset=30)], 0, 2, topic="t", queue_id=0,
                          first_offset=25, with_props=False)
    assert gap_first.offsets.tolist() == [30, 31], "a pull whose first batches were aborted starts later"


def test_decode_checks_framing_inside_a_batch(gather_path: str) -> None:
    """A record length that overruns its batch (with a valid CRC) is refused."""
    records = bf.encode_record(b"abc") + struct.pack("<IHH", 999, 0, 0) + b"zz"
    head = bf.build_header(batch_bytes=bf.HEADER_BYTES + 1 + len(records), record_count=2, base_offset=0,
                           base_queue_offset=0, store_time_ms=1, producer_id=0, base_sequence=-1, epoch=0,
                           queue_id=0, topic_raw=b"t", body_crc=crc32c.crc32c(records))
    with pytest.raises(dc.BatchFormatError, match="do not fill"):
        dc.decode([head + records], 0, 2, topic="t", queue_id=0, first_offset=0, with_props=False)


def test_the_c_gather_and_arrow_take_decode_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random records (empty and long keys, props, bodies from 0 bytes to 3 KiB) over random blob
    splits and skips: both paths give the same columns, nulls and all."""
    rng = random.Random(18)
    for _ in range(60):
        count = rng.randint(1, 400)
        everything = [(rng.randbytes(rng.choice([0, 1, 7, 1024, rng.randint(0, 3000)])),
                       rng.randbytes(rng.choice([0, 0, 3, 300])),
                       bf.encode_props({"p": "v" * rng.randint(0, 40)}) if rng.random() < 0.3 else b"")
                      for _ in range(count)]
        cuts = sorted(rng.sample(range(1, count), min(count - 1, rng.randint(0, 6))))
        batches = [make_batch(everything[a:b], base_queue_offset=a, store_time_ms=a)
                   for a, b in zip([0, *cuts], [*cuts, count], strict=True)]
        blobs: list[bytes] = []
        for b in batches:  # adjacent batches of the queue share a blob, sometimes
            if blobs and rng.random() < 0.5:
                blobs[-1] += b
            else:
                blobs.append(b)
        skip = rng.randint(0, len(everything[:cuts[0] if cuts else count]) - 1)
        take = rng.randint(1, count - skip)
        args = dict(topic="t", queue_id=0, first_offset=skip, with_props=True)
        gathered = dc.decode(blobs, skip, take, **args)  # type: ignore[arg-type]
        with monkeypatch.context() as m:
            m.setattr(dc, "native_gather", None)
            taken = dc.decode(blobs, skip, take, **args)  # type: ignore[arg-type]
        want = everything[skip:skip + take]
        assert gathered.values.to_pylist() == taken.values.to_pylist() == [body for body, _, _ in want]
        assert gathered.keys.to_pylist() == taken.keys.to_pylist() == [key or None for _, key, _ in want]
        assert gathered.props is not None and taken.props is not None
        assert gathered.props.to_pylist() == taken.props.to_pylist() == [props for _, _, props in want]
        assert gathered.times_ms.tolist() == taken.times_ms.tolist()
        for column in (gathered.values, gathered.keys, gathered.props):
            column.validate(full=True)


def test_a_pull_of_16_mib_decodes_alike_on_both_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full pull (16,384 x 1 KiB, keys on every third record) in 17 blobs and in one 16 MiB blob,
    from which the C gather copies with other threads let run."""
    rng = random.Random(7)
    rows = 16_384
    everything = [(rng.randbytes(1024), b"k%d" % i if i % 3 == 0 else b"", b"") for i in range(rows)]
    step = -(-rows // 17)
    blobs = [make_batch(everything[a:a + step], base_queue_offset=a) for a in range(0, rows, step)]
    gathered = dc.decode(blobs, 0, rows, topic="t", queue_id=0, first_offset=0, with_props=False)
    monkeypatch.setattr(dc, "native_gather", None)
    taken = dc.decode(blobs, 0, rows, topic="t", queue_id=0, first_offset=0, with_props=False)
    assert gathered.values.nbytes > 16 << 20 and len(blobs) == 17
    assert gathered.values.equals(taken.values) and gathered.keys.equals(taken.keys)
    assert gathered.values.to_pylist() == [body for body, _, _ in everything]
    assert gathered.keys.null_count == rows - len(range(0, rows, 3))
    whole = dc.decode([b"".join(blobs)], 0, rows, topic="t", queue_id=0, first_offset=0, with_props=False)
    monkeypatch.undo()
    one_blob = dc.decode([b"".join(blobs)], 0, rows, topic="t", queue_id=0, first_offset=0, with_props=False)
    assert one_blob.values.equals(whole.values) and one_blob.keys.equals(whole.keys)  # a 16 MiB blob: copied without the GIL
    assert one_blob.values.equals(gathered.values)


@pytest.mark.parametrize(("case", "message"), [
    ("position past the bytes", "outside the pulled bytes"),
    ("negative position", "outside the pulled bytes"),
    ("length past the bytes", "ends past the pulled bytes"),
    ("key longer than the record", "does not hold its key"),
    ("output too small", "do not fit in the output"),
    ("bad piece", "piece must be 0, 1 or 2"),
    ("positions cut", "whole int64 values"),
    ("out_at past the output", "out_at outside the output"),
])
def test_the_c_gather_refuses_what_does_not_fit(case: str, message: str) -> None:
    """The C gather trusts no position, length or size: each misfit is a ValueError, never a read or
    write outside its buffers."""
    assert dc.native_gather is not None
    rec = bf.encode_record(b"body", b"key")  # 8-byte head, 3-byte key, 4-byte body
    blob = b"\0" * 5 + rec + rec
    positions = np.array([5, 5 + len(rec)], dtype=np.int64)
    out, piece = bytearray(16), dc.BODY
    if case == "position past the bytes":
        positions[1] = len(blob) - 7
    elif case == "negative position":
        positions[0] = -1
    elif case == "length past the bytes":
        blob = blob[:-1]
    elif case == "key longer than the record":
        blob = blob[:5] + struct.pack("<IHH", 4 + 7, 9, 0) + blob[13:]
    elif case == "output too small":
        out = bytearray(7)
    elif case == "bad piece":
        piece = 3
    at, view = 0, positions.data
    if case == "positions cut":
        view = view.cast("B")[:15]
    elif case == "out_at past the output":
        at = 17
    with pytest.raises(ValueError, match=message):
        dc.native_gather(blob, view, piece, out, at)
    assert dc.native_gather(b"\0" * 5 + rec + rec, np.array([5, 5 + len(rec)], dtype=np.int64).data, dc.BODY,
                            bytearray(8), 0) == 8  # the same call on sound input


def reference_batch(result: PullResult, count: int, topic: str, queue_id: int, first_offset: int) -> pa.RecordBatch:
    """The expected rows, from PulledMessage objects (public client API), with headers."""
    msgs = list(result)[:count]
    assert [m.queue_offset for m in msgs] == list(range(first_offset, first_offset + count))
    columns = [
        pa.array([m.key.encode() if m.key is not None else None for m in msgs], pa.binary()),
        pa.array([m.body for m in msgs], pa.binary()),
        pa.array([topic] * count, pa.string()),
        pa.array([queue_id] * count, pa.int32()),
        pa.array(range(first_offset, first_offset + count), pa.int64()),
        pa.array([m.store_time_ms * 1000 for m in msgs], sc.TIMESTAMP_ARROW),
        pa.array([1] * count, pa.int32()),
        pa.array([[(k, v.encode()) for k, v in m.properties.items()] or None for m in msgs], sc.HEADERS_ARROW),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=sc.arrow_schema(True))


def test_decoded_pulls_equal_the_message_objects(spawn: Callable[..., DaemonProcess]) -> None:
    """Against a real daemon, decoded batches and read_partition equal the rows built from PulledMessage objects."""
    d = spawn()
    with BrokerClient(d.address) as c:
        c.create_topic("mixed", queues=2)
        for n in range(6):
            c.send("mixed", [Message(body=os.urandom(50 + i % 7), key=f"k{i}" if i % 2 else None,
                                     properties={"n": str(n), "é": "ü"} if i % 3 == 0 else None) for i in range(700)])
        highs = c.list_topics()["mixed"]["max_offsets"]
        expected = []
        for q, high in enumerate(highs):
            res = c.pull("mixed", q, 3, max_messages=high)
            assert pull_batch(res, len(res) - 5, "mixed", q, 3, True).equals(reference_batch(res, len(res) - 5, "mixed", q, 3))
            whole = c.pull("mixed", q, 1, max_messages=high)
            assert len(whole) == high - 1
            expected.append(pa.Table.from_batches([reference_batch(whole, high - 1, "mixed", q, 1)]))
    got = [pa.Table.from_batches(list(read_partition(QueueRange((d.address,), "mixed", q, 1, high, True, True))))
           for q, high in enumerate(highs)]
    assert all(a.equals(b) for a, b in zip(got, expected, strict=True))
