"""The ``tidemark`` Python data source: a batch reader and a streaming reader.

Process model (PySpark 4.3): the data source and its readers are built, and pickled, in several
processes (driver, planner, executors). So constructors only check options, a reader opens its
broker connection lazily and never pickles it, and ``read()`` is ``read_partition(partition)``:
a pure function of the partition. The streaming reader's offset methods all run in one
long-lived planner process for the life of the query, which is where the Trigger.AvailableNow
target is kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from broker.client import BrokerClient
from spark_connector import offsets as of
from spark_connector.connect import connect
from spark_connector.options import OptionError, ReadOptions, parse_options
from spark_connector.partition import QueueRange, read_partition, report_data_loss
from spark_connector.schema import ddl, spark_schema
from spark_connector.topics import latest_offsets, resolve


class TidemarkDataSource(DataSource):
    """``spark.read/readStream.format("tidemark")``: rows shaped like Spark's Kafka source."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.read_options = parse_options(options)

    @classmethod
    def name(cls) -> str:
        return "tidemark"

    def schema(self) -> StructType:
        return spark_schema(self.read_options.include_headers)

    def reader(self, schema: StructType) -> DataSourceReader:
        _check_schema(schema, self.read_options.include_headers)
        return TidemarkBatchReader(self.read_options.for_batch())

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        _check_schema(schema, self.read_options.include_headers)
        return TidemarkStreamReader(self.read_options.for_streaming())


def _check_schema(schema: StructType, include_headers: bool) -> None:
    """A user-given schema (``.schema(...)``) must be the connector's own: rows cannot change shape."""
    if schema != spark_schema(include_headers):
        raise ValueError(f"tidemark: the source has a fixed schema, {ddl(include_headers)!r}; "
                         f"a user-specified schema must equal it (got {schema.simpleString()})")


def plan(start: of.Offsets, end: of.Offsets, opts: ReadOptions) -> list[InputPartition]:
    """One partition per queue with rows in ``[start, end)``; lost queues are reported.

    Deterministic in (start, end): Spark re-plans a batch from its checkpointed offsets after a
    restart and must get the same partitions.
    """
    out: list[InputPartition] = []
    for key in sorted(set(start) | set(end)):
        topic, queue_id = key
        if topic not in opts.topics:
            continue  # dropped from 'subscribe' since the checkpoint was written: not a loss
        first = start.get(key, 0)  # a queue the start does not know is new: read it from 0
        if key not in end:
            report_data_loss(f"{topic}/{queue_id} no longer exists (topic deleted?); offsets from {first} on are lost",
                             opts.fail_on_data_loss)
            continue
        last = end[key]
        if last < first:
            report_data_loss(f"{topic}/{queue_id} went back from offset {first} to {last} (topic re-created?); "
                             f"some records may have been missed", opts.fail_on_data_loss)
            continue
        if last > first:
            out.append(QueueRange(opts.brokers, topic, queue_id, first, last, opts.include_headers,
                                  opts.fail_on_data_loss, opts.tls_ca_file, opts.token_file, opts.local_reads))
    return out


class _BrokerUser:
    """A lazily opened BrokerClient that is never pickled (readers travel between processes)."""

    opts: ReadOptions
    _client: BrokerClient | None

    def client(self) -> BrokerClient:
        if self._client is None:
            self._client = connect(self.opts.brokers, self.opts.tls_ca_file, self.opts.token_file)
        return self._client

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        return state


class TidemarkBatchReader(_BrokerUser, DataSourceReader):
    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self._client = None

    def partitions(self) -> Sequence[InputPartition]:
        assert self.opts.starting is not None and self.opts.ending is not None  # for_batch() filled them
        with connect(self.opts.brokers, self.opts.tls_ca_file, self.opts.token_file) as client:
            latest = latest_offsets(client, self.opts.topics, missing_ok=False)
            start = resolve("startingOffsets", self.opts.starting, latest, client)
            end = resolve("endingOffsets", self.opts.ending, latest, client)
        for key in sorted(latest):
            if start[key] > end[key]:
                raise OptionError("startingOffsets", f"starting offset {start[key]} of {key[0]}/{key[1]} is after "
                                                     f"its ending offset {end[key]}")
        return plan(start, end, self.opts)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition)


class TidemarkStreamReader(_BrokerUser, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over queue offsets, with admission control (maxOffsetsPerTrigger) and
    Trigger.AvailableNow (a target fixed at the start of the run)."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        self._client = None
        self._target: of.Offsets | None = None

    def initialOffset(self) -> dict[str, Any]:
        assert self.opts.starting is not None  # for_streaming() filled it
        latest = latest_offsets(self.client(), self.opts.topics, missing_ok=False)
        return of.to_json(resolve("startingOffsets", self.opts.starting, latest, self.client()))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_offsets_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.opts.max_offsets_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = latest_offsets(self.client(), self.opts.topics, missing_ok=True)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        begin = of.from_json(start)
        latest = latest_offsets(self.client(), self.opts.topics, missing_ok=True)
        if self._target is not None:
            latest = of.cap(latest, begin, self._target)
        if isinstance(limit, ReadMaxRows):
            rows_max: int | None = limit.max_rows
        elif isinstance(limit, ReadAllAvailable):
            rows_max = None
        else:
            raise TypeError(f"tidemark: unsupported read limit {limit!r}")
        return of.to_json(of.admit(begin, latest, rows_max))

    def reportLatestOffset(self) -> dict[str, Any] | None:
        return of.to_json(latest_offsets(self.client(), self.opts.topics, missing_ok=True))

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        return plan(of.from_json(start), of.from_json(end), self.opts)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: the checkpoint is the consumer position (no broker-side offsets)."""

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
