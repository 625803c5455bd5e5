"""Streaming offsets: ``{"topic": {"queue": next_offset}}`` and admission control.

An offset names, for each queue of each subscribed topic, the next queue offset to read (the
first one *not* in the batch). Spark stores these JSON objects in the checkpoint and compares
them as strings, so every offset this module emits is in one canonical order: topics sorted by
name, queues by number. In memory an offset is a ``dict[(topic, queue_id), next_offset]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from broker.invariant import invariant

QueueKey = tuple[str, int]
Offsets = dict[QueueKey, int]
EARLIEST = -2  # in startingOffsets/endingOffsets JSON, as in Spark's Kafka source
LATEST = -1


def to_json(offsets: Mapping[QueueKey, int]) -> dict[str, dict[str, int]]:
    """The canonical JSON object of ``offsets`` (sorted topics, numerically sorted queues)."""
    out: dict[str, dict[str, int]] = {}
    for topic, queue in sorted(offsets):
        offset = offsets[(topic, queue)]
        invariant(queue >= 0 and offset >= 0, f"offset {topic}/{queue}={offset} is not resolved")
        out.setdefault(topic, {})[str(queue)] = int(offset)
    return out


def from_json(obj: Any) -> Offsets:
    """Parse an offset Spark hands back (from this module or a checkpoint); strict."""
    if not isinstance(obj, dict):
        raise ValueError(f"tidemark offset must be a JSON object, got {obj!r}")
    out: Offsets = {}
    for topic, queues in obj.items():
        if not isinstance(topic, str) or not isinstance(queues, dict):
            raise ValueError(f"tidemark offset: bad entry {topic!r}: {queues!r}")
        for queue, offset in queues.items():
            if not (isinstance(queue, str) and queue.isdigit()) or isinstance(offset, bool) \
                    or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"tidemark offset: bad queue entry {topic!r}/{queue!r}: {offset!r}")
            out[(topic, int(queue))] = offset
    return out


def cap(latest: Mapping[QueueKey, int], start: Mapping[QueueKey, int], target: Mapping[QueueKey, int]) -> Offsets:
    """``latest`` limited to ``target`` (Trigger.AvailableNow): never past what existed when the
    query run began. A queue the target does not know (created later) does not move."""
    out: Offsets = {}
    for key, offset in latest.items():
        out[key] = min(offset, target.get(key, start.get(key, 0)))
    return out


def admit(start: Mapping[QueueKey, int], latest: Mapping[QueueKey, int], rows_max: int | None) -> Offsets:
    """The end offset of the next batch: ``latest``, or at most ``rows_max`` rows past ``start``.

    The budget is shared in proportion to each queue's backlog (like Spark's Kafka source), but
    the total never exceeds ``rows_max``: each queue gets the floor of its share, and the rows
    left over go one each to the queues with the largest remainders. A queue missing from
    ``start`` is new and starts at 0. A queue whose latest offset is below its start (re-created
    topic) keeps its latest offset; planning reports it as data loss.
    """
    end: Offsets = dict(latest)
    if rows_max is None:
        return end
    invariant(rows_max > 0, f"rows_max must be positive, got {rows_max}")
    backlog = {key: latest[key] - start.get(key, 0) for key in latest if latest[key] > start.get(key, 0)}
    total = sum(backlog.values())
    if total <= rows_max:
        return end
    shares = {key: size * rows_max // total for key, size in backlog.items()}
    left = rows_max - sum(shares.values())
    by_remainder = sorted(backlog, key=lambda k: (-(backlog[k] * rows_max % total), k))
    for key in by_remainder[:left]:
        shares[key] += 1  # a queue with a remainder has share < backlog, so +1 stays within it
    for key, share in shares.items():
        end[key] = start.get(key, 0) + share
    invariant(sum(end[k] - start.get(k, 0) for k in backlog) == rows_max, "admission must use exactly rows_max")
    return end
