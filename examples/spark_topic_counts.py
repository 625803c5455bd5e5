"""Per-topic message counts from Tidemark into Parquet, with Spark Structured Streaming.

Every micro-batch reads the new committed records of the subscribed topics (``__metadata``
included, if asked for) and appends one row per topic to Parquet: how many records the batch
held, their offset range and their newest store time. Each batch writes its own directory
``batch_id=N`` in overwrite mode, so a batch that Spark replays after a crash replaces its own
output instead of adding to it: together with the checkpoint, every record is counted once.

    # against a running daemon (Ctrl-C to stop; --once reads what is there and exits)
    .venv/bin/python examples/spark_topic_counts.py --broker 127.0.0.1:7600 --topics orders,__metadata \\
        --out /tmp/tm-counts --checkpoint /tmp/tm-counts-ck [--once]

    # self-contained: starts a daemon in a temp directory, sends, runs the pipeline twice
    .venv/bin/python examples/spark_topic_counts.py --demo

Timer lateness (fired time minus due time, from ``__timer``) is not part of it yet: timers are
not implemented (README, "Spark connector").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # run from a checkout: the project's packages (and tests' helpers) import from here
    sys.path.insert(0, REPO)

import spark_connector  # noqa: E402
from broker.client import BrokerClient, Message  # noqa: E402
from tests.procs import DaemonProcess  # noqa: E402


def session() -> Any:
    """A local[2] session with the tidemark source registered."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers must run this venv's Python
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


    spark = (SparkSession.builder.master("local[2]").appName("tidemark-topic-counts")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .config("spark.sql.session.timeZone", "UTC").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark_connector.register(spark)
    return spark


def start_counts(spark: Any, broker: str, topics: str, out: str, checkpoint: str, *, once: bool,
                 max_offsets_per_trigger: int | None = None) -> Any:
    """Start the pipeline; returns the StreamingQuery."""

    reader = (spark.readStream.format("tidemark").option("broker", broker).option("subscribe", topics)
              .option("startingOffsets", "earliest"))
    if max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
    records = reader.load()

    def write_batch(batch: Any, batch_id: int) -> None:
        counts = batch.groupBy("topic").agg(
            F.count("*").alias("records"),
            F.min("offset").alias("min_offset"),
            F.max("offset").alias("max_offset"),
            F.max("timestamp").alias("newest"),
        )
        counts.write.mode("overwrite").parquet(os.path.join(out, f"batch_id={batch_id}"))

    trigger = {"availableNow": True} if once else {"processingTime": "2 seconds"}
    return (records.writeStream.foreachBatch(write_batch).option("checkpointLocation", checkpoint)
            .trigger(**trigger).start())


def totals(spark: Any, out: str) -> dict[str, int]:
    """Records per topic over every batch written so far."""
    if not os.path.isdir(out):
        return {}
    rows = spark.read.parquet(out).groupBy("topic").sum("records").collect()
    return {r[0]: int(r[1]) for r in rows}


def demo() -> int:
    """Start a daemon, send to two topics, run the pipeline twice (availableNow), print totals."""

    with tempfile.TemporaryDirectory(prefix="tm-example-") as tmp:
        daemon = DaemonProcess(os.path.join(tmp, "node")).start()
        try:
            out, checkpoint = os.path.join(tmp, "counts"), os.path.join(tmp, "checkpoint")
            spark = session()
            with BrokerClient(daemon.address) as client:
                client.create_topic("orders", queues=4)
                client.create_topic("payments", queues=2)
                for run, (orders, payments) in enumerate([(1000, 300), (500, 200)], start=1):
                    client.send("orders", [Message(body=b"order %d" % i, key=f"c{i % 50}") for i in range(orders)])
                    client.send("payments", [Message(body=b"payment %d" % i) for i in range(payments)])
                    start_counts(spark, daemon.address, "orders,payments,__metadata", out, checkpoint,
                                 once=True).awaitTermination()
                    print(f"after run {run}: {dict(sorted(totals(spark, out).items()))}")
            spark.stop()
        finally:
            daemon.kill9()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", action="store_true", help="self-contained run on a temporary daemon")
    p.add_argument("--broker", help="daemon address(es), comma-separated")
    p.add_argument("--topics", help="topics to count, comma-separated (__metadata allowed)")
    p.add_argument("--out", help="Parquet output directory")
    p.add_argument("--checkpoint", help="checkpoint directory (keep it with --out)")
    p.add_argument("--once", action="store_true", help="read what is committed now, then exit (Trigger.AvailableNow)")
    p.add_argument("--max-offsets-per-trigger", type=int, default=None)
    a = p.parse_args()
    if a.demo:
        return demo()
    if not (a.broker and a.topics and a.out and a.checkpoint):
        p.error("--broker, --topics, --out and --checkpoint are required (or --demo)")
    spark = session()
    query = start_counts(spark, a.broker, a.topics, a.out, a.checkpoint, once=a.once,
                         max_offsets_per_trigger=a.max_offsets_per_trigger)
    try:
        query.awaitTermination()
    except KeyboardInterrupt:
        query.stop()
    print(dict(sorted(totals(spark, a.out).items())))
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
