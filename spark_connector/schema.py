"""The row schema: Spark's Kafka source columns, as a Spark DDL string and as an Arrow schema.

``read()`` builds Arrow batches whose schema must equal, field for field (nullability
included), what Spark derives from the DDL with ``to_arrow_schema(..., timezone="UTC")``;
a unit test checks that they agree. All columns are nullable, as in the Kafka source.

| column | Spark type | Tidemark source |
|---|---|---|
| key | binary | the message key (UTF-8), null without a key |
| value | binary | the message body |
| topic | string | topic name |
| partition | int | queue id |
| offset | long | queue offset |
| timestamp | timestamp | the broker's store time (append time) |
| timestampType | int | always 1 (Kafka's LogAppendTime): the broker stamps the time |
| headers | array<struct<key:string,value:binary>> | message properties (only with includeHeaders=true; null when none) |
"""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

TIMESTAMP_TYPE_LOG_APPEND = 1
DDL = ("key binary, value binary, topic string, partition int, offset long, timestamp timestamp, "
       "timestampType int")
DDL_HEADERS = DDL + ", headers array<struct<key:string,value:binary>>"

TIMESTAMP_ARROW = pa.timestamp("us", tz="UTC")
HEADER_ARROW = pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())])
HEADERS_ARROW = pa.list_(pa.field("element", HEADER_ARROW))
_FIELDS = [
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),
    pa.field("topic", pa.string()),
    pa.field("partition", pa.int32()),
    pa.field("offset", pa.int64()),
    pa.field("timestamp", TIMESTAMP_ARROW),
    pa.field("timestampType", pa.int32()),
]
ARROW = pa.schema(_FIELDS)
OFFSET_COLUMN = 4  # the offset column's index (partition.py cuts a batch at the planned end by it)
ARROW_HEADERS = pa.schema([*_FIELDS, pa.field("headers", HEADERS_ARROW)])


def ddl(include_headers: bool) -> str:
    """The Spark schema of the rows as DDL text."""
    return DDL_HEADERS if include_headers else DDL


def spark_schema(include_headers: bool) -> StructType:
    """The Spark schema of the rows (built without a JVM: ``DDL`` parsing would need one)."""
    fields = [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
    ]
    if include_headers:
        header = StructType([StructField("key", StringType()), StructField("value", BinaryType())])
        fields.append(StructField("headers", ArrayType(header)))
    return StructType(fields)


def arrow_schema(include_headers: bool) -> pa.Schema:
    """The Arrow schema of the batches ``read()`` yields."""
    return ARROW_HEADERS if include_headers else ARROW
