"""One pull result → one Arrow record batch, built column by column.

Columns that are the same for every row (topic, partition, timestampType) or follow from the
first offset (offset: queue offsets are contiguous) are built from numpy buffers without a
per-row Python step. ``value`` is assembled from ``PullResult.bodies()`` into one contiguous
buffer plus an offsets array (about 3x faster than ``pa.array(list_of_bytes)``). Only key,
timestamp and (optionally) headers need one pass over the messages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from broker.client import PulledMessage, PullResult
from spark_connector import schema as sc
from spark_connector.invariant import invariant

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
    columns = [
        pa.array(keys, pa.binary()),
        binary_array(bodies),
        repeated_string(topic, count),
        pa.array(np.full(count, queue_id, dtype=np.int32)),
        pa.array(np.arange(first_offset, first_offset + count, dtype=np.int64)),
        pa.array(np.asarray(times_ms, dtype=np.int64) * 1000, sc.TIMESTAMP_ARROW),
        pa.array(np.full(count, sc.TIMESTAMP_TYPE_LOG_APPEND, dtype=np.int32)),
    ]
    if include_headers:
        columns.append(pa.array(headers, sc.HEADERS_ARROW))
    return pa.RecordBatch.from_arrays(columns, schema=sc.arrow_schema(include_headers))
