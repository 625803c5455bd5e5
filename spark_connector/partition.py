"""A partition is one queue's offset range; ``read_partition`` is a pure function of it.

A ``QueueRange`` carries everything its read needs (broker addresses, topic, queue, offsets,
the two options that change what is read), so an executor reads it with no driver state: it
opens its own ``BrokerClient``, pulls ``[start, end)`` and yields Arrow batches. The broker
serves only records below its confirm offset, and ``end`` came from the broker's own
``max_offsets``, so nothing a failover could take back is ever read.

Data loss: a pull below the queue's earliest retained offset (retention), past its end (the
topic was deleted and re-created) or of a deleted topic fails. With ``failOnDataLoss=true``
that is an error; with ``false`` the lost offsets are skipped with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import InputPartition

from broker.client import BrokerClient, BrokerError, PullResult
from broker.invariant import invariant
from spark_connector.batches import pull_batch
from spark_connector.connect import connect
from spark_connector.schema import OFFSET_COLUMN

log = logging.getLogger("spark_connector")
PULL_MESSAGES_MAX = 16384  # rows per pull and per Arrow batch: ~16 MiB of 1 KiB messages
PULL_BYTES_MAX = 16 << 20  # a pull answers at most this many bytes of batches (the server default cap)
LOST_CODES = (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND)


class DataLossError(RuntimeError):
    """Offsets the query must read no longer exist (failOnDataLoss=true)."""


@dataclass(frozen=True, repr=False)
class QueueRange(InputPartition):
    """Queue offsets ``[start, end)`` of ``topic``/``queue_id`` (picklable, no connection)."""

    brokers: tuple[str, ...]
    topic: str
    queue_id: int
    start: int
    end: int
    include_headers: bool
    fail_on_data_loss: bool
    tls_ca_file: str | None = None
    token_file: str | None = None
    local_reads: bool = True  # on a node's host, read its segment files (broker/client/local_reads.py)

    def __repr__(self) -> str:
        return f"QueueRange({self.topic}/{self.queue_id} [{self.start}, {self.end}))"


def report_data_loss(message: str, fail_on_data_loss: bool) -> None:
    """Raise (failOnDataLoss=true) or log a warning (false)."""
    if fail_on_data_loss:
        raise DataLossError(message + ". Set the option failOnDataLoss=false to skip lost offsets with a warning.")
    log.warning("%s; skipped (failOnDataLoss=false)", message)


def read_partition(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    """Arrow batches of every committed record in the partition's range, in offset order
    (read_committed: aborted transactions' records are offset gaps; ``end`` is at most the LSO the
    driver saw, so nothing of an open transaction is in the range)."""
    if not isinstance(partition, QueueRange):  # Spark's placeholder when a batch plans no partition
        return
    p = partition
    with connect(p.brokers, p.tls_ca_file, p.token_file) as client:
        offset = p.start
        while offset < p.end:
            try:
                for result in _pulls(client, p, offset):
                    if result.next_offset <= offset:  # the queue now ends before the planned end
                        report_data_loss(f"{p.topic}/{p.queue_id} ends at {offset}, before the planned end {p.end}",
                                         p.fail_on_data_loss)
                        return
                    if len(result):
                        batch = pull_batch(result, len(result), p.topic, p.queue_id, offset, p.include_headers)
                        below = _rows_below(batch, p.end)  # the last pull of a stream may read past the end
                        if below:
                            yield batch if below == batch.num_rows else batch.slice(0, below)
                    offset = min(result.next_offset, p.end)
                    if offset >= p.end:
                        return
            except BrokerError as exc:
                if exc.code not in LOST_CODES:
                    raise
                resume = _resume_after_loss(client, p, offset, exc)
                invariant(resume > offset, f"no progress after data loss at {p.topic}/{p.queue_id}@{offset}")
                offset = resume


def _rows_below(batch: pa.RecordBatch, end: int) -> int:
    """How many of ``batch``'s rows (ascending offsets) have an offset below ``end``."""
    offsets = batch.column(OFFSET_COLUMN).to_numpy()
    return int(np.searchsorted(offsets, end, side="left"))


def _pulls(client: BrokerClient, p: QueueRange, offset: int) -> Iterator[PullResult]:
    """Pull results from ``offset``; a pipelined stream only when more than one pull is needed."""
    remaining = p.end - offset
    if remaining <= PULL_MESSAGES_MAX:
        while True:
            result = client.pull(p.topic, p.queue_id, offset, max_messages=remaining, max_bytes=PULL_BYTES_MAX,
                                 local_reads=p.local_reads)
            yield result
            if result.next_offset <= offset:
                return
            offset = result.next_offset
            remaining = p.end - offset
            if remaining <= 0:
                return
    # iter_pull keeps one request in flight; the last one may read up to one pull past ``end``
    yield from client.iter_pull(p.topic, p.queue_id, offset, max_messages=PULL_MESSAGES_MAX,
                                max_bytes=PULL_BYTES_MAX, stop_at_end=False, local_reads=p.local_reads)


def _resume_after_loss(client: BrokerClient, p: QueueRange, offset: int, exc: BrokerError) -> int:
    """Where to continue after a pull at ``offset`` failed with OUT_OF_RANGE/NOT_FOUND."""
    try:  # a pull at the planned end reports the queue's earliest retained offset
        earliest: int | None = client.pull(p.topic, p.queue_id, p.end, max_messages=1).min_offset
    except BrokerError as probe_exc:
        if probe_exc.code not in LOST_CODES:
            raise
        earliest = None  # the whole range is gone (or the queue was reset below it)
    if earliest is not None and earliest <= offset:
        raise exc  # not a loss below the earliest offset: report the broker's error as it is
    resume = p.end if earliest is None else min(earliest, p.end)
    report_data_loss(f"{p.topic}/{p.queue_id} offsets [{offset}, {resume}) are no longer available "
                     f"({exc.details})", p.fail_on_data_loss)
    return resume
