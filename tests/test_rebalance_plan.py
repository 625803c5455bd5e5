"""The rebalance plan (replication/coordination/rebalance.py): the fewest moves that even the
live shards out, all of a draining shard's queues away, each topic kept spread."""

from __future__ import annotations

import pytest

from replication.coordination import placement as pl
from replication.coordination.rebalance import plan


def _topics(layout: dict[str, list[str]]) -> dict[str, pl.Placement]:
    return {t: pl.Placement(tuple((pl.Segment(s),) for s in shards)) for t, shards in layout.items()}


def _after(placements: dict[str, pl.Placement], moves: list) -> dict[str, int]:  # type: ignore[type-arg]
    owners = {(t, q): p.last(q).to or p.owner(q) for t, p in placements.items() for q in range(p.queues)}  # sealing: where it goes
    for m in moves:
        assert placements[m.topic].owner(m.queue) == m.source
        owners[(m.topic, m.queue)] = m.target
    counts: dict[str, int] = {}
    for s in owners.values():
        counts[s] = counts.get(s, 0) + 1
    return counts


def test_a_third_shard_takes_a_third_with_the_fewest_moves_and_topics_stay_spread() -> None:
    placements = _topics({f"t{i}": ["s1", "s2"] * 8 for i in range(8)})  # 8 topics x 16 queues on two shards
    moves = plan(placements, ["s1", "s2", "s3"], set())
    assert len(moves) == 42  # 128 queues: 43, 43, 42; s3 receives 42, the fewest that even it out
    assert _after(placements, moves) == {"s1": 43, "s2": 43, "s3": 42}
    for t in placements:  # each topic over all three shards, 5 or 6 queues each
        got = [m for m in moves if m.topic == t]
        assert 5 <= len(got) <= 6
    assert plan(_topics({"t": ["s1", "s2", "s3"]}), ["s1", "s2", "s3"], set()) == []  # even already: nothing


def test_a_draining_shard_gives_up_everything_and_dead_or_moving_queues_stay() -> None:
    placements = _topics({"a": ["s1", "s2", "s3", "s1"], "b": ["s3", "s3"], "dead": ["s4"]})
    moving = placements["a"].with_last(1, pl.Segment("s2", 0, "sealing", to="s1"))
    placements["a"] = moving
    moves = plan(placements, ["s1", "s2", "s3"], {"s3"})
    assert {m.source for m in moves} == {"s3"} and len(moves) == 3
    counts = _after(placements, moves)
    assert counts.get("s3", 0) == 0 and counts["s4"] == 1  # a shard without a master keeps its queue
    assert abs(counts["s1"] - counts["s2"]) <= 1
    with pytest.raises(ValueError):
        plan(placements, ["s3"], {"s3"})


def test_queues_being_moved_count_where_they_go() -> None:
    """A rebalance asked while an earlier one's moves are under way does not move more than needed."""
    placements = _topics({"t": ["s1"] * 6})
    half = plan(placements, ["s1", "s2"], set())
    assert len(half) == 3
    for m in half[:2]:  # two of them sealing now, toward s2
        placements[m.topic] = placements[m.topic].with_last(m.queue, pl.Segment("s1", 0, "sealing", to="s2"))
    again = plan(placements, ["s1", "s2"], set())
    assert len(again) == 1 and again[0].target == "s2"
