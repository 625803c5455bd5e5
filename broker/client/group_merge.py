"""A group's operator views in a cluster of shards (docs/shards.md), put together by the client.

The shard coordinating a group knows its members, its assignment and its committed offsets; each
queue's own shard knows the queue's end and the group's pop leases on it. ``describe_group`` asks
the coordinator, then every other shard for what it holds (``here_only``), and merges them here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from broker.groups import receipts
from proto import tidemark_pb2 as pb

QueueKey = tuple[str, int]


def asked_of(desc: pb.GroupDescription) -> dict[str, list[pb.QueueRef]]:
    """Per shard: the queues whose end the coordinator could not tell (written elsewhere)."""
    out: dict[str, list[pb.QueueRef]] = {}
    for q in desc.queues:
        if q.shard:
            out.setdefault(q.shard, []).append(pb.QueueRef(topic=q.topic, queue_id=q.queue_id))
    return out


def merge_described(desc: pb.GroupDescription, heres: Iterable[pb.GroupDescription]) -> pb.GroupDescription:
    """The coordinator's description with every other shard's answer folded in: each queue's end,
    lag (to the committed offset when there is one), pop leases and dead letters."""
    out = pb.GroupDescription()
    out.CopyFrom(desc)
    queues = {(q.topic, q.queue_id): q for q in out.queues}
    for here in heres:
        if here.shard and here.shard == desc.shard:  # the coordinator's own pop leases are in its answer
            continue
        out.dlq_messages += here.dlq_messages
        out.redeliveries += here.redeliveries
        for h in here.queues:
            q = queues.get((h.topic, h.queue_id))
            if q is None:
                q = queues[(h.topic, h.queue_id)] = out.queues.add(topic=h.topic, queue_id=h.queue_id)
            q.end_offset, q.in_flight, q.pop_offset = h.end_offset, h.in_flight, h.pop_offset
            q.lag = max(0, h.end_offset - q.committed_offset) if q.has_committed else h.lag
            q.shard = ""  # told by its shard
    out.queues.sort(key=lambda q: (q.topic, q.queue_id))
    return out


def merge_listed(answers: Iterable[pb.ListGroupsResponse], ends: Callable[[], dict[str, list[int]]]
                 ) -> list[dict[str, object]]:
    """Every shard's groups as one list: members and lag summed, topics joined; the lag of queues
    whose shard is not the coordinator's added from ``ends()`` (each queue's stable end, asked of
    its own shard: read only when some group has such queues)."""
    merged: dict[str, tuple[int, set[str], int]] = {}
    known: dict[str, list[int]] | None = None
    for resp in answers:
        for g in resp.groups:
            members, topics, lag = merged.get(g.name, (0, set(), 0))
            for o in g.remote_offsets:
                known = ends() if known is None else known
                queue_ends = known.get(o.topic, [])
                lag += max(0, queue_ends[o.queue_id] - o.offset) if o.queue_id < len(queue_ends) else 0
            merged[g.name] = (members + g.members, topics | set(g.topics), lag + g.lag)
    return [{"name": name, "members": m, "topics": sorted(t), "lag": lag} for name, (m, t, lag) in sorted(merged.items())]


def queue_of_handle(handle: str) -> tuple[str, int, int] | None:
    """The (topic, queue, first offset) a receipt handle leases (None: not a handle; its node
    refuses it)."""
    try:
        h = receipts.Decoder().decode(handle)
    except ValueError:
        return None
    return h.topic, h.queue_id, h.offset
