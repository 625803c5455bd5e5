"""The placement record and how new topics' queues are spread over shards (docs/shards.md)."""

from __future__ import annotations

import json

import pytest

from replication.coordination import placement as pl
from replication.coordination import slots as sl
from replication.coordination.records import RecordError


def test_queues_go_to_the_shards_with_the_fewest_first() -> None:
    placed = pl.spread({"s1": 0, "s2": 0}, [("orders", 16)])["orders"]
    assert [len(placed.queues_of(s)) for s in ("s1", "s2")] == [8, 8]
    # a shard that joins late takes new queues until it has caught up
    placed = pl.spread({"s1": 10, "s2": 10, "s3": 0}, [("a", 8), ("b", 8)])
    owners = [p.owner(q) for p in placed.values() for q in range(p.queues)]
    assert owners.count("s3") == 12 and owners.count("s1") == 2 and owners.count("s2") == 2
    with pytest.raises(ValueError):
        pl.spread({}, [("x", 1)])


def test_a_placement_round_trips_and_a_bad_one_is_never_trusted() -> None:
    p = pl.Placement(((pl.Segment("s1"),), (pl.Segment("s1", 0, "ro", end=40), pl.Segment("s2", 40))))
    back = pl.decode(pl.encode(p))
    assert back == p and back.owner(1) == "s2" and back.shards() == {"s1", "s2"}
    for raw in (b"not json", b'{"queues": 2, "segments": [[{"shard": "s1", "logical_start": 0, "state": "rw"}]]}',
                b'{"queues": 1, "segments": [[{"shard": "s1", "logical_start": 0, "state": "gone"}]]}',
                b'{"queues": 1, "segments": [[]]}', b'{"queues": 1}',
                b'{"queues": 1, "segments": [[{"shard": "s1", "logical_start": 0, "state": "rw", "pop_groups": "g"}]]}'):
        with pytest.raises(RecordError):
            pl.decode(raw)


def test_group_slots_are_stable_spread_and_strictly_parsed() -> None:
    assert sl.slot_of("orders-consumers") == sl.slot_of("orders-consumers")
    assert len({sl.slot_of(f"g{i}") for i in range(2000)}) == sl.SLOTS, "groups spread over every slot"
    assert sl.pick({"s1": 3, "s2": 1}, ["s1", "s2", "s3"]) == "s3", "a shard with none takes the next slot"
    assert sl.pick({"s1": 2, "s2": 2}, ["s2", "s1"]) == "s1", "ties to the lowest name"
    assert sl.pick({"s1": 0}, ["s2"]) == "s2", "only shards with a master"
    with pytest.raises(ValueError):
        sl.pick({}, [])
    assert sl.decode(sl.encode("s7")) == "s7"
    for bad in (b"{}", b"[]", b'{"shard": ""}', b'{"shard": 3}', b"\xff"):
        with pytest.raises(RecordError):
            sl.decode(bad)
    assert [sl.parse_key(k) for k in ("slots/0", "slots/255", "slots/256", "slots/07", "slots/x", "topics/slots/1")] == [
        0, 255, None, None, None, None]


def test_a_move_seals_the_last_segment_then_continues_on_the_target() -> None:
    p = pl.Placement(((pl.Segment("s1"),), (pl.Segment("s2"),)))
    moving = pl.sealing(p, 0, "s3")
    assert moving.owner(0) == "s1" and moving.moving() == [(0, pl.Segment("s1", 0, "sealing", to="s3"))]
    done = pl.switched(moving, 0, 120)
    assert done.segments[0] == (pl.Segment("s1", 0, "ro", end=120), pl.Segment("s3", 120, fresh=True))
    assert done.owner(0) == "s3" and done.moving() == [] and done.queues_of("s1") == []
    assert pl.decode(pl.encode(done)) == done and pl.decode(pl.encode(moving)) == moving
    back = pl.switched(pl.sealing(done, 0, "s1"), 0, 200)  # and back again
    assert [(s.shard, s.logical_start, s.end) for s in back.segments[0]] == [("s1", 0, 120), ("s3", 120, 200),
                                                                           ("s1", 200, None)]
    # reads go to the segment holding the offset; past every end, to the writable one
    assert [back.segment_at(0, o).shard for o in (0, 119, 120, 199, 200, 10**9)] == ["s1", "s1", "s3", "s3", "s1", "s1"]


def test_a_move_carries_the_queues_pop_groups_to_its_segment_and_keeps_them_there() -> None:
    p = pl.Placement(((pl.Segment("s1"),),))
    away = pl.switched(pl.sealing(p, 0, "s2"), 0, 120, None, ["g2", "g1"])
    assert away.segments[0][1].pop_groups == ("g1", "g2") and pl.decode(pl.encode(away)) == away
    # back: the sealed segment's groups and the windows on its shard; the earlier segments keep theirs
    back = pl.switched(pl.sealing(away, 0, "s1"), 0, 200, [[7, 0, 1, 199, 199]], ["g3", "g1"])
    first, there, home = back.segments[0]
    assert there.pop_groups == ("g1", "g2") and home.pop_groups == ("g1", "g2", "g3") and not home.pop_all
    assert pl.decode(pl.encode(back)) == back
    assert there.begins_pops_of("g1") and not there.begins_pops_of("g3") and not first.begins_pops_of("g1")
    settled = back.with_last(0, home.unlisted())
    assert settled.last(0).producers == () and settled.last(0).pop_groups == home.pop_groups
    # more than can be listed: every group new to the segment begins at its start, and so on after
    many = pl.switched(pl.sealing(p, 0, "s2"), 0, 50, None, [f"g{i}" for i in range(pl.POP_GROUPS_CARRIED_MAX + 1)])
    crowded = many.segments[0][1]
    assert crowded.pop_all and crowded.pop_groups == () and crowded.begins_pops_of("anyone")
    assert pl.switched(pl.sealing(many, 0, "s3"), 0, 60).segments[0][2].pop_all
    assert len(pl.encode(many)) < 200, "a crowded segment lists no names"


def test_the_pop_group_names_of_a_record_stay_bounded_over_many_moves() -> None:
    p = pl.Placement(((pl.Segment("s1"),), (pl.Segment("s2"),)))
    names = [f"{i:03d}-" + "g" * 100 for i in range(pl.POP_GROUPS_CARRIED_MAX)]
    for move in range(40):  # queue 0 back and forth, each move carrying 64 long names
        p = pl.switched(pl.sealing(p, 0, "s2" if move % 2 == 0 else "s1"), 0, 10 * (move + 1), None, names)
    segs = p.segments[0]
    assert len(segs) == 41 and len(pl.encode(p)) < pl.POP_NAMES_BYTES_MAX + 16 * 1024
    assert segs[-1].pop_groups == tuple(names), "the newest segments keep their lists"
    assert segs[1].pop_all and segs[1].pop_groups == (), "the oldest lists became pop_all: never a loss"
    assert not segs[0].pop_all, "the queue's first segment never begins a group by a move"


@pytest.mark.parametrize("segments", [
    [{"shard": "a", "logical_start": 0, "state": "rw"}, {"shard": "b", "logical_start": 5, "state": "rw"}],
    [{"shard": "a", "logical_start": 0, "state": "ro"}],
    [{"shard": "a", "logical_start": 0, "state": "sealing"}],
    [{"shard": "a", "logical_start": 0, "state": "sealing", "to": "a"}],
    [{"shard": "a", "logical_start": 0, "state": "ro", "end": 5}, {"shard": "b", "logical_start": 6, "state": "rw"}],
    [{"shard": "a", "logical_start": 3, "state": "rw"}],
    [{"shard": "a", "logical_start": 0, "state": "rw", "end": 4}],
    [{"shard": "a", "logical_start": 0, "state": "ro", "end": "x"}, {"shard": "b", "logical_start": 0, "state": "rw"}],
])
def test_segments_that_do_not_chain_are_never_trusted(segments: list[dict[str, object]]) -> None:
    with pytest.raises(RecordError):
        pl.decode(json.dumps({"v": 1, "queues": 1, "segments": [segments]}).encode())
