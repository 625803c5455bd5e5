"""The tidemark source on real Spark (local[2], one session for the module) and real daemons."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, Message
from tests.failoverutil import TOPIC as FAILOVER_TOPIC
from tests.failoverutil import Pair, coordinated, create_topic, in_sync, sent_once_placed, wait_master
from tests.procs import DaemonProcess
from tests.sparkutil import ROOT, build_session, spark_env, start_stream
from tests.waits import holds_for, wait_until

pytestmark = pytest.mark.xdist_group("spark")  # make test's workers: one Spark JVM at a time


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    """One SparkSession for every test here: a session start costs 10-25 s on this machine."""
    saved = {k: os.environ.get(k) for k in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")}
    session = build_session()
    yield session
    session.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def send_numbered(client: BrokerClient, topic: str, tag: str, count: int) -> None:
    """``count`` messages with distinct bodies; every third keyless, every fifth with properties."""
    messages = [Message(body=f"{tag}-{i}".encode(), key=f"{tag}{i % 7}" if i % 3 else None,
                        properties={"i": str(i)} if i % 5 == 0 else None) for i in range(count)]
    def stored() -> int:
        return sum(client.list_topics()[topic]["max_offsets"])

    before = stored()
    client.send(topic, messages, ack="replica")
    # an ack does not wait for the views: reads (and ``pulled``) see the messages once they are applied
    wait_until(lambda: stored() == before + count, 30, what=f"{count} messages applied to {topic}'s queues")


def pulled(client: BrokerClient, topic: str) -> dict[tuple[str, int, int], bytes]:
    """Every record of ``topic`` below the confirm offset, by (topic, queue, offset)."""
    out: dict[tuple[str, int, int], bytes] = {}
    info = client.list_topics(include_system=True)[topic]
    for q, high in enumerate(info["max_offsets"]):
        offset = 0
        while offset < high:
            res = client.pull(topic, q, offset, max_messages=high - offset)
            for m in res:
                out[(topic, q, m.queue_offset)] = m.body
            offset = res.next_offset
    return out


def assert_exactly_once(spark: Any, out: Path, expected: dict[tuple[str, int, int], bytes]) -> None:
    """The Parquet sink (read through its _spark_metadata log) holds each expected record once."""
    rows = spark.read.parquet(str(out)).select("topic", "partition", "offset", "value").collect()
    counts = Counter((r.topic, r.partition, r.offset) for r in rows)
    duplicates = {k: n for k, n in counts.items() if n > 1}
    assert not duplicates, f"records written more than once: {sorted(duplicates.items())[:5]}"
    missing, extra = sorted(set(expected) - set(counts)), sorted(set(counts) - set(expected))
    assert not missing and not extra, f"missing {missing[:5]}, extra {extra[:5]}"
    assert all(expected[(r.topic, r.partition, r.offset)] == bytes(r.value) for r in rows)


def batch_ids(log_dir: Path) -> set[int]:
    """Batch ids in a checkpoint's offsets/ or commits/ log (ignoring Hadoop's temp and .crc files)."""
    return {int(n) for n in os.listdir(log_dir) if n.isdigit()} if log_dir.is_dir() else set()


def test_batch_read_equals_the_clients_pull(spark: Any, spawn: Callable[..., DaemonProcess]) -> None:
    """spark.read over JSON starting/ending offsets returns exactly the pulled records, headers and times."""
    d = spawn()
    with BrokerClient(d.address) as c:
        c.create_topic("orders", queues=2)
        for tag in ("a", "b", "c"):
            send_numbered(c, "orders", tag, 60)
        highs = c.list_topics()["orders"]["max_offsets"]
        meta_high = c.list_topics(include_system=True)["__metadata"]["max_offsets"][0]
        starting = {"orders": {"0": 5, "1": -2}}
        ending = {"orders": {"0": highs[0] - 4, "1": -1}}
        df = (spark.read.format("tidemark").option("broker", d.address).option("subscribe", "orders,__metadata")
              .option("startingOffsets", json.dumps(starting)).option("endingOffsets", json.dumps(ending))
              .option("includeHeaders", "true").load())
        got = [tuple(r) for r in df.selectExpr(
            "key", "value", "topic", "partition", "offset", "unix_micros(timestamp)", "timestampType", "headers").collect()]
        want = []
        ranges = [("orders", 0, 5, highs[0] - 4), ("orders", 1, 0, highs[1]), ("__metadata", 0, 0, meta_high)]
        for topic, q, start, end in ranges:
            res = c.pull(topic, q, start, max_messages=end - start)
            assert len(res) == end - start
            for m in res:
                headers = [(k, v.encode()) for k, v in m.properties.items()] or None
                want.append((m.key.encode() if m.key else None, m.body, topic, q, m.queue_offset,
                             m.store_time_ms * 1000, 1, headers))
    norm = [(bytes(k) if k is not None else None, bytes(v), t, p, o, ts, tt,
             [(h[0], bytes(h[1])) for h in hs] if hs is not None else None) for k, v, t, p, o, ts, tt, hs in got]
    assert sorted(norm, key=repr) == sorted(want, key=repr)


def test_option_errors_surface_through_spark(spark: Any, spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Bad options and unknown topics fail at load/plan time with a message naming the option."""
    d = spawn()

    def base() -> Any:  # DataFrameReader.option() mutates the reader: a fresh one per case
        return spark.read.format("tidemark").option("broker", d.address)

    with pytest.raises(Exception, match="tidemark option 'colour'"):
        base().option("subscribe", "x").option("colour", "red").load()
    with pytest.raises(Exception, match="tidemark option 'subscribe': unknown topic"):
        base().option("subscribe", "nope").load().collect()
    with pytest.raises(Exception, match="tidemark option 'endingOffsets'"):  # streamReader() runs at start
        query = (spark.readStream.format("tidemark").option("broker", d.address).option("subscribe", "__metadata")
                 .option("endingOffsets", "latest").load().writeStream.format("noop")
                 .option("checkpointLocation", str(tmp_path / "ck")).start())
        query.awaitTermination(60)


def test_available_now_three_runs_write_each_record_once(spark: Any, spawn: Callable[..., DaemonProcess],
                                                          tmp_path: Path) -> None:
    """Three Trigger.AvailableNow runs on one checkpoint, sends in between: every record once in Parquet."""
    d = spawn()
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    with BrokerClient(d.address) as c:
        c.create_topic("events", queues=3)
        for run in range(3):
            send_numbered(c, "events", f"run{run}", 250)
            query = start_stream(spark, d.address, "events,__metadata", str(out), str(checkpoint), max_offsets=400)
            query.awaitTermination(120)
            assert query.exception() is None and not query.isActive
            assert query.lastProgress is not None
        expected = {**pulled(c, "events"), **pulled(c, "__metadata")}
    assert len(expected) == 751
    assert_exactly_once(spark, out, expected)


def test_max_offsets_per_trigger_bounds_every_batch(spark: Any, spawn: Callable[..., DaemonProcess],
                                                    tmp_path: Path) -> None:
    """maxOffsetsPerTrigger=150 over 1000 uneven rows: batches of exactly 150 and a last one of 100."""
    d = spawn()
    with BrokerClient(d.address) as c:
        c.create_topic("bounded", queues=3)
        c.send("bounded", [Message(body=b"%d" % i, key="hot" if i % 4 else f"k{i}") for i in range(1000)])
    query = (spark.readStream.format("tidemark").option("broker", d.address).option("subscribe", "bounded")
             .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", "150").load()
             .writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ck"))
             .trigger(availableNow=True).start())
    query.awaitTermination(120)
    assert query.exception() is None
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sizes == [150] * 6 + [100]


def test_kill_mid_batch_then_rerun_writes_each_record_once(spark: Any, spawn: Callable[..., DaemonProcess],
                                                           tmp_path: Path) -> None:
    """SIGKILL the Spark driver (and its workers) inside a batch, rerun on the checkpoint: still exactly once."""
    d = spawn()
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    with BrokerClient(d.address) as c:
        c.create_topic("crash", queues=2)
        send_numbered(c, "crash", "x", 1200)
        expected = pulled(c, "crash")
    log_path = tmp_path / "child.log"
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.sparkutil", "--broker", d.address, "--topics", "crash", "--out", str(out),
             "--checkpoint", str(checkpoint), "--max-offsets", "200", "--batch-pause-s", "2"],
            cwd=ROOT, env=spark_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # batch 0 commits (workers warm), then kill 0.7 s into a 2 s batch whose offsets are logged, not committed
        def batch_in_progress() -> int | None:
            assert child.poll() is None, f"child exited early: {log_path.read_text()[-3000:]}"
            planned, done = batch_ids(checkpoint / "offsets"), batch_ids(checkpoint / "commits")
            return max(planned - done) if done and planned - done else None

        victim = wait_until(batch_in_progress, 150, "a batch in progress after a committed one", poll_s=0.1,
                            accept=lambda batch: batch is not None, observe=lambda: log_path.read_text()[-3000:])
        holds_for(lambda: child.poll() is None and not (checkpoint / "commits" / str(victim)).exists(), 0.7,
                  f"batch {victim} in progress")
        os.killpg(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait(30)
    assert not (checkpoint / "commits" / str(victim)).exists(), "the batch finished before the kill"
    # the rerun replays the interrupted batch from its logged offsets, then reads the rest in one batch
    query = start_stream(spark, d.address, "crash", str(out), str(checkpoint))
    query.awaitTermination(120)
    assert query.exception() is None
    assert_exactly_once(spark, out, expected)


def test_example_pipeline_counts_each_record_once(spark: Any, spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """examples/spark_topic_counts.py: per-topic totals in Parquet match what was sent, over two runs."""
    spec = importlib.util.spec_from_file_location("spark_topic_counts", os.path.join(ROOT, "examples", "spark_topic_counts.py"))
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    d = spawn()
    out, checkpoint = str(tmp_path / "counts"), str(tmp_path / "checkpoint")
    with BrokerClient(d.address) as c:
        c.create_topic("orders", queues=3)
        c.create_topic("payments", queues=1)
        for orders, payments in ((300, 40), (120, 0)):
            send_numbered(c, "orders", "o", orders)
            if payments:
                send_numbered(c, "payments", "p", payments)
            example.start_counts(spark, d.address, "orders,payments,__metadata", out, checkpoint, once=True,
                                 max_offsets_per_trigger=250).awaitTermination(120)
    assert example.totals(spark, out) == {"orders": 420, "payments": 40, "__metadata": 2}


def test_reading_the_slave_gives_the_masters_rows(spark: Any, spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """A batch read and a streaming read from the slave return exactly the master's confirmed rows."""
    fast = {"replication.max_lag_ms": 1000, "checkpoint.interval_ms": 100}
    m = spawn("m", config=fast)
    s = spawn("s", config={**fast, "node.role": "slave", "node.master": m.address})
    with BrokerClient(m.address) as c:
        c.create_topic("replicated", queues=2)
        for tag in ("a", "b"):
            send_numbered(c, "replicated", tag, 150)  # ack=replica: on the slave too
        on_master = c.list_topics(include_system=True)
    with BrokerClient(s.address) as c:
        wait_until(lambda: c.list_topics(include_system=True) == on_master, 30, "the slave caught up",
                   observe=lambda: (c.list_topics(include_system=True), on_master))
        assert c.status()["role"] == "slave"
        expected = {**pulled(c, "replicated"), **pulled(c, "__metadata")}

    def rows(address: str) -> list[tuple[Any, ...]]:
        df = (spark.read.format("tidemark").option("broker", address).option("subscribe", "replicated,__metadata")
              .option("includeHeaders", "true").load())
        return sorted((tuple(r) for r in df.selectExpr("topic", "partition", "offset", "key", "value", "headers",
                                                       "unix_micros(timestamp)").collect()), key=repr)

    from_slave = rows(s.address)
    assert from_slave == rows(m.address) and len(from_slave) == 301
    out = tmp_path / "out"
    start_stream(spark, s.address, "replicated,__metadata", str(out), str(tmp_path / "ck")).awaitTermination(120)
    assert_exactly_once(spark, out, expected)


def test_timer_event_log_reads_as_rows(spark: Any, spawn: Callable[..., DaemonProcess]) -> None:
    """``__timer`` through Spark: one row per scheduled message, per fired and per cancelled event."""
    d = spawn(config={"timer.precision_ms": 50})
    with BrokerClient(d.address) as c:
        c.create_topic("later", queues=2)
        due = int(time.time() * 1000) + 600
        receipts = c.send("later", [Message(body=b"t%d" % i, key=f"k{i}", deliver_at_ms=due + i) for i in range(30)])
        c.cancel_timer(receipts[0])
        wait_until(lambda: c.status()["timer_pending"] == 0, 30, "every timer fired or cancelled", poll_s=0.1,
                   observe=c.status)
        assert c.status()["timer_pending"] == 0
    rows = (spark.read.format("tidemark").option("broker", d.address).option("subscribe", "__timer")
            .option("includeHeaders", "true").load().collect())
    kinds: Counter[str] = Counter()
    for row in rows:
        headers = {h["key"]: bytes(h["value"]).decode() for h in row["headers"]}
        kinds[headers.get("__event", "scheduled")] += 1
        if "__event" not in headers:
            assert headers["__topic"] == "later" and bytes(row["value"]).startswith(b"t")
    assert kinds == {"scheduled": 30, "fired": 29, "cancelled": 1}


def committed(client: BrokerClient, topic: str) -> dict[tuple[str, int, int], bytes]:
    """Every record a read_committed reader sees in ``topic``, up to each queue's LSO."""
    out: dict[tuple[str, int, int], bytes] = {}
    for q, lso in enumerate(client.list_topics()[topic]["stable_offsets"]):
        for res in client.iter_pull(topic, q, 0):
            out.update({(topic, q, m.queue_offset): m.body for m in res if m.queue_offset < lso})
    return out


def test_transactions_committed_only_with_gaps_and_the_lso(spark: Any, spawn: Callable[..., DaemonProcess],
                                                           tmp_path: Path) -> None:
    """Committed, aborted and open transactions interleaved with plain sends on 2 queues: two
    AvailableNow runs (maxOffsetsPerTrigger 7, so triggers end inside gaps) write exactly the
    committed records below the LSO, each once; the open transaction's records and the plain ones
    after it come with the second run, after its commit; aborted ones never."""
    d = spawn()
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    with BrokerClient(d.address) as c:
        c.create_topic("tx", queues=2)
        for i in range(6):
            tx = c.begin_transaction(f"p{i % 2}")
            tx.send("tx", [Message(f"t{i}-{j}".encode(), key=f"k{j}") for j in range(5)])
            tx.abort() if i % 3 == 2 else tx.commit()
        c.send("tx", [Message(b"plain-%d" % j, key=f"k{j}") for j in range(4)], ack="replica")
        hanging = c.begin_transaction("hang", timeout_ms=600_000)
        hanging.send("tx", [Message(b"hang-%d" % j, key=f"k{j}") for j in range(4)], ack="replica")
        c.send("tx", [Message(b"after-%d" % j, key=f"k{j}") for j in range(4)], ack="replica")
        wait_until(lambda: sum(c.list_topics()["tx"]["max_offsets"]) == 42, 30, "every record applied")
        runs = []
        for run in range(2):
            if run == 1:
                hanging.commit()
            query = start_stream(spark, d.address, "tx", str(out), str(checkpoint), max_offsets=7)
            query.awaitTermination(120)
            assert query.exception() is None and not query.isActive
            runs.append(committed(c, "tx"))
            assert_exactly_once(spark, out, runs[-1])
    first, second = ({b.split(b"-")[0] for b in run.values()} for run in runs)
    assert first == {b"t0", b"t1", b"t3", b"t4", b"plain"}, "the first run read past the LSO or an abort"
    assert second == first | {b"hang", b"after"}
    offsets = sorted(o for (_, q, o) in runs[1] if q == 0)
    assert offsets != list(range(len(offsets))), "the aborted transactions left no gap"


def test_transactions_across_a_failover(spark: Any, spawn: Callable[..., DaemonProcess], etcd: EtcdProcess,
                                        tmp_path: Path) -> None:
    """Committed, aborted and open transactions on a pair under etcd; an AvailableNow run; kill -9
    of the master; the open transaction commits on the promoted slave, more transactions follow;
    a second run on the same checkpoint: exactly the committed records, each once."""
    pair = Pair(spawn, etcd, **{"checkpoint.interval_ms": 100})
    master = wait_master(pair.nodes)
    slave = pair.other(master)
    create_topic(master, pair.nodes, 2)
    wait_until(lambda: in_sync(master, slave), 30, "the slave in sync")
    brokers = f"{pair.a.address},{pair.b.address}"
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def tag(run: dict[tuple[str, int, int], bytes]) -> set[bytes]:
        return {b.split(b"-")[0] for b in run.values()}

    def transactions(c: BrokerClient, first: int, aborted: int) -> None:
        for i in range(first, first + 4):
            tx = c.begin_transaction(f"p{i % 2}")
            tx.send(FAILOVER_TOPIC, [Message(f"t{i}-{j}".encode(), key=f"k{j}") for j in range(5)], ack="replica")
            tx.abort() if i == aborted else tx.commit()

    def run_once(c: BrokerClient) -> dict[tuple[str, int, int], bytes]:
        query = start_stream(spark, brokers, FAILOVER_TOPIC, str(out), str(checkpoint), max_offsets=6)
        query.awaitTermination(120)
        assert query.exception() is None and not query.isActive
        seen = committed(c, FAILOVER_TOPIC)
        assert_exactly_once(spark, out, seen)
        return seen

    with BrokerClient([pair.a.address, pair.b.address], timeout_s=30) as c:
        transactions(c, 0, aborted=2)
        hanging = c.begin_transaction("hang", timeout_ms=600_000)
        hanging.send(FAILOVER_TOPIC, [Message(b"hang-%d" % j, key=f"k{j}") for j in range(3)], ack="replica")
        c.send(FAILOVER_TOPIC, [Message(b"plain-%d" % j, key=f"k{j}") for j in range(4)], ack="replica")
        first = run_once(c)
        master.kill9()
        wait_master(pair.nodes, 30, among=[slave])
        hanging.commit()
        transactions(c, 4, aborted=5)
        second = run_once(c)
    assert tag(first) == {b"t0", b"t1", b"t3"}, "the first run read an aborted or open transaction"
    assert tag(second) == {b"t0", b"t1", b"t3", b"hang", b"plain", b"t4", b"t6", b"t7"}


def test_a_batch_read_spans_the_shards_of_a_cluster(spark: Any, spawn: Callable[..., DaemonProcess],
                                                   etcd: EtcdProcess) -> None:
    """A topic whose queues are placed over two shards, read with one bootstrap address (a node of
    one shard): every queue's records, planned from each queue's owner and pulled from it."""
    nodes = []
    for name, shard in (("a", "s1"), ("b", "s2")):
        nodes.append(spawn(name, config=coordinated(etcd.endpoint, **{"coordinator.cluster": "spark",
                                                                      "coordinator.shard": shard})))
        wait_master([nodes[-1]])
    with BrokerClient(nodes[0].address) as c:
        c.create_topic("spread", queues=4)
        assert sorted({q["shard"] for q in c.describe_topic("spread")["queues"]}) == ["s1", "s2"]
        probe = [Message(body=b"probe", key=f"p{i}") for i in range(32)]
        wait_until(lambda: sent_once_placed(c, "spread", probe), 15, "every queue created on its shard")
        c.send("spread", [Message(body=f"m{i}".encode(), key=f"k{i % 13}") for i in range(400)], ack="replica")
        # each shard lists a queue's end once its views applied the send (they trail the log)
        wait_until(lambda: sum(c.list_topics()["spread"]["max_offsets"]) >= 432, 20, "every queue's end listed")
        expected = pulled(c, "spread")  # each queue up to its end as its own shard lists it
        assert sum(c.list_topics()["spread"]["max_offsets"]) == len(expected) >= 432
        assert set(expected.values()) >= {f"m{i}".encode() for i in range(400)}
    rows = (spark.read.format("tidemark").option("broker", nodes[1].address).option("subscribe", "spread").load()
            .select("topic", "partition", "offset", "value").collect())
    got = {(r.topic, r.partition, r.offset): bytes(r.value) for r in rows}
    assert len(rows) == len(got) and got == expected


def test_a_stream_over_two_shards_reads_each_record_once_across_a_shards_failover(
        spark: Any, spawn: Callable[..., DaemonProcess], etcd: EtcdProcess, tmp_path: Path) -> None:
    """Shard s1 a pair, s2 one node; an AvailableNow run from s2's address; kill -9 of s1's master,
    more sends after s1's failover; a second run on the same checkpoint: every record once."""
    sharded = {"coordinator.cluster": "stream", "checkpoint.interval_ms": 100}
    s1 = Pair(spawn, etcd, **{**sharded, "coordinator.shard": "s1"})
    s2 = spawn("c", config=coordinated(etcd.endpoint, **{**sharded, "coordinator.shard": "s2"}))
    master = wait_master(s1.nodes)
    slave = s1.other(master)
    wait_master([s2])
    wait_until(lambda: in_sync(master, slave), 30, "s1's slave in sync")
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    with BrokerClient(s2.address, timeout_s=30) as c:
        c.create_topic("flow", queues=4)
        assert sorted({q["shard"] for q in c.describe_topic("flow")["queues"]}) == ["s1", "s2"]
        wait_until(lambda: sent_once_placed(c, "flow", [Message(b"probe", key=f"p{i}") for i in range(32)]), 15,
                   "every queue created on its shard")
        c.send("flow", [Message(f"one-{i}".encode(), key=f"k{i % 11}") for i in range(200)], ack="replica")

        def run_once() -> dict[tuple[str, int, int], bytes]:
            query = start_stream(spark, s2.address, "flow", str(out), str(checkpoint), max_offsets=64)
            query.awaitTermination(120)
            assert query.exception() is None and not query.isActive
            seen = pulled(c, "flow")
            assert_exactly_once(spark, out, seen)
            return seen

        first = run_once()
        master.kill9()
        wait_master(s1.nodes, 30, among=[slave])
        c.send("flow", [Message(f"two-{i}".encode(), key=f"k{i % 11}") for i in range(200)], ack="replica")
        second = run_once()
    assert {f"one-{i}".encode() for i in range(200)} <= set(first.values())
    assert {f"two-{i}".encode() for i in range(200)} <= set(second.values()) and len(second) == len(first) + 200


def test_spark_reads_a_queue_across_its_move_between_shards(spark: Any, spawn: Callable[..., DaemonProcess],
                                                            etcd: EtcdProcess, tmp_path: Path) -> None:
    """An AvailableNow stream reads a topic, one of its queues moves to the other shard, more is
    sent, a second run on the same checkpoint reads the rest: every record once, offsets going on
    across the segments; a batch read from the earliest offsets finds the old segment too."""
    nodes = []
    for name, shard in (("a", "s1"), ("b", "s2")):
        nodes.append(spawn(name, config=coordinated(etcd.endpoint, **{"coordinator.cluster": "moving",
                                                                      "coordinator.shard": shard})))
        wait_master([nodes[-1]])
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    with BrokerClient(nodes[1].address, timeout_s=30) as c:
        c.create_topic("moved", queues=2)
        q = [r["shard"] for r in c.describe_topic("moved")["queues"]].index("s1")
        wait_until(lambda: sent_once_placed(c, "moved", [Message(b"probe", key=f"p{i}") for i in range(16)]), 15,
                   "every queue created on its shard")
        c.send("moved", [Message(f"one-{i}".encode(), key=f"k{i % 7}") for i in range(150)], ack="replica")

        def run_once() -> dict[tuple[str, int, int], bytes]:
            query = start_stream(spark, nodes[1].address, "moved", str(out), str(checkpoint), max_offsets=40)
            query.awaitTermination(120)
            assert query.exception() is None and not query.isActive
            seen = pulled(c, "moved")
            assert_exactly_once(spark, out, seen)
            return seen

        first = run_once()
        segments = c.move_queue("moved", q, "s2")
        assert [s["shard"] for s in segments] == ["s1", "s2"]
        c.send("moved", [Message(f"two-{i}".encode(), key=f"k{i % 7}") for i in range(150)], ack="replica")
        second = run_once()
        assert c.describe_topic("moved")["queues"][q]["segments"] == segments
        assert c.earliest_offset("moved", q, 10**9) == 0, "the queue's earliest offset is on its old segment"
    assert {f"two-{i}".encode() for i in range(150)} <= set(second.values()) and len(second) == len(first) + 150
    assert sorted(o for (_, p, o) in second if p == q) == list(range(sum(1 for k in second if k[1] == q)))
    rows = (spark.read.format("tidemark").option("broker", nodes[0].address).option("subscribe", "moved")
            .option("startingOffsets", "earliest").load().select("topic", "partition", "offset", "value").collect())
    assert {(r.topic, r.partition, r.offset): bytes(r.value) for r in rows} == second
