"""Operator views of consumer groups and topics (DESIGN §12, §8): list and describe groups, reset a
group's offsets, describe a topic. Request checks live here too, so the service only maps calls."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from broker.errors import BrokerError, invalid, not_found, shown
from broker.groups.assignor import QueueKey
from broker.groups.membership import Membership
from broker.logformat import system_records
from broker.store import Store
from proto import tidemark_pb2 as pb

GROUP_BYTES_MAX = 255
TOPICS_PER_MEMBER_MAX = 1000
SESSION_TIMEOUT_MS_MIN = 500
SESSION_TIMEOUT_MS_MAX = 600_000


class PopState(Protocol):
    """What pop mode shows about a group (its coordinator implements this)."""

    def describe(self, group: str) -> dict[str, Any]: ...

    def groups(self) -> set[str]: ...


def check_group(group: str) -> None:
    if not group or len(group.encode()) > GROUP_BYTES_MAX or "\0" in group or not group.isprintable():
        raise invalid(f"invalid group name {shown(group)}")


def _member(member_id: str, shown_whole: bool) -> str:
    """A member id as a caller may see it: whole (admin), or a stable stand-in of its hash."""
    if shown_whole or not member_id:
        return member_id
    return "h:" + hashlib.sha256(member_id.encode()).hexdigest()[:8]


class GroupAdmin:
    def __init__(self, store: Store, membership: Membership) -> None:
        self.store = store
        self.membership = membership
        self.pops: PopState | None = None
        self._commit_lock = threading.Lock()

    # -- a cluster of shards (docs/shards.md): a group's coordinator shard, queues over every shard --
    def check_coordinator(self, group: str) -> None:
        """Raise unless this node's shard coordinates ``group`` (a one-pair cluster always does)."""
        check_group(group)
        if self.store.placement is not None:
            self.store.placement.check_group(group)

    def queue_count(self, topic: str) -> int | None:
        """The topic's queues over every shard (None: no such topic)."""
        placement = self.store.placement
        if placement is not None and (n := placement.queue_count(topic)) is not None:
            return n
        info = self.store.views.metadata.topic(topic)
        return int(info["queues"]) if info is not None else None

    def _remote(self, topic: str, queue: int) -> bool:
        """Another shard writes this queue: its offsets are not known here."""
        return self.store.placement is not None and not self.store.placement.is_local(topic, queue)

    def _remote_kept(self, topic: str, queue: int) -> bool:
        """``_remote``, and then its offsets can be kept here: UNAVAILABLE while this shard's log does
        not hold the topic yet (the log keeps offsets only of topics it holds)."""
        if not self._remote(topic, queue):
            return False
        assert self.store.placement is not None
        self.store.placement.check_in_log(topic)
        return True

    def check_queue(self, topic: str, queue: int) -> None:
        """NOT_FOUND / INVALID_ARGUMENT unless the queue exists (on any shard); UNAVAILABLE while
        this shard's log does not hold a placed topic yet (its master creates it a moment after etcd
        places it: retried by clients, never a NOT_FOUND)."""
        if self.store.placement is not None:
            self.store.placement.check_in_log(topic)
        if not self._remote(topic, queue):
            self.store.reads.queue_bounds(topic, queue)

    def _shards_of(self, topic: str) -> list[str]:
        """Each queue's shard ([] when the topic is not placed)."""
        owners = self.store.placement.owners(topic) if self.store.placement is not None else None
        return [shard for shard, _ in owners or ()]

    def _shard_of(self, topic: str, queue: int) -> str:
        shards = self._shards_of(topic)
        return shards[queue] if queue < len(shards) else ""

    # -- request checks ----------------------------------------------------------------------------
    def check_heartbeat(self, request: pb.HeartbeatRequest) -> tuple[str, list[str], list[QueueKey], int]:
        self.check_coordinator(request.group)
        if len(request.topics) > TOPICS_PER_MEMBER_MAX or len(request.owned) > system_records.QUEUES_MAX * 64:
            raise invalid(f"a member subscribes to at most {TOPICS_PER_MEMBER_MAX} topics")
        topics = list(dict.fromkeys(request.topics))
        if not request.leave and not topics:
            raise invalid("a heartbeat names the topics the member subscribes to")
        for t in topics:
            if t.startswith(system_records.SYSTEM_PREFIX):
                raise invalid(f"system topic {shown(t)} cannot be consumed by a group")
            err = system_records.topic_name_error(t)
            if err:
                raise invalid(err)
        # a subscription keeps the topics that exist now (every heartbeat carries it whole: a topic
        # created later joins it at the member's next heartbeat); made-up names cost no memory
        topics = [t for t in topics if self.queue_count(t) is not None] or topics[:1]
        session_ms = request.session_timeout_ms or self.store.config["groups.session_timeout_ms"]
        if not SESSION_TIMEOUT_MS_MIN <= session_ms <= SESSION_TIMEOUT_MS_MAX:
            raise invalid(f"session_timeout_ms must be {SESSION_TIMEOUT_MS_MIN}..{SESSION_TIMEOUT_MS_MAX}, "
                          f"got {session_ms}")
        return request.group, topics, self._owned(request.owned), session_ms

    def _owned(self, refs: Iterable[pb.QueueRef]) -> list[QueueKey]:
        """The queues a member says it holds, kept only where they exist (each once): what a member
        can claim is bounded by the queues there are, not by what it sends (65,536 references to
        long made-up names were kept for its session). A queue of a deleted topic is held by nobody."""
        queues: dict[str, int | None] = {}
        owned: dict[QueueKey, None] = {}
        for r in refs:
            if r.topic not in queues:
                if len(queues) >= TOPICS_PER_MEMBER_MAX * 4:  # names beyond any member's: not looked up
                    continue
                queues[r.topic] = self.queue_count(r.topic)
            count = queues[r.topic]
            if count is not None and 0 <= r.queue_id < count:
                owned[(r.topic, r.queue_id)] = None
        return list(owned)

    # -- reads -------------------------------------------------------------------------------------
    def _committed(self, group: str) -> dict[QueueKey, int]:
        return {(t, q): o for g, t, q, o in self._all_committed() if g == group}

    def _all_committed(self) -> list[tuple[str, str, int, int]]:
        """Committed offsets: the metadata view's, overlaid with commits still in the offset buffer."""
        out = {(g, t, q): o for g, t, q, o in self.store.views.metadata.group_offsets()}
        out.update(self.store.offsets.buffered())
        placement = self.store.placement  # a group whose slot moved away: its offsets here are the past
        return [(g, t, q, o) for (g, t, q), o in out.items() if placement is None or placement.coordinates(g)]

    def _bounds(self, topic: str, queue: int) -> tuple[int, int] | None:
        """(low, LSO): groups read committed messages, so their lag runs to the LSO."""
        try:
            return self.store.reads.committed_bounds(topic, queue)
        except BrokerError:  # the topic was deleted
            return None

    def list_groups(self) -> list[pb.GroupSummary]:
        members = self.membership.summary()
        topics: dict[str, set[str]] = {g: set() for g in members}
        lag: dict[str, int] = dict.fromkeys(members, 0)
        remote: dict[str, list[pb.CommittedOffset]] = {}
        for g, t, q, o in self._all_committed():
            topics.setdefault(g, set()).add(t)
            if self._remote(t, q):  # a cluster of shards: its end is another shard's (the client adds the lag)
                remote.setdefault(g, []).append(pb.CommittedOffset(group=g, topic=t, queue_id=q, offset=o))
                continue
            bounds = self._bounds(t, q)
            lag[g] = lag.get(g, 0) + (max(0, bounds[1] - o) if bounds else 0)
        if self.pops is not None:
            for g in self.pops.groups():
                topics.setdefault(g, set())
                for (t, _), info in self.pops.describe(g)["queues"].items():
                    topics[g].add(t)
                    lag[g] = lag.get(g, 0) + int(info.get("lag", 0))
        return [pb.GroupSummary(name=g, members=members.get(g, 0), topics=sorted(topics[g]), lag=lag.get(g, 0),
                                remote_offsets=remote.get(g, ())) for g in sorted(topics)]

    def describe(self, group: str, *, member_ids: bool = True) -> pb.GroupDescription:
        """``member_ids``: the caller may see them (admin). A member id is what a heartbeat or a
        leave names a member by; others see a stable stand-in (``h:`` and 8 hex digits of its hash)."""
        self.check_coordinator(group)
        live = self.membership.describe(group, time.monotonic())
        committed = self._committed(group)
        pop = self.pops.describe(group) if self.pops is not None and group in self.pops.groups() else None
        if live is None and not committed and pop is None:
            raise not_found(f"group {shown(group)} has no members, no committed offsets and no pop state")
        desc = pb.GroupDescription(name=group, shard=self.store.placement.shard if self.store.placement else "")
        owners: dict[QueueKey, str] = {}
        queues: set[QueueKey] = set(committed)
        if live is not None:
            desc.generation, desc.rebalances = live["generation"], live["rebalances"]
            owners = live["owners"]
            for m in live["members"]:
                desc.members.add(member_id=_member(m["member_id"], member_ids), client_id=m["client_id"], topics=m["topics"],
                                 assigned=[pb.QueueRef(topic=t, queue_id=q) for t, q in m["assigned"]],
                                 session_timeout_ms=m["session_timeout_ms"],
                                 last_heartbeat_ms_ago=m["last_heartbeat_ms_ago"])
            queues |= self._all_queues(live["topics"])
        pop_queues: dict[QueueKey, dict[str, int]] = pop["queues"] if pop is not None else {}
        queues |= set(pop_queues)
        shards: dict[str, list[str]] = {}  # topic -> each queue's shard (looked up once per topic)
        for t, q in sorted(queues):
            c = committed.get((t, q))
            if self._remote(t, q):  # another shard's queue: its end and lag are told there (the client asks)
                if t not in shards:
                    shards[t] = self._shards_of(t)
                desc.queues.add(topic=t, queue_id=q, has_committed=c is not None, committed_offset=c or 0,
                                owner=_member(owners.get((t, q), ""), member_ids),
                                shard=shards[t][q] if q < len(shards[t]) else "")
                continue
            bounds = self._bounds(t, q)
            if bounds is None:
                continue
            low, high = bounds
            info = pop_queues.get((t, q), {})
            lag = int(info["lag"]) if info and c is None else max(0, high - (c if c is not None else low))
            desc.queues.add(topic=t, queue_id=q, has_committed=c is not None, committed_offset=c or 0,
                            end_offset=high, lag=lag,
                            owner=_member(owners.get((t, q), ""), member_ids), in_flight=int(info.get("in_flight", 0)),
                            pop_offset=int(info.get("pop_offset", 0)))
        if pop is not None:
            desc.dlq_messages = int(pop.get("dlq_messages", 0))
            desc.redeliveries = int(pop.get("redeliveries", 0))
        return desc

    def describe_here(self, group: str, refs: Iterable[pb.QueueRef]) -> pb.GroupDescription:
        """A cluster of shards: what this shard holds of a group coordinated elsewhere -- the end and
        lag (from the queue's low) of the queues named that this shard writes, and the group's pop
        leases here. No members, no committed offsets: the coordinator tells those."""
        check_group(group)
        desc = pb.GroupDescription(name=group, shard=self.store.placement.shard if self.store.placement else "")
        pop = self.pops.describe(group) if self.pops is not None and group in self.pops.groups() else None
        pop_queues: dict[QueueKey, dict[str, int]] = pop["queues"] if pop is not None else {}
        named = {(r.topic, r.queue_id) for r in list(refs)[:system_records.QUEUES_MAX * 64]}
        for t, q in sorted(named | set(pop_queues)):
            bounds = None if self._remote(t, q) else self._bounds(t, q)
            if bounds is None:
                continue
            low, high = bounds
            info = pop_queues.get((t, q), {})
            desc.queues.add(topic=t, queue_id=q, end_offset=high,
                            lag=int(info["lag"]) if info else max(0, high - low),
                            in_flight=int(info.get("in_flight", 0)), pop_offset=int(info.get("pop_offset", 0)))
        if pop is not None:
            desc.dlq_messages = int(pop.get("dlq_messages", 0))
            desc.redeliveries = int(pop.get("redeliveries", 0))
        return desc

    def _all_queues(self, topics: Iterable[str]) -> set[QueueKey]:
        out: set[QueueKey] = set()
        for t in topics:
            n = self.queue_count(t)
            if n is not None:
                out |= {(t, q) for q in range(n)}
        return out

    # -- writes ------------------------------------------------------------------------------------
    def checked_offsets(self, offsets: Iterable[pb.CommittedOffset]) -> list[tuple[str, str, int, int]]:
        """Offsets a caller asks to commit, checked: their number, group names, topics and queues
        that exist (not system ones), offsets not beyond the queue's end."""
        offsets = list(offsets)
        top = self.store.config["limits.commit_offsets_max"]
        if len(offsets) > top:
            raise invalid(f"{len(offsets)} offsets in one call; at most limits.commit_offsets_max ({top})")
        entries = []
        for group in {o.group for o in offsets}:
            self.check_coordinator(group)
        if self.store.placement is not None:  # a topic this node does not know yet: etcd's word first
            for topic in {o.topic for o in offsets if not o.topic.startswith(system_records.SYSTEM_PREFIX)}:
                self.store.placement.check_in_log(topic)
        for o in offsets:
            if o.topic.startswith(system_records.SYSTEM_PREFIX):
                raise invalid(f"consumer offsets are not stored for system topic {shown(o.topic)}")
            if self._remote_kept(o.topic, o.queue_id):  # another shard's queue: its end is not known here
                entries.append((o.group, o.topic, o.queue_id, o.offset))
                continue
            self.store.reads.queue_bounds(o.topic, o.queue_id)  # NOT_FOUND / INVALID_ARGUMENT
            high = self.store.appender.queue_end(o.topic, o.queue_id)  # acked sends count before views apply them
            if o.offset > high:
                raise invalid(f"offset {o.offset} is beyond the end of {o.topic}/{o.queue_id} ({high})")
            entries.append((o.group, o.topic, o.queue_id, o.offset))
        return entries

    def commit(self, entries: list[tuple[str, str, int, int]]) -> None:
        """Commit consumer offsets and return once a confirmed record holds them. Groups with
        committed offsets are bounded (``groups.committed_groups_max``: every one is kept, listed and
        measured for lag): a commit naming new groups beyond it is refused whole, counted and
        buffered under one lock so that concurrent commits cannot pass the bound together."""
        with self._commit_lock:
            self._check_new_groups({g for g, _, _, _ in entries})
            self.store.offsets.commit(entries)
        self.store.offsets.commit([], wait_s=self.store.config["limits.send_timeout_ms"] / 1000.0)

    def check_room(self, entries: list[tuple[str, str, int, int]], pid: int) -> None:
        """Refuse offsets of new groups beyond ``groups.committed_groups_max`` (transaction ``pid``'s,
        checked before its end record), and offsets of groups whose slot is moving away (unless the
        move waits for ``pid``)."""
        if entries and self.store.placement is not None:
            self.store.placement.check_groups_open({g for g, _, _, _ in entries}, pid)
        with self._commit_lock:
            self._check_new_groups({g for g, _, _, _ in entries})

    def _check_new_groups(self, groups: set[str]) -> None:
        metadata = self.store.views.metadata
        buffered = {g for g, _, _ in self.store.offsets.buffered()}
        new = {g for g in groups if g not in buffered and not metadata.group_known(g)}
        if not new:
            return
        known = metadata.groups_count() + len({g for g in buffered if not metadata.group_known(g)})
        top = self.store.config["groups.committed_groups_max"]
        if known + len(new) > top:
            raise BrokerError("RESOURCE_EXHAUSTED", f"{known} groups have committed offsets on this node "
                              f"(groups.committed_groups_max = {top}); a commit of {len(new)} new group(s) is refused: "
                              "a group is forgotten when the topics of all its offsets are deleted")

    def reset_offsets(self, group: str, topic: str, to: int, value: int,
                      elsewhere: dict[int, int] | None = None) -> list[pb.CommittedOffset]:
        """Commit new offsets for every queue of ``topic``; refused while the group has live members
        (they would overwrite them, or consume from where they were). ``elsewhere``: in a cluster of
        shards, the offsets of the queues other shards write (the client resolves them there)."""
        self.check_coordinator(group)
        self.store.check_writable()
        count = self.queue_count(topic)
        if count is None:
            if self.store.placement is not None:
                self.store.placement.check_in_log(topic)  # UNAVAILABLE while this node's copy trails etcd
            raise not_found(f"topic {shown(topic)} does not exist")
        elsewhere = elsewhere or {}
        if self.membership.has_members(group):
            raise BrokerError("FAILED_PRECONDITION", f"group {shown(group)} has live members: stop them (or wait for "
                              "their session to expire) before resetting its offsets")
        if to not in (pb.RESET_TO_EARLIEST, pb.RESET_TO_LATEST, pb.RESET_TO_TIME, pb.RESET_TO_OFFSET):
            raise invalid(f"unknown reset target {to}")
        if to in (pb.RESET_TO_TIME, pb.RESET_TO_OFFSET) and value < 0:
            raise invalid(f"a reset {'time' if to == pb.RESET_TO_TIME else 'offset'} cannot be negative, got {value}")
        entries: list[tuple[str, str, int, int]] = []
        for q in range(count):
            if self._remote(topic, q):
                if q not in elsewhere:
                    raise invalid(f"queue {q} of {shown(topic)} is on shard {self._shard_of(topic, q)!r}: a reset in a "
                                  "cluster of shards names its offset (the client resolves it on that shard)")
                self._remote_kept(topic, q)
                entries.append((group, topic, q, elsewhere[q]))
                continue
            low, high = self.store.reads.queue_bounds(topic, q)
            if to == pb.RESET_TO_EARLIEST:
                offset = low
            elif to == pb.RESET_TO_LATEST:
                offset = high
            elif to == pb.RESET_TO_TIME:
                offset = self.store.reads.offset_for_time(topic, q, value)
            else:
                offset = min(max(value, low), high)
            entries.append((group, topic, q, offset))
        self.commit(entries)
        return [pb.CommittedOffset(group=g, topic=t, queue_id=q, offset=o) for g, t, q, o in entries]

    def describe_topic(self, name: str) -> pb.DescribeTopicResponse:
        info = self.store.views.metadata.topic(name)
        owners = self.store.placement.owners(name) if self.store.placement is not None else None
        if info is None and owners is None and name not in system_records.SYSTEM_TOPICS:
            raise not_found(f"topic {shown(name)} does not exist")
        queues = int(info["queues"]) if info is not None else len(owners) if owners is not None else 1
        resp = pb.DescribeTopicResponse(name=name, topic_id=int(info.get("id", 0)) if info is not None else 0)
        tiered = int(self.store.status().get("tiered_uploaded_offset") or 0)  # type: ignore[call-overload]
        log_min = self.store.log.min_offset
        for q in range(queues):
            qf = self.store.views.queues.queue(name, q)
            shard, master = owners[q] if owners is not None and q < len(owners) else ("", "")
            if qf is None or (info is None and owners is not None):
                if owners is not None:  # another shard's queue, or one this log holds not yet: offsets not told here
                    resp.queues.add(queue_id=q, shard=shard, master=master)
                continue
            low, high = self.store.reads.queue_bounds(name, q)
            local_i = qf.first_at_commit(log_min) if log_min else 0
            local_min = qf.entry(local_i).base_queue_offset if local_i < qf.entries else qf.next_queue_offset
            tiered_i = qf.first_at_commit(tiered) if tiered else 0
            tiered_end = qf.entry(tiered_i).base_queue_offset if tiered_i < qf.entries else qf.next_queue_offset
            first = qf.first_at_commit(self.store.reads.readable_min_offset()) if low else 0
            resp.queues.add(queue_id=q, min_offset=low, max_offset=high, bytes=qf.batch_bytes(first),
                            local_min_offset=local_min, tiered_end_offset=tiered_end if tiered else 0,
                            shard=shard, master=master)
        return resp
