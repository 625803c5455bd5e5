"""The connector's batch decoder (spark_connector/decode.py): Spark-free, on synthetic and real batches.

Against a real daemon the decoder is checked against an independent reference: the same rows
built from the client's ``PulledMessage`` objects.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence

import crc32c
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


@pytest.mark.parametrize("uniform", [True, False])
@pytest.mark.parametrize(("skip", "count"), [(0, 30), (4, 26), (7, 10), (0, 1), (11, 1), (11, 19)])
def test_decode_selects_the_requested_records(uniform: bool, skip: int, count: int) -> None:
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


@pytest.mark.parametrize("damage", ["body", "header", "topic", "gap", "short", "skip"])
def test_decode_refuses_bad_batches(damage: str) -> None:
    """Checksum mismatches, foreign topics, offset gaps and missing records are errors, never rows."""
    good = make_batch(items(5, uniform=False), base_queue_offset=0)
    blob, first, count, topic = good, 0, 5, "t"
    if damage == "body":
        blob = good[:-1] + bytes([good[-1] ^ 1])
    elif damage == "header":
        blob = good[:30] + bytes([good[30] ^ 1]) + good[31:]
    elif damage == "topic":
        topic = "u"
    elif damage == "gap":
        blob = good + make_batch(items(2, uniform=True), base_queue_offset=9)
        count = 7
    elif damage == "short":
        count = 6
    elif damage == "skip":  # skip_first reaches past the first batch
        blob = good + make_batch(items(2, uniform=True), base_queue_offset=5)
        first, count = 5, 1
    with pytest.raises(dc.BatchFormatError):
        dc.decode([blob], first, count, topic=topic, queue_id=0, first_offset=first, with_props=False)


def test_decode_checks_framing_inside_a_batch() -> None:
    """A record length that overruns its batch (with a valid CRC) is refused."""
    records = bf.encode_record(b"abc") + struct.pack("<IHH", 999, 0, 0) + b"zz"
    head = bf.build_header(batch_bytes=bf.HEADER_BYTES + 1 + len(records), record_count=2, base_offset=0,
                           base_queue_offset=0, store_time_ms=1, producer_id=0, base_sequence=-1, epoch=0,
                           queue_id=0, topic_raw=b"t", body_crc=crc32c.crc32c(records))
    with pytest.raises(dc.BatchFormatError, match="do not fill"):
        dc.decode([head + records], 0, 2, topic="t", queue_id=0, first_offset=0, with_props=False)


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
