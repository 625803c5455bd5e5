"""Spark-free tests of the connector: options, offsets, admission, planning, Arrow batches, pickling.

No JVM starts here; the tests that need data run ``read_partition`` (what an executor runs)
against a real daemon.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from pyspark.serializers import CloudPickleSerializer
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from broker.client import BrokerClient, BrokerError, Message
from spark_connector import (
    DataLossError,
    OptionError,
    QueueRange,
    TidemarkDataSource,
    TidemarkStreamReader,
    parse_options,
    read_partition,
)
from spark_connector import offsets as of
from spark_connector import schema as sc
from spark_connector.batches import repeated_string
from spark_connector.partition import PULL_MESSAGES_MAX
from spark_connector.source import plan
from tests.procs import DaemonProcess
from tests.waits import wait_until

pytestmark = pytest.mark.xdist_group("spark")  # make test's workers: one Spark JVM at a time

BASE = {"broker": "127.0.0.1:7600", "subscribe": "orders"}


def opts(**extra: str) -> dict[str, str]:
    return {**BASE, **extra}


def option_error(call: Callable[[], object]) -> OptionError:
    """The OptionError ``call`` raises (failing the test when it raises none)."""
    with pytest.raises(OptionError) as info:
        call()
    return info.value


# -- options --------------------------------------------------------------------------------------
def test_options_defaults_follow_the_kafka_source() -> None:
    """Batch starts at earliest and ends at latest; streaming starts at latest; failOnDataLoss is on."""
    o = parse_options(opts())
    assert o.brokers == ("127.0.0.1:7600",) and o.topics == ("orders",)
    assert o.fail_on_data_loss and not o.include_headers and o.max_offsets_per_trigger is None
    batch = o.for_batch()
    assert batch.starting is not None and batch.starting.kind == "earliest"
    assert batch.ending is not None and batch.ending.kind == "latest"
    stream = o.for_streaming()
    assert stream.starting is not None and stream.starting.kind == "latest"


def test_options_are_case_insensitive_and_lists_are_split() -> None:
    """Spark lower-cases option keys; broker and subscribe take comma-separated lists (deduplicated)."""
    o = parse_options({"BROKER": "a:1, b:2,a:1", "Subscribe": "x, __metadata ,x", "includeheaders": "TRUE",
                       "maxoffsetspertrigger": "7", "failondataloss": "false"})
    assert o.brokers == ("a:1", "b:2") and o.topics == ("x", "__metadata")
    assert o.include_headers and not o.fail_on_data_loss and o.max_offsets_per_trigger == 7
    assert parse_options({"broker": "a:1", "subscribe": "__timer"}).topics == ("__timer",)  # the timer event log


@pytest.mark.parametrize(("options", "option", "fragment"), [
    ({"subscribe": "t"}, "broker", "required"),
    ({"broker": "h:1"}, "subscribe", "required"),
    (opts(subscribePattern="o.*"), "subscribePattern", "Kafka source option"),
    (opts(**{"kafka.bootstrap.servers": "h:1"}), "kafka.bootstrap.servers", "use 'broker'"),
    (opts(colour="blue"), "colour", "unknown option"),
    (opts(broker="localhost"), "broker", "host:port"),
    (opts(broker="h:99999"), "broker", "host:port"),
    (opts(broker="h:1,,h:2"), "broker", "empty address"),
    (opts(subscribe="a b"), "subscribe", "not a valid topic name"),
    (opts(failOnDataLoss="yes"), "failOnDataLoss", "true or false"),
    (opts(includeHeaders="1"), "includeHeaders", "true or false"),
    (opts(maxOffsetsPerTrigger="0"), "maxOffsetsPerTrigger", "positive integer"),
    (opts(maxOffsetsPerTrigger="lots"), "maxOffsetsPerTrigger", "positive integer"),
    (opts(startingOffsets="newest"), "startingOffsets", "'earliest', 'latest' or JSON"),
    (opts(startingOffsets="[1]"), "startingOffsets", "JSON must be an object"),
    (opts(startingOffsets='{"other": {"0": 1}}'), "startingOffsets", "not in 'subscribe'"),
    (opts(startingOffsets='{"orders": 5}'), "startingOffsets", "must map queue ids"),
    (opts(startingOffsets='{"orders": {"q": 5}}'), "startingOffsets", "not a non-negative integer"),
    (opts(endingOffsets='{"orders": {"0": -3}}'), "endingOffsets", "integer >= -2"),
    (opts(endingOffsets='{"orders": {"0": 1.5}}'), "endingOffsets", "integer >= -2"),
])
def test_malformed_options_name_the_option(options: dict[str, str], option: str, fragment: str) -> None:
    """Every unknown or malformed option is refused with an error naming it."""
    error = option_error(lambda: parse_options(options))
    assert error.option == option and f"'{option}'" in str(error) and fragment in str(error)


@pytest.mark.parametrize(("options", "mode", "option"), [
    (opts(maxOffsetsPerTrigger="10"), "batch", "maxOffsetsPerTrigger"),
    (opts(startingOffsets="latest"), "batch", "startingOffsets"),
    (opts(endingOffsets="earliest"), "batch", "endingOffsets"),
    (opts(endingOffsets='{"orders": {"0": -2}}'), "batch", "endingOffsets"),
    (opts(endingOffsets="latest"), "streaming", "endingOffsets"),
])
def test_mode_specific_options_are_refused_in_the_other_mode(options: dict[str, str], mode: str, option: str) -> None:
    """Streaming-only and batch-only options (and meaningless values) are refused, naming the option."""
    parsed = parse_options(options)
    assert option_error(parsed.for_batch if mode == "batch" else parsed.for_streaming).option == option


def test_offset_json_uses_kafka_sentinels() -> None:
    """In startingOffsets JSON, -2 means earliest and -1 latest; unlisted queues take the default."""
    o = parse_options(opts(startingOffsets='{"orders": {"0": 5, "2": -2, "3": -1}}'))
    assert o.starting is not None and o.starting.kind == "specific"
    assert o.starting.offsets == {("orders", 0): 5, ("orders", 2): of.EARLIEST, ("orders", 3): of.LATEST}
    assert o.starting.default == of.EARLIEST


def test_data_source_checks_options_at_construction() -> None:
    """The DataSource refuses bad options as soon as Spark builds it (at load())."""
    with pytest.raises(OptionError, match="'colour'"):
        TidemarkDataSource(opts(colour="red"))
    assert TidemarkDataSource(opts(includeHeaders="true")).schema() == sc.spark_schema(True)


# -- offsets --------------------------------------------------------------------------------------
def test_offset_json_is_canonical_and_round_trips() -> None:
    """Offsets serialize with sorted topics and numerically sorted queues, and parse back exactly."""
    offsets = {("b", 10): 1, ("b", 2): 3, ("a", 0): 7}
    obj = of.to_json(offsets)
    assert list(obj) == ["a", "b"] and list(obj["b"]) == ["2", "10"]
    assert of.from_json(obj) == offsets
    assert of.to_json(of.from_json({"b": {"10": 1, "2": 3}, "a": {"0": 7}})) == obj


@pytest.mark.parametrize("bad", [[], {"t": 1}, {"t": {"x": 1}}, {"t": {"0": -1}}, {"t": {"0": True}}, {"t": {"0": "1"}}])
def test_offset_json_rejects_garbage(bad: Any) -> None:
    """A malformed offset from a checkpoint is an error, not a silent restart position."""
    with pytest.raises(ValueError, match="tidemark offset"):
        of.from_json(bad)


def test_admit_never_exceeds_the_budget_and_shares_by_backlog() -> None:
    """maxOffsetsPerTrigger: exactly min(budget, backlog) rows, split in proportion to each queue's backlog."""
    start = {("t", 0): 0, ("t", 1): 100, ("t", 2): 5}
    latest = {("t", 0): 900, ("t", 1): 190, ("t", 2): 15}
    end = of.admit(start, latest, 100)
    taken = {k: end[k] - start[k] for k in start}
    assert sum(taken.values()) == 100 and all(0 <= taken[k] <= latest[k] - start[k] for k in start)
    assert taken[("t", 0)] == 90 and taken[("t", 1)] == 9 and taken[("t", 2)] == 1
    assert of.admit(start, latest, None) == latest
    assert of.admit(start, latest, 10_000) == latest


def test_admit_makes_progress_with_a_tiny_budget_and_starts_new_queues_at_zero() -> None:
    """A budget of 1 still advances one queue; a queue absent from the start offset is read from 0."""
    start = {("t", 0): 10}
    latest = {("t", 0): 20, ("t", 1): 20}
    end = of.admit(start, latest, 1)
    assert sum(end[k] - start.get(k, 0) for k in end) == 1
    assert of.admit(start, latest, 40) == latest
    drained = dict(start)
    batches = 0
    while drained != latest:
        drained = of.admit(drained, latest, 7)
        batches += 1
    assert batches == 5  # 30 rows in batches of at most 7


def test_cap_holds_available_now_at_its_target() -> None:
    """Trigger.AvailableNow never reads past the target offsets; queues created later stay put."""
    start = {("t", 0): 3}
    latest = {("t", 0): 50, ("t", 1): 9, ("u", 0): 4}
    target = {("t", 0): 40, ("u", 0): 8}
    assert of.cap(latest, start, target) == {("t", 0): 40, ("t", 1): 0, ("u", 0): 4}


def test_admit_keeps_a_queue_that_went_back() -> None:
    """A queue whose latest offset fell below the start (re-created topic) is passed through for planning."""
    end = of.admit({("t", 0): 50}, {("t", 0): 10}, 5)
    assert end == {("t", 0): 10}


# -- planning -------------------------------------------------------------------------------------
def test_plan_makes_one_partition_per_queue_with_rows() -> None:
    """Planning is a function of (start, end): one QueueRange per queue that has rows in the range."""
    o = parse_options(opts(includeHeaders="true")).for_streaming()
    parts = plan({("orders", 0): 5, ("orders", 1): 7}, {("orders", 0): 9, ("orders", 1): 7, ("orders", 2): 3}, o)
    assert [(p.topic, p.queue_id, p.start, p.end) for p in parts] == [("orders", 0, 5, 9), ("orders", 2, 0, 3)]
    assert all(isinstance(p, QueueRange) and p.include_headers and p.brokers == o.brokers for p in parts)


def test_plan_reports_lost_queues(caplog: pytest.LogCaptureFixture) -> None:
    """A deleted queue or one that went back is an error with failOnDataLoss=true, a warning otherwise."""
    strict = parse_options(opts()).for_streaming()
    with pytest.raises(DataLossError, match="failOnDataLoss=false"):
        plan({("orders", 0): 5}, {}, strict)
    with pytest.raises(DataLossError, match="went back"):
        plan({("orders", 0): 5}, {("orders", 0): 2}, strict)
    lenient = parse_options(opts(failOnDataLoss="false")).for_streaming()
    with caplog.at_level(logging.WARNING, logger="spark_connector"):
        assert plan({("orders", 0): 5, ("orders", 1): 1}, {("orders", 1): 0}, lenient) == []
    assert "no longer exists" in caplog.text and "went back" in caplog.text


def test_plan_ignores_topics_no_longer_subscribed() -> None:
    """A topic removed from 'subscribe' between restarts is not reported as lost."""
    strict = parse_options(opts()).for_streaming()
    assert plan({("orders", 0): 1, ("gone", 0): 5}, {("orders", 0): 3}, strict)[0].end == 3


# -- schema and pickling --------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [False, True])
def test_arrow_schema_equals_what_spark_derives(headers: bool) -> None:
    """The Arrow schema of our batches is exactly Spark's conversion of the declared schema."""
    assert sc.arrow_schema(headers).equals(to_arrow_schema(sc.spark_schema(headers), timezone="UTC"))
    assert sc.spark_schema(headers).simpleString() == "struct<" + ",".join(
        f"{c.split(' ', 1)[0]}:{c.split(' ', 1)[1]}" for c in sc.ddl(headers).split(", ")).replace(
        ":long", ":bigint") + ">"


def test_repeated_string_matches_pyarrow() -> None:
    """The buffer-built topic column equals pyarrow's own construction."""
    assert repeated_string("topic", 3).equals(pa.array(["topic"] * 3, pa.string()))
    assert repeated_string("", 2).equals(pa.array(["", ""], pa.string()))
    assert repeated_string("é", 0).equals(pa.array([], pa.string()))


def test_partitions_and_readers_pickle_without_a_connection() -> None:
    """Partitions and readers survive pickle and cloudpickle; a reader's open client is never pickled."""
    part = QueueRange(("127.0.0.1:1",), "orders", 3, 10, 20, True, False)
    for dumps, loads in ((pickle.dumps, pickle.loads), (CloudPickleSerializer().dumps, CloudPickleSerializer().loads)):
        copy = loads(dumps(part))
        assert copy == part and isinstance(copy, QueueRange)
    reader = TidemarkStreamReader(parse_options(opts()).for_streaming())
    reader._client = BrokerClient("127.0.0.1:1")  # as after a latestOffset() call
    copy = pickle.loads(pickle.dumps(reader))
    assert copy._client is None and copy.opts == reader.opts
    reader.stop()


def test_latest_offset_honours_the_read_limit_type() -> None:
    """ReadAllAvailable ignores maxOffsetsPerTrigger (the engine's choice); the default limit carries it."""
    reader = TidemarkStreamReader(parse_options(opts(maxOffsetsPerTrigger="5")).for_streaming())
    assert reader.getDefaultReadLimit() == ReadMaxRows(5)
    plain = TidemarkStreamReader(parse_options(opts()).for_streaming())
    assert plain.getDefaultReadLimit() == ReadAllAvailable()


# -- read_partition against a real daemon ---------------------------------------------------------
def expected_rows(client: BrokerClient, topic: str, queue_id: int, start: int, end: int) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    offset = start
    while offset < end:
        res = client.pull(topic, queue_id, offset, max_messages=end - offset)
        assert len(res)
        for m in res:
            headers = [{"key": k, "value": v.encode()} for k, v in m.properties.items()] or None
            rows.append((m.key.encode() if m.key else None, m.body, topic, queue_id, m.queue_offset,
                         m.store_time_ms * 1000, 1, headers))
        offset = res.next_offset
    return rows


def batch_rows(batches: list[pa.RecordBatch]) -> list[tuple[Any, ...]]:
    table = pa.Table.from_batches(batches, schema=sc.arrow_schema(True))
    cols = table.to_pydict()
    cols["timestamp"] = table.column("timestamp").cast(pa.int64()).to_pylist()
    return list(zip(*(cols[name] for name in table.schema.names), strict=True))


def test_read_partition_equals_the_clients_pull(spawn: Callable[..., DaemonProcess]) -> None:
    """read() yields exactly the pulled records of [start, end), across several pulls, with the exact schema."""
    d = spawn()
    count = PULL_MESSAGES_MAX * 2 + 500
    with BrokerClient(d.address) as c:
        c.create_topic("orders", queues=1)
        messages = [Message(body=b"body-%d" % i, key=f"k{i}" if i % 3 else None,
                            properties={"n": str(i), "z": "é"} if i % 5 == 0 else None) for i in range(count)]
        for i in range(0, count, 3000):
            c.send("orders", messages[i:i + 3000], ack="flush")
        high = c.list_topics()["orders"]["max_offsets"][0]
        assert high == count
        start, end = 17, count - 3
        part = QueueRange((d.address,), "orders", 0, start, end, True, True)
        batches = list(read_partition(part))
        assert all(b.schema.equals(sc.arrow_schema(True)) for b in batches) and len(batches) >= 3
        assert batch_rows(batches) == expected_rows(c, "orders", 0, start, end)
        plain = list(read_partition(QueueRange((d.address,), "orders", 0, 0, 5, False, True)))
        assert len(plain) == 1 and plain[0].schema.equals(sc.arrow_schema(False)) and plain[0].num_rows == 5
        assert list(read_partition(QueueRange((d.address,), "orders", 0, 5, 5, False, True))) == []


def test_read_partition_of_the_metadata_log(spawn: Callable[..., DaemonProcess]) -> None:
    """__metadata rows carry the change type as key and the JSON change as value."""
    d = spawn()
    with BrokerClient(d.address) as c:
        c.create_topic("a", queues=2)
        c.delete_topic("a")
        high = c.list_topics(include_system=True)["__metadata"]["max_offsets"][0]
        rows = batch_rows(list(read_partition(QueueRange((d.address,), "__metadata", 0, 0, high, True, True))))
    assert [(r[0], r[1]) for r in rows] == [(b"topic.create", b'{"topic":"a","queues":2}'), (b"topic.delete", b'{"topic":"a"}')]


def test_read_partition_reports_offsets_removed_by_retention(spawn: Callable[..., DaemonProcess],
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Offsets retention removed: DataLossError with failOnDataLoss=true, skipped with a warning otherwise."""
    d = spawn(config={"commitlog.segment_bytes": 64 * 1024, "retention.local_bytes": 128 * 1024,
                      "retention.check_interval_ms": 20, "checkpoint.interval_ms": 20})
    body = b"x" * 1000
    with BrokerClient(d.address) as c:
        c.create_topic("old", queues=1)

        def send_more() -> tuple[int, int]:
            """Another 64 KiB; (queue end, earliest offset) once offset 0 is gone, else (0, 0)."""
            c.send("old", [Message(body=body) for _ in range(64)], ack="flush")
            try:
                c.pull("old", 0, 0, max_messages=1)
            except BrokerError as exc:
                assert exc.code.name == "OUT_OF_RANGE"
                high = c.list_topics()["old"]["max_offsets"][0]
                return high, c.pull("old", 0, high, max_messages=1).min_offset
            return 0, 0

        high, earliest = wait_until(send_more, 30, "retention removing a segment", poll_s=0.02,
                                    accept=lambda found: found[1] > 0)
        # stop sending: retention now keeps at least the newest 128 KiB, so `earliest` stays readable a while
        with pytest.raises(DataLossError, match=r"old/0 offsets \[0, \d+\) are no longer available"):
            list(read_partition(QueueRange((d.address,), "old", 0, 0, high, False, True)))
        with caplog.at_level(logging.WARNING, logger="spark_connector"):
            batches = list(read_partition(QueueRange((d.address,), "old", 0, 0, high, False, False)))
        offsets = pa.concat_arrays([b.column("offset") for b in batches]).to_pylist()
        assert offsets == list(range(offsets[0], high)) and offsets[0] >= earliest
        assert "are no longer available" in caplog.text and "failOnDataLoss=false" in caplog.text
        gone = list(read_partition(QueueRange((d.address,), "old", 0, 0, 3, False, False)))
        assert gone == []  # the whole range is below the earliest offset: skipped
