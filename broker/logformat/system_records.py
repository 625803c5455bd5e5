"""Records of the ``__metadata`` system topic: metadata changes as JSON bodies.

Each record's key is the change type; its body is a JSON object. Types:

- ``topic.create``   ``{"topic": str, "queues": int}``
- ``topic.delete``   ``{"topic": str}``
- ``offsets.commit`` ``{"offsets": [[group, topic, queue, offset], ...]}`` (one batched record)
- ``tiered.uploaded`` ``{"start": int, "end": int, "epoch": int, "crc32c": str, "key": str}``
  (one per uploaded object; the tiered uploaded offset is the highest ``end``)
- ``queue.seal``     ``{"topic": str, "queue": int, "end": int}``: a move (docs/shards.md) sealed the
  queue in this log at logical offset ``end`` (exclusive); no write takes it until a ``queue.start``
- ``queue.start``    ``{"topic": str, "queue": int, "start": int}``: the queue's writable segment is
  in this log from logical offset ``start`` (its next queue offset jumps there; a seal is lifted)

Spec: docs/formats/metadata-records.md.
"""

from __future__ import annotations

import json
import re
from typing import Any

METADATA_TOPIC = "__metadata"
SYSTEM_PREFIX = "__"
DLQ_SUFFIX = ".dlq"  # <group>.dlq: the dead letters of pop group <group>, and nothing else (DESIGN §12)
TIMER_TOPIC = "__timer"  # records: broker/timers/records.py
POP_TOPIC = "__pop"  # records: broker/logformat/pop_records.py
TXN_TOPIC = "__txn"  # records: broker/logformat/txn_records.py
SYSTEM_TOPICS = (METADATA_TOPIC, TIMER_TOPIC, POP_TOPIC, TXN_TOPIC)
TOPIC_CREATE = "topic.create"
TOPIC_DELETE = "topic.delete"
OFFSETS_COMMIT = "offsets.commit"
TIERED_UPLOADED = "tiered.uploaded"
QUEUE_SEAL = "queue.seal"
QUEUE_START = "queue.start"

TOPIC_CHANGES = (TOPIC_CREATE, TOPIC_DELETE, QUEUE_SEAL, QUEUE_START)  # what the queue views and the append side apply
TOPIC_CHANGE_KEYS = tuple(c.encode() for c in TOPIC_CHANGES)
_TOPIC_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,126}")  # matched whole (fullmatch)
QUEUES_MAX = 1024
CREATE_TOPICS_MAX = 1000  # topics per CreateTopics call: one metadata batch of at most ~100 KiB


def topic_name_error(name: str) -> str | None:
    """Why ``name`` is not a valid user topic name, or None when it is."""
    if name.startswith(SYSTEM_PREFIX):
        return f"topic name {name[:200]!r} is reserved: names starting with '__' are system topics"
    if not _TOPIC_RE.fullmatch(name):
        return f"invalid topic name {name[:200]!r}: use 1-127 of [A-Za-z0-9._-], starting alphanumeric"
    return None


def encode(change_type: str, fields: dict[str, Any]) -> tuple[bytes, bytes]:
    """(key, body) of one metadata record."""
    return change_type.encode(), json.dumps(fields, separators=(",", ":")).encode()


def decode(key: bytes | memoryview, body: bytes | memoryview) -> tuple[str, dict[str, Any]]:
    return bytes(key).decode(), json.loads(bytes(body))
