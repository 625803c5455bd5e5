"""Which queues to move to even out a cluster of shards (docs/shards.md "Rebalance and drain").

Only writable queues of shards with a master can move (a move needs the source's master to seal
it); a queue being moved already is left alone and counted on the shard it goes to. Each target shard (live, not draining) should write
``total // targets`` queues, the ``total % targets`` shards holding the most now one more (so
fewer queues move); a draining shard should write none. The moves are the excess of each shard
over its share: the fewest that even the shards out. Which queue a shard gives up, and to whom: one
of the topic it holds the most more of than a target does, to that target, so each topic stays
spread. (Planning costs moves x topics x targets: fine for thousands of topics.)
"""

from __future__ import annotations

from dataclasses import dataclass

from replication.coordination import placement as pl


@dataclass(frozen=True)
class Move:
    topic: str
    queue: int
    source: str
    target: str


def plan(placements: dict[str, pl.Placement], live: list[str], draining: set[str]) -> list[Move]:
    """The moves that even out the live shards' writable queues (all of a draining shard's away)."""
    targets = sorted(s for s in live if s not in draining)
    if not targets:
        raise ValueError("no shard with a master that is not draining: nowhere to move queues to")
    held: dict[str, list[tuple[str, int]]] = {s: [] for s in live}
    arriving: dict[str, int] = {}  # queues being moved now: counted where they go, never moved again
    for topic in sorted(placements):
        p = placements[topic]
        for q in range(p.queues):
            last = p.last(q)
            if last.state == "rw" and last.shard in held:
                held[last.shard].append((topic, q))
            elif last.state == "sealing" and last.to in held:
                arriving[last.to] = arriving.get(last.to, 0) + 1
    total = sum(len(v) for v in held.values()) + sum(arriving.values())
    base, extra = divmod(total, len(targets))
    def count(s: str) -> int:
        return len(held[s]) + arriving.get(s, 0)

    by_count = sorted(targets, key=lambda s: (-count(s), s))
    share = {s: base + (1 if i < extra else 0) for i, s in enumerate(by_count)}
    share.update({s: 0 for s in live if s in draining})
    per_topic: dict[tuple[str, str], int] = {}  # (shard, topic) -> the topic's queues it writes
    for shard, queues in held.items():
        for topic, _ in queues:
            per_topic[(shard, topic)] = per_topic.get((shard, topic), 0) + 1
    deficit = {s: share[s] - count(s) for s in targets if share[s] > count(s)}
    moves: list[Move] = []
    for source in sorted(live, key=lambda s: (s not in draining, s)):
        queues = list(held[source])
        for _ in range(count(source) - share[source]):
            if not queues or not deficit:
                break
            topics = {t for t, _ in queues}
            # the topic this source holds the most more of than a target does, to that target
            _, topic, target = max((per_topic[(source, t)] - per_topic.get((s, t), 0), t, s)
                                   for t in topics for s in deficit)
            q = max(qq for t, qq in queues if t == topic)
            queues.remove((topic, q))
            moves.append(Move(topic, q, source, target))
            per_topic[(source, topic)] -= 1
            per_topic[(target, topic)] = per_topic.get((target, topic), 0) + 1
            deficit[target] -= 1
            if not deficit[target]:
                del deficit[target]
    return moves
