"""One pull result → one Arrow record batch, built column by column.

Two ways to get key, value and timestamp, with the same result:

- ``raw_batch``: from the pulled log batches themselves (``decode.py``: no Python object per
  record, about 1 µs per row). It needs ``PullResult.raw_batches()``, a client helper that
  ``broker/client.py`` does not offer yet; ``partition.py`` uses it as soon as it exists.
- ``record_batch``: through the public ``PullResult`` API: one ``PulledMessage`` per row for
  key and timestamp, ``bodies()`` for the values (about 4-6 µs per row).

Columns that are the same for every row (topic, partition, timestampType) or follow from the
first offset (offset: queue offsets are contiguous) are built from numpy buffers in both.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from broker.client import PulledMessage, PullResult
from spark_connector import schema as sc
from spark_connector.decode import Columns, decode
from spark_connector.invariant import invariant

_U16 = struct.Struct("<H")

BINARY_BYTES_MAX = (1 << 31) - 1  # int32 offsets of Arrow's binary type


def binary_array(values: Sequence[bytes]) -> pa.Array:
    """A non-null ``binary`` array of ``values``: one join and one offsets array."""
    count = len(values)
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, values), dtype=np.int64, count=count), out=offsets[1:])
    invariant(int(offsets[-1]) <= BINARY_BYTES_MAX, f"{int(offsets[-1])} bytes do not fit one binary array")
    data = b"".join(values)
    return pa.Array.from_buffers(pa.binary(), count, [None, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data)])


def repeated_string(text: str, count: int) -> pa.Array:
    """A ``string`` array holding ``text`` ``count`` times, without a Python list."""
    raw = text.encode()
    offsets = np.arange(0, (count + 1) * len(raw), len(raw), dtype=np.int32) if raw else np.zeros(count + 1, np.int32)
    return pa.Array.from_buffers(pa.string(), count, [None, pa.py_buffer(offsets), pa.py_buffer(raw * count)])


def record_batch(result: PullResult, count: int, topic: str, queue_id: int, first_offset: int,
                 include_headers: bool) -> pa.RecordBatch:
    """The first ``count`` messages of ``result`` (queue offsets ``first_offset``...) as a batch
    with exactly ``schema.arrow_schema(include_headers)``."""
    invariant(0 < count <= len(result), f"count {count} outside 1..{len(result)}")
    messages: Sequence[PulledMessage] = result if count == len(result) else result[:count]
    keys: list[bytes | None] = []
    times_ms: list[int] = []
    add_key = keys.append
    add_time = times_ms.append
    headers: list[list[tuple[str, bytes]] | None] = []
    first = True
    for m in messages:
        if first:
            invariant(m.queue_offset == first_offset and m.topic == topic and m.queue_id == queue_id,
                      f"pull returned {m.topic}/{m.queue_id}@{m.queue_offset}, expected {topic}/{queue_id}@{first_offset}")
            first = False
        key = m.key
        add_key(key.encode() if key is not None else None)
        add_time(m.store_time_ms)
        if include_headers:
            props = m.properties
            headers.append([(k, v.encode()) for k, v in props.items()] if props else None)
    bodies = result.bodies()
    if count < len(bodies):
        bodies = bodies[:count]
    return _assemble(pa.array(keys, pa.binary()), binary_array(bodies), np.asarray(times_ms, dtype=np.int64),
                     pa.array(headers, sc.HEADERS_ARROW) if include_headers else None, topic, queue_id, first_offset)


def raw_batch(blobs: Sequence[bytes], skip_first: int, count: int, topic: str, queue_id: int, first_offset: int,
              include_headers: bool) -> pa.RecordBatch:
    """The same batch as ``record_batch``, decoded from the pulled log batches (``decode.py``)."""
    cols: Columns = decode(blobs, skip_first, count, topic=topic, queue_id=queue_id, first_offset=first_offset,
                           with_props=include_headers)
    headers = None
    if cols.props is not None:
        headers = pa.array([_headers(raw) if raw else None for raw in cols.props.to_pylist()], sc.HEADERS_ARROW)
    return _assemble(cols.keys, cols.values, cols.times_ms, headers, topic, queue_id, first_offset)


def _headers(raw: bytes) -> list[tuple[str, bytes]]:
    """Encoded properties (``u16 len, name, u16 len, value`` repeated) as header tuples."""
    out: list[tuple[str, bytes]] = []
    pos = 0
    while pos < len(raw):
        (n,) = _U16.unpack_from(raw, pos)
        name = raw[pos + 2 : pos + 2 + n].decode()
        pos += 2 + n
        (v,) = _U16.unpack_from(raw, pos)
        out.append((name, raw[pos + 2 : pos + 2 + v]))
        pos += 2 + v
    invariant(pos == len(raw), "properties overrun their record")
    return out


def _assemble(keys: pa.Array, values: pa.Array, times_ms: np.ndarray, headers: pa.Array | None, topic: str,
              queue_id: int, first_offset: int) -> pa.RecordBatch:
    count = len(values)
    invariant(len(keys) == count and len(times_ms) == count, "columns of different lengths")
    columns = [
        keys,
        values,
        repeated_string(topic, count),
        pa.array(np.full(count, queue_id, dtype=np.int32)),
        pa.array(np.arange(first_offset, first_offset + count, dtype=np.int64)),
        pa.array(times_ms * 1000, sc.TIMESTAMP_ARROW),
        pa.array(np.full(count, sc.TIMESTAMP_TYPE_LOG_APPEND, dtype=np.int32)),
    ]
    if headers is not None:
        columns.append(headers)
    return pa.RecordBatch.from_arrays(columns, schema=sc.arrow_schema(headers is not None))
