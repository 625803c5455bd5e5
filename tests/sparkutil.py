"""Spark helpers for the connector tests: one session builder and the stream-to-Parquet pipeline.

Also runnable (``python -m tests.sparkutil ...``): the crash test runs the same streaming query
in a child process, with a pause inside every batch so that it can be killed mid-batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from pyspark.sql import SparkSession

import spark_connector

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPARK_ENV = {"PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
OUTPUT_COLUMNS = ("key", "value", "topic", "partition", "offset", "timestamp")


def spark_env() -> dict[str, str]:
    """The environment a Spark driver process needs (workers must run this venv's Python)."""
    env = {**os.environ, **SPARK_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env


def build_session(app: str = "tidemark-tests") -> Any:
    """A small local[2] session with the tidemark source registered."""
    for key, value in SPARK_ENV.items():
        os.environ[key] = value


    spark = (SparkSession.builder.master("local[2]").appName(app)
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.driver.memory", "1g")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark_connector.register(spark)
    return spark


def start_stream(spark: Any, broker: str, topics: str, out: str, checkpoint: str, *,
                 max_offsets: int | None = None, batch_pause_s: float = 0.0, name: str | None = None) -> Any:
    """Start the tested pipeline: every record of ``topics`` from the earliest offset into Parquet
    at ``out``, with Trigger.AvailableNow and ``checkpoint``. ``batch_pause_s`` sleeps in every
    task of every batch (to make a batch last long enough to be killed in the middle)."""
    reader = (spark.readStream.format("tidemark").option("broker", broker).option("subscribe", topics)
              .option("startingOffsets", "earliest"))
    if max_offsets is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(max_offsets))
    df = reader.load().select(*OUTPUT_COLUMNS)
    if batch_pause_s > 0:
        pause = batch_pause_s

        def slow(batches: Iterator[Any]) -> Iterator[Any]:
            time.sleep(pause)
            yield from batches

        df = df.mapInArrow(slow, df.schema)
    writer = (df.writeStream.format("parquet").option("path", out).option("checkpointLocation", checkpoint)
              .trigger(availableNow=True))
    if name:
        writer = writer.queryName(name)
    return writer.start()


def main() -> int:
    p = argparse.ArgumentParser(description="run the test pipeline once (Trigger.AvailableNow)")
    p.add_argument("--broker", required=True)
    p.add_argument("--topics", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--max-offsets", type=int, default=None)
    p.add_argument("--batch-pause-s", type=float, default=0.0)
    a = p.parse_args()
    spark = build_session("tidemark-crash-child")
    query = start_stream(spark, a.broker, a.topics, a.out, a.checkpoint, max_offsets=a.max_offsets,
                         batch_pause_s=a.batch_pause_s)
    query.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
