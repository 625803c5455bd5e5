"""Where a topic's queues live in a cluster of shards (docs/shards.md): the record etcd keeps at
``/tidemark/<cluster>/topics/<topic>`` and how the queues of new topics are spread.

A topic has a fixed number of queues; each queue is a list of **segments** ``{shard,
logical_start, state}`` (``rw``: writable, ``ro``: sealed by a move). Today every queue has one
segment; a move (issue 39) seals the last and appends one, so the writable owner is always the
last segment's shard. A deleted topic's record stays as a tombstone (``"deleted": true``): each
shard's master deletes the topic from its log, and no master ever adopts it back as unplaced.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from replication.coordination.records import FORMAT_VERSION, RecordError

STATES = ("rw", "ro")


@dataclass(frozen=True)
class Segment:
    shard: str
    logical_start: int = 0
    state: str = "rw"


@dataclass(frozen=True)
class Placement:
    segments: tuple[tuple[Segment, ...], ...]  # per queue, oldest first
    deleted: bool = False  # a tombstone: each shard's master deletes the topic from its log

    @property
    def queues(self) -> int:
        return len(self.segments)

    def owner(self, queue: int) -> str:
        """The shard that writes ``queue`` (its last segment's)."""
        return self.segments[queue][-1].shard

    def shards(self) -> set[str]:
        return {s.shard for q in self.segments for s in q}

    def queues_of(self, shard: str) -> list[int]:
        return [q for q in range(self.queues) if self.owner(q) == shard]


def encode(p: Placement) -> bytes:
    body: dict[str, Any] = {"v": FORMAT_VERSION, "queues": p.queues,
                            "segments": [[{"shard": s.shard, "logical_start": s.logical_start, "state": s.state}
                                          for s in q] for q in p.segments]}
    if p.deleted:
        body["deleted"] = True
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes) -> Placement:
    try:
        body = json.loads(raw)
        queues = int(body["queues"])
        segments = tuple(tuple(Segment(str(s["shard"]), int(s["logical_start"]), str(s["state"])) for s in q)
                         for q in body["segments"])
        deleted = body.get("deleted", False) is True
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"not a placement: {exc}") from None
    if queues != len(segments) or queues < 1 or any(not q for q in segments):
        raise RecordError(f"a placement of {queues} queues lists {len(segments)}, or a queue without a segment")
    if any(s.state not in STATES or not s.shard for q in segments for s in q):
        raise RecordError("a segment without a shard, or in a state other than rw or ro")
    return Placement(segments, deleted)


def spread(held: dict[str, int], topics: list[tuple[str, int]]) -> dict[str, Placement]:
    """The queues of new ``topics`` ((name, queue count), in order) over the shards of ``held``
    (each live shard: the queues it writes now): each queue to the shard that holds the fewest at
    that moment, ties to the lowest name. 16 queues over two even shards: 8 and 8; a new shard
    takes new queues until it has caught up."""
    if not held:
        raise ValueError("no live shard to place queues on")
    counts = dict(held)
    out: dict[str, Placement] = {}
    for topic, n in topics:
        per_queue = []
        for _ in range(n):
            shard = min(counts, key=lambda s: (counts[s], s))
            counts[shard] += 1
            per_queue.append((Segment(shard),))
        out[topic] = Placement(tuple(per_queue))
    return out
