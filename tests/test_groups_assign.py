"""Subscribe-mode assignment and membership without a daemon: the assignor's balance and stickiness,
and the coordinator's rule that a queue reaches its new owner only after the old one let it go."""

from __future__ import annotations

import functools
import random

import pytest

from broker.errors import BrokerError
from broker.groups.assignor import assign
from broker.groups.membership import Membership


def test_assignment_is_balanced_and_moves_only_what_must_move() -> None:
    subs = {f"m{i}": frozenset({"t"}) for i in range(3)}
    first = assign({"t": 10}, subs, {})
    counts = sorted(list(first.values()).count(m) for m in subs)
    assert counts == [3, 3, 4] and len(first) == 10
    # a fourth member joins: each queue that moves goes to it, and only as many as its share
    subs["m3"] = frozenset({"t"})
    second = assign({"t": 10}, subs, first)
    moved = [q for q in first if first[q] != second[q]]
    assert all(second[q] == "m3" for q in moved) and len(moved) == list(second.values()).count("m3") == 2
    # a member leaves: only its queues move
    del subs["m1"]
    third = assign({"t": 10}, subs, second)
    assert all(third[q] == second[q] for q in second if second[q] != "m1")
    assert sorted(list(third.values()).count(m) for m in subs) == [3, 3, 4]


def test_members_with_different_subscriptions_and_overall_balance() -> None:
    subs = {"a": frozenset({"x", "y"}), "b": frozenset({"y"}), "c": frozenset({"x", "y", "z"})}
    target = assign({"x": 4, "y": 4, "z": 2, "unknown": 3}, subs, {})
    assert {t for t, _ in target} == {"x", "y", "z"}
    assert all(t in subs[m] for (t, _), m in target.items())
    for topic in ("x", "y", "z"):  # each topic is shared evenly among its subscribers
        load = [sum(1 for (t, _), o in target.items() if t == topic and o == m) for m in subs if topic in subs[m]]
        assert max(load) - min(load) <= 1


class Sim:
    """Cooperative members in simulated time: each applies its answer (takes new queues, releases
    revoked ones) before its next heartbeat, as the client does."""

    def __init__(self, queues: int = 8, grace_ms: int = 0) -> None:
        self.now = 100.0
        self.woken: set[tuple[str, str]] = set()
        self.m = Membership(lambda t: queues if t == "t" else None, self.woken.update, members_max=100,
                            rejoin_grace_ms=grace_ms)
        self.held: dict[str, set[tuple[str, int]]] = {}

    def beat(self, member: str) -> None:
        a = self.m.heartbeat("g", member, ["t"], self.held.get(member, set()), session_timeout_ms=5000,
                             client_id="", now=self.now)
        self.held[a.member_id] = set(a.assigned)  # takes the new, releases the revoked
        self.check()

    def check(self) -> None:
        seen: dict[tuple[str, int], str] = {}
        for mid, qs in self.held.items():
            for q in qs:
                assert q not in seen, f"{q} held by {seen[q]} and {mid} at once"
                seen[q] = mid


def test_a_queue_moves_only_after_its_owner_released_it() -> None:
    sim = Sim()
    sim.beat("a")
    sim.beat("a")
    assert len(sim.held["a"]) == 8
    sim.beat("b")  # joins: its share is still held by a, so it gets nothing yet
    assert sim.held["b"] == set() and ("g", "a") in sim.woken
    sim.beat("a")  # a learns it must release 4 and does
    assert len(sim.held["a"]) == 4
    sim.beat("a")  # reports the release; b is woken to take them
    assert ("g", "b") in sim.woken
    sim.beat("b")
    assert len(sim.held["b"]) == 4


def test_random_joins_leaves_and_expiries_never_share_a_queue() -> None:
    rnd = random.Random(7)
    sim = Sim(queues=16)
    names = [f"m{i}" for i in range(6)]
    for _ in range(3000):
        sim.now += rnd.random() * 0.5
        who = rnd.choice(names)
        r = rnd.random()
        if r < 0.05 and who in sim.held:
            sim.m.leave("g", who)
            sim.held.pop(who)
        elif r < 0.08:
            # a member that crashed: its session expires, the master frees its queues
            sim.held.pop(who, None)
            for g, mid in sim.m.expire(sim.now + 10.0):
                assert g == "g"
                sim.held.pop(mid, None)
            sim.now += 10.0
        else:
            sim.beat(who)
    for name in list(sim.held):  # settle: everyone heartbeats until nothing changes
        sim.beat(name)
    for _ in range(4):
        for name in list(sim.held):
            sim.beat(name)
    assert set().union(*sim.held.values()) == {("t", q) for q in range(16)}


def test_rejoin_grace_holds_back_unreported_queues_but_keeps_reported_ones() -> None:
    sim = Sim(grace_ms=3000)
    sim.m.reset(sim.now, master=True)
    sim.held["old"] = {("t", 0), ("t", 1)}  # a member of the previous master, rejoining with its queues
    sim.beat("old")
    sim.beat("new")
    assert sim.held["old"] >= {("t", 0)} and sim.held["new"] == set()
    sim.now += 3.1
    sim.m.expire(sim.now)
    sim.beat("new")
    sim.beat("old")
    sim.beat("old")
    sim.beat("new")
    assert len(sim.held["new"]) == 4 and len(sim.held["old"]) == 4


def test_members_max_and_bad_member_ids() -> None:
    """``members_max`` bounds each group and ``groups_max`` the groups: a full group, or as many
    groups as allowed, never keeps a new member of another existing group out (issue 35, finding 8)."""
    m = Membership(lambda t: 1, lambda keys: None, members_max=2, rejoin_grace_ms=0, groups_max=2)
    beat = functools.partial(m.heartbeat, topics=["t"], owned=[], session_timeout_ms=1000, client_id="", now=0.0)
    beat("g", "")
    beat("g", "")
    beat("h", "")
    for group in ("g", "k"):  # g is full; k would be a third group
        with pytest.raises(BrokerError) as exc:
            beat(group, "")
        assert exc.value.code == "RESOURCE_EXHAUSTED"
    beat("h", "")  # h still takes a member
    with pytest.raises(BrokerError) as exc:
        m.heartbeat("g", "x" * 65, ["t"], [], session_timeout_ms=1000, client_id="", now=0.0)
    assert exc.value.code == "INVALID_ARGUMENT"
