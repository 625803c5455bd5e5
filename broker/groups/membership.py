"""Subscribe-mode membership on the master (DESIGN §12): who is in a group, which queues each
member may hold, and when a queue may move.

Members heartbeat with their subscription and the queues they hold right now (``owned``). The
group's *target* (``assignor.assign``) says who should hold each queue; a member's *grant* (what
its heartbeat answers) is its target queues that it already holds or that nobody else holds. A
queue leaves a member's grant as soon as the target moves it, but reaches its new owner only once
the old owner stopped reporting it (it committed and released it) or its session expired: members
that cooperate never hold a queue at the same time. A queue is *held* by a member while it is in
the member's ``owned`` or in its last grant (an answer may be in flight).

Membership lives in memory on the master only. After a failover or a restart the new master knows
nobody: members rejoin with what they hold (sticky), and for ``rejoin_grace_ms`` after becoming
master it grants no queue that nobody reports holding, so that a member of the old master which
has not yet noticed the change cannot overlap with a new owner.

Nothing here reads a clock, sleeps or knows gRPC: callers pass ``now`` (monotonic seconds), and
``notify`` is told which members' answers changed (the daemon wakes their parked heartbeats).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from broker import metrics
from broker.errors import BrokerError, invalid, shown
from broker.groups.assignor import QueueKey, assign

MemberKey = tuple[str, str]  # (group, member id)
MEMBER_ID_CHARS_MAX = 64


@dataclass
class Member:
    member_id: str
    client_id: str
    topics: frozenset[str]
    session_timeout_ms: int
    deadline: float  # monotonic seconds: expires unless a heartbeat arrives before
    last_heartbeat: float
    owned: set[QueueKey] = field(default_factory=set)
    granted: set[QueueKey] = field(default_factory=set)


@dataclass
class Group:
    name: str
    members: dict[str, Member] = field(default_factory=dict)
    target: dict[QueueKey, str] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  # topic -> queues, as of the last target
    generation: int = 0
    rebalances: int = 0
    mine: dict[str, list[QueueKey]] = field(default_factory=dict)  # member -> its target queues
    held: dict[QueueKey, set[str]] = field(default_factory=dict)  # queue -> members holding it

    def set_held(self, m: Member, owned: set[QueueKey], granted: set[QueueKey]) -> None:
        """Change what ``m`` holds, keeping the ``held`` index exact."""
        before, after = m.owned | m.granted, owned | granted
        for q in before - after:
            holders = self.held.get(q)
            if holders is not None:
                holders.discard(m.member_id)
                if not holders:
                    del self.held[q]
        for q in after - before:
            self.held.setdefault(q, set()).add(m.member_id)
        m.owned, m.granted = owned, granted

    def drop(self, member_id: str) -> None:
        m = self.members.pop(member_id)
        self.set_held(m, set(), set())

    def held_by_other(self, q: QueueKey, member_id: str) -> bool:
        holders = self.held.get(q)
        return holders is not None and (len(holders) > 1 or member_id not in holders)


@dataclass(frozen=True)
class Answer:
    member_id: str
    assigned: frozenset[QueueKey]
    generation: int
    settled: bool  # the member holds exactly its grant: nothing for it to do until something changes


class Membership:
    def __init__(self, queues_of: Callable[[str], int | None], notify: Callable[[set[MemberKey]], None], *,
                 members_max: int, rejoin_grace_ms: int, groups_max: int = 10_000,
                 members_total_max: int = 100_000) -> None:
        """``queues_of``: a topic's queue count (None when it does not exist). ``members_max``
        bounds each group, ``groups_max`` the groups with live members: a flood of one group, or of
        new groups, never keeps a new member of another existing group out."""
        self._queues_of = queues_of
        self._notify = notify
        self.members_max = members_max
        self.groups_max = groups_max
        self.members_total_max = members_total_max
        self.rejoin_grace_ms = rejoin_grace_ms
        self.groups: dict[str, Group] = {}
        self._hold_until = 0.0
        self._lock = threading.Lock()  # heartbeats run on the event loop; describe in worker threads

    # -- role ------------------------------------------------------------------------------------
    def reset(self, now: float, master: bool) -> set[MemberKey]:
        """Forget every member (a role change); a new master holds back grants for the grace period.
        Returns the members whose parked heartbeats must answer now."""
        with self._lock:
            woken = {(g.name, m) for g in self.groups.values() for m in g.members}
            self.groups.clear()
            self._hold_until = now + self.rejoin_grace_ms / 1000.0 if master else 0.0
        return woken

    # -- heartbeats ------------------------------------------------------------------------------
    def heartbeat(self, group: str, member_id: str, topics: Iterable[str], owned: Iterable[QueueKey], *,
                  session_timeout_ms: int, client_id: str, now: float) -> Answer:
        topics = frozenset(topics)
        owned_set = set(owned)
        if member_id and (len(member_id) > MEMBER_ID_CHARS_MAX or not member_id.isprintable()):
            raise invalid(f"invalid member id {shown(member_id)}")
        with self._lock:
            g = self.groups.get(group)
            m = g.members.get(member_id) if g is not None else None
            if g is None or m is None:
                if g is None and len(self.groups) >= self.groups_max:
                    raise BrokerError("RESOURCE_EXHAUSTED", f"this broker serves {self.groups_max} groups with live "
                                      "members (groups.live_groups_max); a new group cannot start")
                if g is not None and len(g.members) >= self.members_max:
                    raise BrokerError("RESOURCE_EXHAUSTED", f"group {shown(group)} has {self.members_max} members "
                                      "(groups.members_max); a new member cannot join")
                if sum(len(x.members) for x in self.groups.values()) >= self.members_total_max:  # at a join only
                    raise BrokerError("RESOURCE_EXHAUSTED", f"this broker serves {self.members_total_max} group members "
                                      "(groups.members_total_max); a new member cannot join")
                if g is None:
                    g = self.groups[group] = Group(group)
                # a member the master does not know (new, or rejoining after a failover) keeps what it
                # holds unless someone else holds it already
                m = Member(member_id or uuid.uuid4().hex, client_id, topics, session_timeout_ms, 0.0, now)
                g.members[m.member_id] = m
                changed = True
            else:
                changed = m.topics != topics
            m.topics, m.client_id, m.session_timeout_ms = topics, client_id, session_timeout_ms
            m.deadline = now + session_timeout_ms / 1000.0
            m.last_heartbeat = now
            released = m.owned - owned_set
            # a released queue is no longer in flight to this member either
            g.set_held(m, owned_set, m.granted - released)
            if changed or self._counts_changed(g):
                self._retarget(g)
            before = m.owned | m.granted
            answer = self._grant(g, m, now)
            let_go = bool(released) or bool(before - (m.owned | m.granted))
            woken = self._waiting_for(g, now, skip=m.member_id) if (let_go or changed) else set()
        self._notify(woken)
        return answer

    def refresh(self, group: str, member_id: str, now: float) -> Answer | None:
        """A parked member's answer now (None: it is no longer a member, e.g. after a role change)."""
        with self._lock:
            g = self.groups.get(group)
            m = g.members.get(member_id) if g is not None else None
            if g is None or m is None:
                return None
            return self._grant(g, m, now)

    def leave(self, group: str, member_id: str) -> None:
        with self._lock:
            g = self.groups.get(group)
            if g is None or member_id not in g.members:
                return
            g.drop(member_id)
            woken = self._after_departure(g, 0.0)
        self._notify(woken)

    def expire(self, now: float) -> list[MemberKey]:
        """Remove members whose session passed; their queues move at once."""
        gone: list[MemberKey] = []
        woken: set[MemberKey] = set()
        with self._lock:
            for g in list(self.groups.values()):
                dead = [mid for mid, m in g.members.items() if m.deadline < now]
                for mid in dead:
                    g.drop(mid)
                    gone.append((g.name, mid))
                if dead:
                    woken |= self._after_departure(g, now)
            if self._hold_until and now >= self._hold_until:  # the grace ended: unheld queues may go now
                self._hold_until = 0.0
                for g in self.groups.values():
                    woken |= self._waiting_for(g, now, skip="")
        self._notify(woken)
        return gone

    def _after_departure(self, g: Group, now: float) -> set[MemberKey]:
        if not g.members:
            del self.groups[g.name]
            return set()
        self._retarget(g)
        return self._waiting_for(g, now, skip="")

    # -- assignment ------------------------------------------------------------------------------
    def _counts_changed(self, g: Group) -> bool:
        topics = {t for m in g.members.values() for t in m.topics}
        return any(self._queues_of(t) != g.counts.get(t) for t in topics) or any(t not in topics for t in g.counts)

    def _retarget(self, g: Group) -> None:
        counts: dict[str, int] = {}
        for t in {t for m in g.members.values() for t in m.topics}:
            n = self._queues_of(t)
            if n is not None:
                counts[t] = n
        current: dict[QueueKey, str] = {}
        for m in g.members.values():  # who holds a queue now wins over the previous target (sticky)
            for q in m.owned | m.granted:
                current.setdefault(q, m.member_id)
        for q, owner in g.target.items():
            current.setdefault(q, owner)
        target = assign(counts, {mid: m.topics for mid, m in g.members.items()}, current)
        g.counts = counts
        g.mine = {}
        for q, owner in target.items():
            g.mine.setdefault(owner, []).append(q)
        if target != g.target:
            moved = any(g.target.get(q) not in (None, owner) for q, owner in target.items())
            g.target = target
            g.generation += 1
            if moved or len(target) < len(current):
                g.rebalances += 1
                metrics.GROUP_REBALANCES.inc()

    def _prospective(self, g: Group, m: Member, now: float) -> set[QueueKey]:
        hold = now < self._hold_until
        return {q for q in g.mine.get(m.member_id, ())
                if q in m.owned or q in m.granted or not (hold or g.held_by_other(q, m.member_id))}

    def _grant(self, g: Group, m: Member, now: float) -> Answer:
        grant = self._prospective(g, m, now)
        g.set_held(m, m.owned, grant)
        return Answer(m.member_id, frozenset(grant), g.generation, settled=grant == m.owned)

    def _waiting_for(self, g: Group, now: float, *, skip: str) -> set[MemberKey]:
        """Members whose answer would now differ from what they hold: they have something to do."""
        return {(g.name, mid) for mid, m in g.members.items()
                if mid != skip and self._prospective(g, m, now) != m.owned}

    def pending(self, group: str, member_id: str, now: float) -> bool:
        with self._lock:
            g = self.groups.get(group)
            m = g.members.get(member_id) if g is not None else None
            return m is None or (g is not None and self._prospective(g, m, now) != m.owned)

    # -- reads -----------------------------------------------------------------------------------
    def describe(self, group: str, now: float) -> dict[str, Any] | None:
        with self._lock:
            g = self.groups.get(group)
            if g is None:
                return None
            members = [{"member_id": m.member_id, "client_id": m.client_id, "topics": sorted(m.topics),
                        "assigned": sorted(m.owned | m.granted), "session_timeout_ms": m.session_timeout_ms,
                        "last_heartbeat_ms_ago": int((now - m.last_heartbeat) * 1000)}
                       for m in g.members.values()]
            owners: dict[QueueKey, str] = {}
            for m in g.members.values():
                for q in m.owned:
                    owners.setdefault(q, m.member_id)
            return {"generation": g.generation, "rebalances": g.rebalances, "members": members, "owners": owners,
                    "topics": sorted(g.counts)}

    def summary(self) -> dict[str, int]:
        """Group name -> live members."""
        with self._lock:
            return {name: len(g.members) for name, g in self.groups.items()}

    def has_members(self, group: str) -> bool:
        with self._lock:
            return bool(self.groups.get(group) and self.groups[group].members)
