"""What the broker holds for the subscribed topics: queues, latest and earliest offsets.

Driver-side only (planning). ``list_topics(include_system=True)`` gives each queue's next offset
below the confirm offset; a pull at that offset answers the queue's earliest retained offset
(``min_offset``) without returning a record (``earliest_offset``: a queue that moved is probed on
its oldest segment's shard). Every lookup is one call; nothing is cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.client import BrokerClient
from spark_connector.offsets import EARLIEST, LATEST, Offsets
from spark_connector.options import OffsetSpec, OptionError


def latest_offsets(client: BrokerClient, topics: Sequence[str], *, missing_ok: bool) -> Offsets:
    """Next offset of every queue of ``topics`` a read_committed reader may read up to (its LSO,
    DESIGN §14: a stream never plans past an open transaction); an absent topic is an error unless
    ``missing_ok`` (a running stream then plans the loss of its queues)."""
    listed = client.list_topics(include_system=True)
    missing = [t for t in topics if t not in listed]
    if missing and not missing_ok:
        raise OptionError("subscribe", f"unknown topic(s) {', '.join(map(repr, missing))} on {client.addresses[0]}")
    out: Offsets = {}
    for topic in topics:
        if topic in listed:
            for queue_id, offset in enumerate(listed[topic]["stable_offsets"]):
                out[(topic, queue_id)] = int(offset)
    return out


def earliest_offsets(client: BrokerClient, latest: Offsets) -> Offsets:
    """Earliest retained offset of each queue in ``latest`` (one probe pull per queue; a queue that
    moved between shards: its oldest segment still holding records, docs/shards.md)."""
    return {(topic, q): client.earliest_offset(topic, q, offset) for (topic, q), offset in latest.items()}


def resolve(option: str, spec: OffsetSpec, latest: Offsets, client: BrokerClient) -> Offsets:
    """Concrete offsets of ``spec`` for every queue in ``latest``."""
    for topic, q in spec.offsets:
        if (topic, q) not in latest:
            queues = sum(1 for t, _ in latest if t == topic)
            raise OptionError(option, f"topic {topic!r} has {queues} queue(s); queue {q} does not exist")
    if spec.kind == "latest":
        return dict(latest)
    wanted = {key: spec.offsets.get(key, spec.default) for key in latest} if spec.kind == "specific" \
        else dict.fromkeys(latest, EARLIEST)
    earliest = earliest_offsets(client, {k: latest[k] for k, v in wanted.items() if v == EARLIEST})
    out: Offsets = {}
    for key, value in wanted.items():
        if value == EARLIEST:
            out[key] = earliest[key]
        elif value == LATEST:
            out[key] = latest[key]
        elif value > latest[key]:
            raise OptionError(option, f"offset {value} of {key[0]}/{key[1]} is beyond the queue's end ({latest[key]})")
        else:
            out[key] = value
    return out
