"""spark_connector: the ``tidemark`` PySpark data source (batch and Structured Streaming).

    import spark_connector
    spark_connector.register(spark)
    df = (spark.readStream.format("tidemark")
          .option("broker", "127.0.0.1:7600").option("subscribe", "orders,__metadata").load())

Modules: ``options`` (parsing, errors naming the option), ``offsets`` (offset JSON, admission
control), ``schema`` (Kafka-like columns, Arrow schema), ``topics`` (driver-side lookups),
``partition`` (a queue range and its pure ``read``), ``batches`` (Arrow batches column by
column), ``source`` (the DataSource and its readers). README "Spark connector" documents it.
"""

from __future__ import annotations

from typing import Any

try:
    from spark_connector.options import OptionError, ReadOptions, parse_options
    from spark_connector.partition import DataLossError, QueueRange, read_partition
    from spark_connector.source import TidemarkBatchReader, TidemarkDataSource, TidemarkStreamReader
except ModuleNotFoundError as exc:  # the extra is not installed: say which, not a traceback into pyspark
    if exc.name not in ("pyspark", "pyarrow", "pandas"):
        raise
    raise ModuleNotFoundError(f"spark_connector needs {exc.name}: pip install 'tidemark[spark]'", name=exc.name) from None

__all__ = [
    "DataLossError",
    "OptionError",
    "QueueRange",
    "ReadOptions",
    "TidemarkBatchReader",
    "TidemarkDataSource",
    "TidemarkStreamReader",
    "parse_options",
    "read_partition",
    "register",
]


def register(spark: Any) -> None:
    """Make ``format("tidemark")`` available in ``spark`` (a SparkSession)."""
    spark.dataSource.register(TidemarkDataSource)
