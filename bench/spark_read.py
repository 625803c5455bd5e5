"""Spark read: the tidemark source vs a pure-Python Arrow generator, streaming on local[2].

One daemon holds ``--messages`` (default 2,000,000) distinct 1 KiB keyless messages in
``--queues`` queues, filled by two producer processes (ack=leader). One SparkSession
(local[2]) then runs Trigger.AvailableNow streaming queries:

1. tidemark → noop sink (the target: >= 150,000 rows/s), with the default ``localReads``: the
   executors, on the daemon's host, read the batches from its segment files;
2. the same with ``localReads=false``: every batch through the daemon and gRPC, as for executors
   on another host;
3. generator → noop sink: a Python data source yielding the same rows (same schema, same
   partitions, same Arrow batch size) from pre-built buffers, with no broker and no decoding:
   the ceiling for a Python source here (the target: tidemark >= 50% of it);
4. the three again → Parquet.

Each query first runs once on a small warm-up topic (so Python workers are started); then the
timed runs (``--repeat``, interleaved between the two sources, the best counts: the machine is
shared and noisy) read everything in one micro-batch each, on a fresh checkpoint. Rates are
rows / wall time of the query, from start() to the end of awaitTermination(). Spark, its Python
workers and the daemon share the machine's 2 cores; the note of each run gives the CPU time per
row of the JVM, of Spark's Python workers and of the daemon.

Usage: .venv/bin/python bench/spark_read.py [--quick] [--messages 2000000] [--queues 4] [--repeat 2] [--no-parquet]
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import common
import load
import numpy as np
import pyarrow as pa
from common import KiB, Results, log
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, SupportsTriggerAvailableNow

import spark_connector
from broker.client import BrokerClient, Message
from spark_connector.schema import TIMESTAMP_ARROW, arrow_schema, spark_schema

TOPIC = "bench-spark"
WARMUP_TOPIC = "bench-spark-warmup"
WARMUP_MESSAGES = 20_000
TARGET_ROWS_S = 150_000
TARGET_RATIO = 0.5
LABELS = {"tidemark": "tidemark", "tidemark_grpc": "tidemark over gRPC", "tidemark_generator": "generator (ceiling)"}
POOL_BYTES = 64 << 20  # distinct bodies are windows of one random pool (Parquet cannot dictionary-encode them)
BATCH_ROWS = 16384  # rows per Arrow batch in the generator, as spark_connector.partition.PULL_MESSAGES_MAX


# -- filling the daemon ---------------------------------------------------------------------------
def fill_producer(address: str, topic: str, count: int, seed: int, batch: int, body_bytes: int, out: Any) -> None:

    pool = os.urandom(POOL_BYTES)
    sent = 0
    i = seed * 7919
    with BrokerClient(address) as client:
        while sent < count:
            n = min(batch, count - sent)
            messages = []
            for _ in range(n):
                at = (i * 1031) % (POOL_BYTES - body_bytes)
                messages.append(Message(body=pool[at:at + body_bytes]))
                i += 1
            client.send(topic, messages, ack="leader")
            sent += n
    out.put(sent)


def fill(address: str, topic: str, count: int, body_bytes: int) -> float:
    """Send ``count`` messages from two producer processes; seconds taken."""
    t0 = time.perf_counter()
    args = [(address, topic, n, k, 1000, body_bytes) for k, n in enumerate(load.halves(count))]
    filled = sum(load.run_processes(fill_producer, args, timeout_s=3600))
    if filled != count:
        raise SystemExit(f"filled {filled} messages, wanted {count}")
    return time.perf_counter() - t0


# -- the generator source (the ceiling) ----------------------------------------------------------
def generator_source() -> type:
    """A streaming Python data source yielding the tidemark schema's rows from pre-built buffers.

    Defined in a function so that cloudpickle ships the classes by value to the Python workers.
    """


    @dataclass(frozen=True)
    class Range(InputPartition):
        queue_id: int
        start: int
        end: int
        body_bytes: int

    class Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):
        def __init__(self, options: dict[str, str]) -> None:
            self.queues = int(options["queues"])
            self.rows = int(options["rows"])
            self.body_bytes = int(options["bodybytes"])

        def _all(self) -> dict[str, int]:
            per = [self.rows // self.queues + (1 if q < self.rows % self.queues else 0) for q in range(self.queues)]
            return {str(q): n for q, n in enumerate(per)}

        def initialOffset(self) -> dict[str, int]:
            return {str(q): 0 for q in range(self.queues)}

        def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
            assert isinstance(limit, ReadAllAvailable)
            return self._all()

        def prepareForTriggerAvailableNow(self) -> None:
            pass

        def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
            return [Range(int(q), start[q], end[q], self.body_bytes) for q in sorted(end, key=int) if end[q] > start[q]]

        def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
            p = partition
            assert isinstance(p, Range)
            pool = pa.py_buffer(np.random.default_rng(p.queue_id).bytes(POOL_BYTES))
            schema = arrow_schema(False)
            topic = TOPIC.encode()
            stamp = pa.scalar(int(time.time() * 1e6), TIMESTAMP_ARROW)
            offset = p.start
            window = 0
            while offset < p.end:
                n = min(BATCH_ROWS, p.end - offset)
                span = n * p.body_bytes
                if window + span > POOL_BYTES:
                    window = 0
                value_offsets = np.arange(0, span + 1, p.body_bytes, dtype=np.int32)
                topic_offsets = np.arange(0, (n + 1) * len(topic), len(topic), dtype=np.int32)
                columns = [
                    pa.nulls(n, pa.binary()),
                    pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(value_offsets), pool.slice(window, span)]),
                    pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(topic_offsets), pa.py_buffer(topic * n)]),
                    pa.array(np.full(n, p.queue_id, dtype=np.int32)),
                    pa.array(np.arange(offset, offset + n, dtype=np.int64)),
                    pa.array(np.full(n, stamp.value, dtype=np.int64), TIMESTAMP_ARROW),
                    pa.array(np.full(n, 1, dtype=np.int32)),
                ]
                yield pa.RecordBatch.from_arrays(columns, schema=schema)
                window += span + 4099  # the next batch's bodies start elsewhere in the pool
                offset += n

    class Generator(DataSource):
        @classmethod
        def name(cls) -> str:
            return "tidemark_generator"

        def schema(self) -> Any:
            return spark_schema(False)

        def streamReader(self, schema: Any) -> DataSourceStreamReader:
            return Reader(dict(self.options))

    return Generator


# -- running queries ------------------------------------------------------------------------------
@dataclass
class Run:
    rows: int
    seconds: float
    cpu_s: dict[str, float]  # by role: jvm, python workers, daemon


def cpu_by_role(daemon_pid: int | None) -> dict[str, float]:
    """CPU seconds so far of this process's descendants: the JVM, Spark's Python workers, the daemon."""
    ticks = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, str, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        table[int(name)] = (int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / ticks)
    out = {"jvm": 0.0, "python workers": 0.0, "daemon": 0.0}
    for pid, (_, cmd, cpu) in table.items():
        p, depth = pid, 0
        while p > 1 and p != os.getpid() and depth < 32:
            p, depth = table.get(p, (0, "", 0.0))[0], depth + 1
        if p != os.getpid():
            continue
        if pid == daemon_pid:
            out["daemon"] += cpu
        elif "java" in cmd.split(" ", 1)[0]:
            out["jvm"] += cpu
        elif "pyspark" in cmd:
            out["python workers"] += cpu
    return out


def run_query(spark: Any, source: str, options: dict[str, str], sink: str, workdir: str, name: str,
              daemon_pid: int | None) -> Run:
    """One Trigger.AvailableNow query on a fresh checkpoint; rows read and wall seconds."""
    checkpoint = os.path.join(workdir, f"ck-{name}")
    out = os.path.join(workdir, f"out-{name}")
    reader = spark.readStream.format(source)
    for k, v in options.items():
        reader = reader.option(k, v)
    writer = reader.load().writeStream.format(sink).option("checkpointLocation", checkpoint).trigger(availableNow=True)
    if sink == "parquet":
        writer = writer.option("path", out)
    cpu0 = cpu_by_role(daemon_pid)
    t0 = time.perf_counter()
    query = writer.start()
    query.awaitTermination()
    seconds = time.perf_counter() - t0
    cpu1 = cpu_by_role(daemon_pid)
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    if query.exception() is not None:
        raise SystemExit(f"{name}: {query.exception()}")
    rows = sum(p["numInputRows"] for p in query.recentProgress)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(checkpoint, ignore_errors=True)
    return Run(rows, seconds, cpu)


def build_session() -> Any:
    """local[2], as the tests: workers run this venv's Python, Spark binds to loopback."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"


    spark = (SparkSession.builder.master("local[2]").appName("tidemark-bench").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark_connector.register(spark)
    return spark


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=None, help="messages to read (default 2,000,000; quick 200,000)")
    p.add_argument("--queues", type=int, default=4)
    p.add_argument("--body", type=int, default=KiB)
    p.add_argument("--no-parquet", action="store_true", help="skip the two Parquet runs")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per source and sink; the best one counts (noisy machine)")
    a = p.parse_args()
    messages = a.messages or (200_000 if a.quick else 2_000_000)
    params = {"messages": messages, "queues": a.queues, "body_bytes": a.body, "quick": a.quick, "master": "local[2]",
              "repeat": a.repeat}
    res = Results("spark_read", a.results, params)
    common.preflight(res, a.max_wait_quiet, a.malloc_tuned)
    parent = a.workdir or "/tmp"


    with common.temp_dir("tm-spark-", parent) as wd, common.running_daemon(wd) as daemon:
        assert daemon.proc is not None
        with BrokerClient(daemon.address) as c:
            c.create_topic(TOPIC, queues=a.queues)
            c.create_topic(WARMUP_TOPIC, queues=a.queues)
            fill(daemon.address, WARMUP_TOPIC, WARMUP_MESSAGES, a.body)
            fill_s = fill(daemon.address, TOPIC, messages, a.body)
            log(f"filled {messages:,} messages in {fill_s:.1f}s; waiting for the views to catch up")
            deadline = time.monotonic() + 300
            while sum(c.list_topics()[TOPIC]["max_offsets"]) < messages and time.monotonic() < deadline:
                time.sleep(0.2)
            held = sum(c.list_topics()[TOPIC]["max_offsets"])
            if held != messages:
                raise SystemExit(f"the topic holds {held} messages below the confirm offset, expected {messages}")
        res.add("fill rate (2 producers, ack=leader)", messages / fill_s, "msg/s")

        t0 = time.perf_counter()
        spark = build_session()
        spark.dataSource.register(generator_source())
        log(f"Spark session up in {time.perf_counter() - t0:.1f}s")
        tidemark = {"broker": daemon.address, "subscribe": TOPIC, "startingOffsets": "earliest"}
        warm = {**tidemark, "subscribe": WARMUP_TOPIC}
        gen = {"queues": str(a.queues), "rows": str(messages), "bodybytes": str(a.body)}
        gen_warm = {**gen, "rows": str(WARMUP_MESSAGES)}
        sinks = ["noop"] if a.no_parquet else ["noop", "parquet"]
        rates: dict[tuple[str, str], float] = {}
        grpc_only = {"localReads": "false"}  # the same source, every batch received over gRPC
        for sink in sinks:
            sources = (("tidemark", "tidemark", tidemark, warm, daemon.proc.pid),
                       ("tidemark_grpc", "tidemark", {**tidemark, **grpc_only}, {**warm, **grpc_only}, daemon.proc.pid),
                       ("tidemark_generator", "tidemark_generator", gen, gen_warm, None))
            for source, fmt, _, warm_opts, pid in sources:
                run_query(spark, fmt, warm_opts, sink, wd, f"{source}-{sink}-warmup", pid)
            best: dict[str, tuple[Run, float]] = {}
            for attempt in range(a.repeat):  # interleaved, so all sources see the same machine
                for source, fmt, opts, _, pid in sources:
                    busy = float(common.wait_for_quiet(a.max_wait_quiet, busy_max=0.2)["cpu_busy_before"])
                    r = run_query(spark, fmt, opts, sink, wd, f"{source}-{sink}-{attempt}", pid)
                    if r.rows != messages:
                        raise SystemExit(f"{source} → {sink}: read {r.rows} rows, expected {messages}")
                    log(f"{source} → {sink}: {r.rows / r.seconds:,.0f} rows/s (run {attempt + 1} of {a.repeat})")
                    if source not in best or r.seconds < best[source][0].seconds:
                        best[source] = (r, busy)
            for source, _, _, _, _ in sources:
                r, busy = best[source]
                rate = r.rows / r.seconds
                rates[(source, sink)] = rate
                label = LABELS[source]
                judged = (source, sink) == ("tidemark", "noop") and not a.quick  # quick: fixed costs dominate
                target, ok = common.at_least(rate, TARGET_ROWS_S) if judged else ("", None)
                per_row = ", ".join(f"{k} {v / r.rows * 1e6:.1f}" for k, v in r.cpu_s.items() if v)
                note = (f"best of {a.repeat}: {r.rows:,} rows in {r.seconds:.2f}s, {rate * a.body / 1e6:,.0f} MB/s; "
                        f"CPU µs/row: {per_row}; busy before {busy:.0%}")
                res.add(f"{label} → {sink}", rate, "rows/s", target=target, ok=ok, note=note, seconds=r.seconds,
                        cpu_s=r.cpu_s)
            ratio = rates[("tidemark", sink)] / rates[("tidemark_generator", sink)]
            target, ok = common.at_least(ratio, TARGET_RATIO) if sink == "noop" and not a.quick else ("", None)
            res.add(f"tidemark / generator ({sink})", ratio, "x", target=target, ok=ok)
            res.add(f"tidemark over gRPC / generator ({sink})", rates[("tidemark_grpc", sink)] / rates[("tidemark_generator", sink)],
                    "x", note="localReads=false: every batch through the daemon and gRPC (executors on another host)")
        spark.stop()
        daemon.stop()
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
