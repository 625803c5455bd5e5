"""The reader options: parsed and checked once, with an error that names the option.

Option names follow Spark's Kafka source. Spark hands them over case-insensitively (lower-cased
keys); errors use the documented spelling. Everything here is pure (no broker, no Spark), so
the same checks run in every process that builds the data source.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from spark_connector.offsets import EARLIEST, LATEST, QueueKey

OPTIONS = ("broker", "subscribe", "startingOffsets", "endingOffsets", "maxOffsetsPerTrigger", "failOnDataLoss",
           "includeHeaders", "tlsCaFile", "tokenFile", "localReads")
CANONICAL = {name.lower(): name for name in OPTIONS}
# Kafka-source options a user may carry over; each gets a specific hint instead of "unknown".
KAFKA_ONLY = {
    "kafka.bootstrap.servers": "use 'broker' (comma-separated host:port addresses)",
    "assign": "use 'subscribe' (all queues of each topic are read)",
    "subscribepattern": "use 'subscribe' with explicit topic names",
}
METADATA_TOPIC = "__metadata"
_ADDRESS_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")
_TOPIC_RE = re.compile(r"^(__)?[A-Za-z0-9][A-Za-z0-9._-]{0,126}$")

Kind = Literal["earliest", "latest", "specific"]


class OptionError(ValueError):
    """A reader option is missing, unknown or malformed; the message names it."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"tidemark option '{option}': {message}")
        self.option = option


@dataclass(frozen=True)
class OffsetSpec:
    """``startingOffsets`` / ``endingOffsets``: earliest, latest, or per-queue offsets.

    In ``specific``, a value of -2 means earliest and -1 latest (as in Spark's Kafka source);
    queues of a subscribed topic that the JSON leaves out take ``default`` (the option's
    usual meaning: earliest for starting offsets, latest for ending offsets).
    """

    kind: Kind
    offsets: dict[QueueKey, int] = field(default_factory=dict)
    default: int = EARLIEST


@dataclass(frozen=True)
class ReadOptions:
    brokers: tuple[str, ...]
    topics: tuple[str, ...]
    starting: OffsetSpec | None  # None: the mode's default (streaming: latest, batch: earliest)
    ending: OffsetSpec | None  # None: latest (batch only)
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    include_headers: bool
    tls_ca_file: str | None = None  # TLS to the brokers, verified against this CA (PEM), on every process
    token_file: str | None = None  # bearer token (needed for reads only with auth.require_for_reads)
    local_reads: bool = True  # executors on a node's host read its segment files (broker/client/local_reads.py)

    def for_batch(self) -> ReadOptions:
        """Checks that only apply to ``spark.read``; returns the options with defaults filled in."""
        if self.max_offsets_per_trigger is not None:
            raise OptionError("maxOffsetsPerTrigger", "applies to streaming queries only (spark.readStream)")
        starting = self.starting or OffsetSpec("earliest")
        ending = self.ending or OffsetSpec("latest", default=LATEST)
        if starting.kind == "latest":
            raise OptionError("startingOffsets", "'latest' is not allowed in a batch query (it would read nothing)")
        if ending.kind == "earliest":
            raise OptionError("endingOffsets", "'earliest' is not allowed in a batch query (it would read nothing)")
        if ending.kind == "specific" and any(v == EARLIEST for v in ending.offsets.values()):
            raise OptionError("endingOffsets", "-2 (earliest) is not allowed as an ending offset")
        return replace(self, starting=starting, ending=ending, max_offsets_per_trigger=None)

    def for_streaming(self) -> ReadOptions:
        """Checks that only apply to ``spark.readStream``; returns the options with defaults filled in."""
        if self.ending is not None:
            raise OptionError("endingOffsets", "applies to batch queries only (spark.read)")
        starting = self.starting or OffsetSpec("latest")
        return replace(self, starting=starting, ending=None)


def parse_options(options: Mapping[str, str]) -> ReadOptions:
    """Check every option; raise OptionError naming the first bad one."""
    given: dict[str, str] = {}
    for raw_key, value in options.items():
        key = raw_key.lower()
        if key in KAFKA_ONLY:
            raise OptionError(raw_key, f"is a Kafka source option; {KAFKA_ONLY[key]}")
        if key not in CANONICAL:
            raise OptionError(raw_key, f"unknown option (supported: {', '.join(OPTIONS)})")
        given[CANONICAL[key]] = str(value)
    if "broker" not in given:
        raise OptionError("broker", "is required: one or more host:port addresses, comma-separated")
    if "subscribe" not in given:
        raise OptionError("subscribe", "is required: one or more topic names, comma-separated")
    brokers = _brokers(given["broker"])
    topics = _topics(given["subscribe"])
    starting = _offset_spec("startingOffsets", given["startingOffsets"], topics, EARLIEST) \
        if "startingOffsets" in given else None
    ending = _offset_spec("endingOffsets", given["endingOffsets"], topics, LATEST) if "endingOffsets" in given else None
    max_rows = _positive_int("maxOffsetsPerTrigger", given["maxOffsetsPerTrigger"]) \
        if "maxOffsetsPerTrigger" in given else None
    return ReadOptions(
        brokers=brokers,
        topics=topics,
        starting=starting,
        ending=ending,
        max_offsets_per_trigger=max_rows,
        fail_on_data_loss=_boolean("failOnDataLoss", given.get("failOnDataLoss", "true")),
        include_headers=_boolean("includeHeaders", given.get("includeHeaders", "false")),
        tls_ca_file=_path("tlsCaFile", given["tlsCaFile"]) if "tlsCaFile" in given else None,
        token_file=_path("tokenFile", given["tokenFile"]) if "tokenFile" in given else None,
        local_reads=_boolean("localReads", given.get("localReads", "true")),
    )


def _path(option: str, value: str) -> str:
    """A file every Spark process reads itself (same path on the driver and the executors)."""
    if not value.strip():
        raise OptionError(option, "is empty: give the path of a file readable on the driver and every executor")
    return value.strip()


def _brokers(value: str) -> tuple[str, ...]:
    out: list[str] = []
    for part in value.split(","):
        address = part.strip()
        if not address:
            raise OptionError("broker", f"empty address in {value!r}")
        m = _ADDRESS_RE.match(address)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise OptionError("broker", f"{address!r} is not a host:port address")
        if address not in out:
            out.append(address)
    return tuple(out)


def _topics(value: str) -> tuple[str, ...]:
    out: list[str] = []
    for part in value.split(","):
        topic = part.strip()
        if not topic:
            raise OptionError("subscribe", f"empty topic name in {value!r}")
        if not _TOPIC_RE.match(topic):
            raise OptionError("subscribe", f"{topic!r} is not a valid topic name")
        if topic not in out:
            out.append(topic)
    return tuple(out)


def _boolean(option: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered not in ("true", "false"):
        raise OptionError(option, f"must be true or false, got {value!r}")
    return lowered == "true"


def _positive_int(option: str, value: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise OptionError(option, f"must be a positive integer, got {value!r}") from None
    if number <= 0:
        raise OptionError(option, f"must be a positive integer, got {value!r}")
    return number


def _offset_spec(option: str, value: str, topics: tuple[str, ...], default: int) -> OffsetSpec:
    text = value.strip()
    if text.lower() in ("earliest", "latest"):
        return OffsetSpec(text.lower(), default=default)  # type: ignore[arg-type]
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise OptionError(option, f"must be 'earliest', 'latest' or JSON like "
                                  f'{{"topic": {{"0": 42}}}}, got {value!r}') from None
    if not isinstance(obj, dict):
        raise OptionError(option, f'JSON must be an object like {{"topic": {{"0": 42}}}}, got {value!r}')
    offsets: dict[QueueKey, int] = {}
    for topic, queues in obj.items():
        if topic not in topics:
            raise OptionError(option, f"topic {topic!r} is not in 'subscribe' ({', '.join(topics)})")
        if not isinstance(queues, dict):
            raise OptionError(option, f"topic {topic!r} must map queue ids to offsets, got {queues!r}")
        for queue, offset in queues.items():
            if not (isinstance(queue, str) and queue.isdigit()):
                raise OptionError(option, f"queue id {queue!r} of topic {topic!r} is not a non-negative integer")
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < EARLIEST:
                raise OptionError(option, f"offset of {topic}/{queue} must be an integer >= -2 "
                                          f"(-2 earliest, -1 latest), got {offset!r}")
            offsets[(topic, int(queue))] = offset
    return OffsetSpec("specific", offsets, default)
