"""This node's part in a cluster of shards (docs/shards.md): the ``Placement`` port.

- **Placing topics.** ``place`` spreads the queues of new topics over the shards that have a
  master (``placement.spread``) and writes every topic's record in one etcd transaction that
  requires each absent: all or none, whichever node is asked.
- **Serving only its own queues.** ``check_queue`` refuses a request for a queue another shard
  writes, ``FAILED_PRECONDITION`` naming that shard and its master, so a client updates its route
  without asking etcd; a queue of this shard whose topic its log does not hold yet is
  ``UNAVAILABLE`` for the moment the reconciler takes (clients retry it).
- **Following etcd into the log.** The reconciler thread, on the shard's master, creates in the
  log (``topic.create`` in ``__metadata``) every placed topic (a group coordinated here keeps
  offsets of other shards' queues, and the log keeps offsets only of topics it holds), as soon
  as the watched copy shows it; and places the topics the log holds that etcd does not know (a
  one-pair cluster upgraded into this shard: all their queues here). The log stays the truth for
  everything the shard serves.

- **Coordinating groups.** A group's coordinator is the shard of its slot (``slots.py``); a
  group call to another shard is refused ``FAILED_PRECONDITION`` naming it, as a queue's is. A
  slot without a shard is given one (the live shard with the fewest slots) by whichever node is
  asked first.

- **Moving a queue** (seal-and-continue, no data copied; ``queue_moves.py``): asked of any node,
  sealed by the source's master, started by the target's (the reconciler runs both), rebalanced.

- **Deleting topics.** ``delete`` turns the topic's record into a tombstone; each shard's master
  deletes the topic from its log; requests for it are ``NOT_FOUND`` from then on, and a deleted
  name is not created again (not yet: an incarnation id would have to tell the two apart in a
  shard whose log has not applied the delete).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import structlog

from broker import metrics
from broker.errors import MOVING, OWNER_MASTER_KEY, OWNER_SHARD_KEY, ROUTES_REVISION_KEY, BrokerError, shown
from broker.logformat import system_records
from broker.ports import POP_AS_ASKED, MoveDone, Routes, SegmentRoute, ShardRoute
from broker.storage.failpoints import failpoint
from broker.store import Store
from broker.threads import NamedThread
from replication.coordination import placement as pl
from replication.coordination import slots as sl
from replication.coordination.cluster_map import ClusterMap
from replication.coordination.etcd import Etcd
from replication.queue_moves import QueueMoves, segment_route
from replication.slot_moves import SlotMoves, create_slot
from replication.txn_peers import ShardPeers
from replication.unknown_topics import SubmitOnLoop, UnknownTopics

log = structlog.get_logger("replication.shards")
PLACE_WAIT_S = 10.0
# one etcd transaction places a CreateTopics call's topics (all or none); etcd refuses more operations
# per transaction than its --max-txn-ops (128 by default)
PLACE_TOPICS_MAX = 128
RECONCILE_EVERY_S = 1.0
RECONCILE_GAP_S = 0.02  # at least this between two rounds (each reads every placement)

RunOnLoop = Callable[[Callable[[Etcd], Coroutine[Any, Any, Any]], float], Any]


async def _create_placements(records: dict[str, bytes], etcd: Etcd) -> int:
    return await etcd.create_placements(records)


async def _replace_placement(topic: str, expected: bytes, record: bytes, etcd: Etcd) -> int:
    return await etcd.replace_placement(topic, expected, record)


class ShardPlacement:
    def __init__(self, store: Store, shard: str, cluster: ClusterMap, run_on_loop: RunOnLoop,
                 submit_on_loop: SubmitOnLoop, peers: ShardPeers, leader_revision: Callable[[], int] = lambda: 0,
                 moves_max_in_flight: int = 4) -> None:
        self.store = store
        self.shard = shard
        self.cluster = cluster
        self._run = run_on_loop  # a coroutine on the coordinator's loop, with its etcd client
        self.unknown = UnknownTopics(submit_on_loop)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.moves = QueueMoves(store, shard, cluster, self._written, leader_revision, moves_max_in_flight,
                                self._wake.set)
        self.slots = SlotMoves(store, shard, cluster, self._written, leader_revision, peers, self._wake.set,
                               self._refusal)
        self._thread = NamedThread(target=self._reconcile_loop, name="shard-reconcile", daemon=True)
        cluster.on_change.append(self._wake.set)
        self._exported: set[str] = set()  # shards with series in the cluster gauges
        self._groups_seen = -1  # the log's group count when its groups' slots were last claimed

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)

    # -- the port ---------------------------------------------------------------------------------
    def place(self, topics: list[tuple[str, int]]) -> None:
        """Place new topics (name, queues) over the live shards; all or none. ALREADY_EXISTS if one
        is placed already; UNAVAILABLE when no shard has a master or etcd does not answer."""
        if len(topics) > PLACE_TOPICS_MAX:
            raise BrokerError("INVALID_ARGUMENT", f"a cluster of shards creates at most {PLACE_TOPICS_MAX} topics per "
                              f"call (one etcd transaction; etcd's --max-txn-ops), got {len(topics)}: split the call")
        for name, _ in topics:
            if self.cluster.placement(name) is not None:
                raise BrokerError("ALREADY_EXISTS", f"topic {shown(name)} already exists")
            if self.cluster.is_deleted(name):
                raise BrokerError("FAILED_PRECONDITION", f"topic {shown(name)} was deleted; a cluster of shards does not "
                                  "create a deleted name again yet (docs/shards.md): choose another name")
        held = self.cluster.queues_held()
        if not held:
            raise BrokerError("UNAVAILABLE", "no shard of this cluster has a master now")
        records = {name: pl.encode(p) for name, p in pl.spread(held, topics).items()}
        revision = self._written(functools.partial(_create_placements, records))
        if not revision:
            raise BrokerError("ALREADY_EXISTS", f"one of topics {', '.join(shown(n) for n, _ in topics)} was "
                              "created meanwhile")
        log.info("topics_placed", topics=[n for n, _ in topics], revision=revision)
        self._wake.set()

    def delete(self, topic: str) -> None:
        """Delete a placed topic: its record becomes a tombstone in one etcd transaction (if it did
        not change meanwhile); each shard's master then deletes it from its log (``reconcile``)."""
        p, raw = self.cluster.placement(topic), self.cluster.raw_record(topic)
        if p is None or raw is None:
            raise BrokerError("NOT_FOUND", f"topic {shown(topic)} does not exist")
        record = pl.encode(pl.Placement(p.segments, deleted=True))
        revision = self._written(functools.partial(_replace_placement, topic, raw, record))
        if not revision:
            raise BrokerError("ABORTED", f"topic {shown(topic)} changed in etcd meanwhile; retry the delete")
        log.info("topic_deleted", topic=topic, revision=revision)
        self._wake.set()

    def check_queue(self, topic: str, queue: int, confirm: bool = True) -> None:
        """Whether this shard writes ``queue`` of ``topic`` (raises if not). A topic etcd does not
        place (a system topic, or an unknown one: confirmed with etcd first, unless ``confirm`` is
        False because the caller did) is left to the log's own checks."""
        p = self.cluster.placement(topic)
        if p is None or not 0 <= queue < p.queues:
            if self.cluster.is_deleted(topic):  # this shard's log may hold it a moment longer
                raise BrokerError("NOT_FOUND", f"topic {shown(topic)} was deleted")
            if confirm and self._unconfirmed(topic):
                self.unknown.confirm(topic)
            return
        last = p.last(queue)
        if last.shard != self.shard:
            raise self._refusal(f"queue {queue} of topic {shown(topic)}", last.shard)
        self._check_serving(topic, queue, last)
        if last.state == "sealing":
            raise BrokerError("UNAVAILABLE", f"queue {queue} of topic {shown(topic)} is moving to shard {last.to!r}: "
                              "nothing of this send was stored; retry (the routes name the new owner once it is done)",
                              metadata=MOVING)

    def check_read(self, topic: str, queue: int, offset: int, confirm: bool = True) -> None:
        p = self.cluster.placement(topic)
        if p is None or not 0 <= queue < p.queues:
            self.check_queue(topic, queue, confirm)
            return
        seg = p.segment_at(queue, offset)
        if seg.shard != self.shard:
            raise self._refusal(f"offset {offset} of queue {queue} of topic {shown(topic)}", seg.shard)
        self._check_serving(topic, queue, seg)

    def _check_serving(self, topic: str, queue: int, seg: pl.Segment) -> None:
        """UNAVAILABLE while this shard's log does not hold the topic, or not yet the start of a
        segment a move began here (the reconciler writes both)."""
        if self.store.views.metadata.topic(topic) is None:
            self._wake.set()
            raise BrokerError("UNAVAILABLE", f"topic {shown(topic)} is being created on shard {self.shard!r}; "
                              "retry in a moment")
        if seg.end is None and not self.moves.started(topic, queue, seg):
            self._wake.set()
            raise BrokerError("UNAVAILABLE", f"queue {queue} of topic {shown(topic)} is being started on shard "
                              f"{self.shard!r} at offset {seg.logical_start} (a move); retry in a moment", metadata=MOVING)

    def move(self, topic: str, queue: int, to_shard: str, timeout_s: float) -> tuple[SegmentRoute, ...]:
        return self.moves.move(topic, queue, to_shard, timeout_s)

    def rebalance(self, drain: str, undrain: str, dry_run: bool, timeout_s: float) -> list[MoveDone]:
        deadline = time.monotonic() + timeout_s
        done = self.moves.rebalance(drain, undrain, dry_run, timeout_s)
        if drain:  # its group slots go too: a drained shard coordinates nothing
            done += self.slots.drain(drain, deadline, dry_run)
        return done

    def move_slot(self, slot: int, to_shard: str, timeout_s: float) -> str:
        return self.slots.move(slot, to_shard, timeout_s)

    def import_offsets(self, slot: int, source_shard: str, offsets: list[tuple[str, str, int, int]]) -> int:
        return self.slots.import_offsets(slot, source_shard, offsets)

    def coordinates(self, group: str) -> bool:
        return self.cluster.slot_shard(sl.slot_of(group)) in (None, self.shard)

    def check_groups_open(self, groups: set[str], pid: int = 0) -> None:
        self.slots.check_open(groups, pid)

    def _written(self, write: Callable[[Etcd], Coroutine[Any, Any, int]]) -> int:
        """One etcd write of ours (a revision, 0 when its compares failed), waited for in this node's
        copy so that what it wrote is read back at once."""
        revision = int(self._run(write, PLACE_WAIT_S))
        if revision:
            self.cluster.wait_revision(revision, PLACE_WAIT_S)
        return revision

    def _refusal(self, what: str, owner: str) -> BrokerError:
        master = self.cluster.master(owner)
        where = f"master {master.client}" if master is not None else "no master now"
        return BrokerError("FAILED_PRECONDITION", f"{what} is on shard {owner!r} ({where}), not on this node's shard "
                           f"{self.shard!r}",
                           metadata=((OWNER_SHARD_KEY, owner), (OWNER_MASTER_KEY, master.client if master else ""),
                                     (ROUTES_REVISION_KEY, str(self.cluster.revision))))

    def group_shard(self, group: str) -> str:
        """The shard coordinating ``group``: its slot's, given one now if it has none (etcd)."""
        slot = sl.slot_of(group)
        shard = self.cluster.slot_shard(slot)
        if shard is not None:
            return shard
        if not self.cluster.revision:
            raise BrokerError("UNAVAILABLE", "this node has not loaded the cluster's placements from etcd yet; retry")
        bad = self.cluster.bad_value(f"slots/{slot}")
        if bad is not None:  # a value this node cannot read: never guessed over
            raise BrokerError("UNAVAILABLE", f"group slot {slot}'s record in etcd is not understood ({bad}); "
                              "an operator must fix or delete it")
        live = [s for s in self.cluster.live_shards() if not self.cluster.is_draining(s)] or self.cluster.live_shards()
        if not live:
            raise BrokerError("UNAVAILABLE", "no shard of this cluster has a master now to coordinate groups")
        record = sl.encode(sl.pick(self.cluster.slots_held(), live))
        revision = self._written(functools.partial(create_slot, slot, record))
        if revision:
            log.info("group_slot_assigned", slot=slot, shard=sl.decode(record), revision=revision)
        else:  # another node gave it one meanwhile: wait for the copy to show it
            self.cluster.wait_for(lambda: slot in self.cluster.slots, PLACE_WAIT_S)
        shard = self.cluster.slot_shard(slot)
        if shard is None:
            raise BrokerError("UNAVAILABLE", f"group slot {slot} was given a shard, not yet seen here; retry")
        return shard

    def knows_group(self, group: str) -> bool:
        return self.cluster.slot_shard(sl.slot_of(group)) is not None

    def check_group(self, group: str) -> None:
        owner = self.group_shard(group)
        if owner != self.shard:
            raise self._refusal(f"group {shown(group)} (slot {sl.slot_of(group)})", owner)

    def dead_letter_queue(self, topic: str) -> int | None:
        """The queue of the dead-letter topic ``topic`` this shard writes; the topic is placed first
        if it is not (one queue per shard with a master, in name order: each shard's dead letters
        go into its own queue, in the append that ends their leases). None while this shard's log
        does not hold it yet, or when it has no queue here (a shard that joined since)."""
        p = self.cluster.placement(topic)
        if p is None:
            live = sorted({*self.cluster.live_shards(), self.shard})
            record = pl.encode(pl.Placement(tuple((pl.Segment(s),) for s in live)))
            revision = self._written(functools.partial(_create_placements, {topic: record}))
            if revision:
                log.info("dead_letter_topic_placed", topic=topic, shards=live, revision=revision)
            p = self.cluster.placement(topic)
        self._wake.set()
        mine = p.queues_of(self.shard) if p is not None else []
        return mine[0] if mine and self.store.views.metadata.topic(topic) is not None else None

    async def confirm_unknown(self, topics: Iterable[str]) -> None:
        """For callers on an event loop, before ``check_queue``/``check_read`` with ``confirm=False``:
        each of ``topics`` neither etcd's copy nor the log knows is confirmed unknown with etcd."""
        for topic in set(topics):
            if self._unconfirmed(topic):
                await self.unknown.confirm_async(topic)
                return  # etcd does not hold it: the request fails NOT_FOUND (one etcd read per request)

    def _unconfirmed(self, topic: str) -> bool:
        """Neither this node's copy of etcd nor its log knows ``topic`` (not a system topic, not a
        deleted one): a ``NOT_FOUND`` for it must be confirmed with etcd first (unknown_topics.py)."""
        return (not topic.startswith(system_records.SYSTEM_PREFIX) and self.cluster.placement(topic) is None
                and not self.cluster.is_deleted(topic) and self.store.views.metadata.topic(topic) is None)

    def check_in_log(self, topic: str, confirm: bool = True) -> None:
        """UNAVAILABLE (and the reconciler woken) while this shard's log does not hold a placed topic
        (an unknown one: confirmed unknown with etcd first, unless ``confirm`` is False)."""
        if self._unconfirmed(topic):
            if confirm:
                self.unknown.confirm(topic)
            return
        if self.cluster.placement(topic) is not None and self.store.views.metadata.topic(topic) is None:
            self._wake.set()
            raise BrokerError("UNAVAILABLE", f"topic {shown(topic)} is being created on shard {self.shard!r}; "
                              "retry in a moment")

    def is_local(self, topic: str, queue: int) -> bool:
        p = self.cluster.placement(topic)
        return p is None or not 0 <= queue < p.queues or p.owner(queue) == self.shard

    def segment_here(self, topic: str, queue: int) -> tuple[bool, int] | None:
        p = self.cluster.placement(topic)
        if p is None or not 0 <= queue < p.queues:
            return (True, 0)
        mine = [seg for seg in p.segments[queue] if seg.shard == self.shard]
        if not mine:
            return None
        last = p.last(queue)
        return (True, last.logical_start) if last.shard == self.shard else (False, mine[-1].logical_start)

    def pop_window_start(self, topic: str, queue: int, group: str) -> int | None:
        p = self._placed_for_pops(topic)
        if p is None or not 0 <= queue < p.queues:
            return POP_AS_ASKED
        segs = p.segments[queue]
        for i, seg in enumerate(segs):  # oldest first: the earliest segment here the group reads from
            if seg.shard != self.shard:
                continue
            if i == len(segs) - 1:  # the writable one (sealing: the group begins on the target)
                return None if seg.state == "sealing" else POP_AS_ASKED if i == 0 else seg.logical_start
            if i > 0 and seg.begins_pops_of(group):
                return seg.logical_start
        return None

    def pop_gaps(self, topic: str, queue: int) -> list[tuple[int, int]]:
        p = self._placed_for_pops(topic)
        if p is None or not 0 <= queue < p.queues:
            return []
        segs = p.segments[queue]
        mine = [i for i, seg in enumerate(segs) if seg.shard == self.shard]
        if len(mine) < 2:
            return []
        return [(seg.logical_start, seg.end) for seg in segs[mine[0]:mine[-1]]
                if seg.shard != self.shard and seg.end is not None and seg.end > seg.logical_start]

    def _placed_for_pops(self, topic: str) -> pl.Placement | None:
        """The topic's placement, once this node has loaded etcd's (a pop before that could lease
        across another shard's segment)."""
        if not self.cluster.revision:
            raise BrokerError("UNAVAILABLE", "this node has not loaded the cluster's placements from etcd yet; retry")
        return self.cluster.placement(topic)

    def queue_count(self, topic: str) -> int | None:
        p = self.cluster.placement(topic)
        return p.queues if p is not None else None

    def owners(self, topic: str) -> list[tuple[str, str]] | None:
        """Per queue of ``topic``: (shard, its master's client address or ''); None: not placed."""
        p = self.cluster.placement(topic)
        if p is None:
            return None
        out = []
        for q in range(p.queues):
            shard = p.owner(q)
            master = self.cluster.master(shard)
            out.append((shard, master.client if master is not None else ""))
        return out

    def routes(self, topics: list[str]) -> Routes:
        if not self.cluster.revision:  # an empty answer would read as "no such topic"
            raise BrokerError("UNAVAILABLE", "this node has not loaded the cluster's placements from etcd yet; retry")
        placed = {t: p for t in topics if (p := self.cluster.placement(t)) is not None}
        held = self.cluster.queue_counts()
        slots, draining, read_only = self.cluster.slots_held(), self.cluster.draining_shards(), self.cluster.read_only_counts()
        shards = tuple(ShardRoute(shard, master.client if master else "", master.nodes if master else (),
                                  master.epoch if master else 0, held.get(shard, 0), shard in draining,
                                  slots.get(shard, 0), read_only.get(shard, 0))
                       for shard, master in self.cluster.shards().items())
        moved = {t: {q: tuple(segment_route(seg) for seg in segs) for q, segs in enumerate(p.segments)
                     if len(segs) > 1 or segs[0].state != "rw"} for t, p in placed.items()}
        return Routes(self.cluster.revision, {t: tuple(p.owner(q) for q in range(p.queues)) for t, p in placed.items()},
                      shards, {t: m for t, m in moved.items() if m},
                      (*self.cluster.moves_in_flight(), *self._slot_moves()))

    def _slot_moves(self) -> list[tuple[str, int, str, str]]:
        """Group slots moving, as moves with no topic: ('', slot, from, to)."""
        return [("", slot, source, to) for slot, (source, to) in sorted(self.cluster.slot_moves_in_flight().items())]

    def _claim_slots(self) -> None:
        """The slots of groups whose offsets this log holds and which have no shard yet become this
        shard's: a one-pair cluster upgraded into this shard keeps coordinating its groups where
        their offsets are (a shard that joined since would otherwise take some of their slots)."""
        count = self.store.views.metadata.groups_count()
        assigned = self.cluster.slot_map()
        if count == self._groups_seen or len(assigned) >= sl.SLOTS:
            return
        todo = sorted({sl.slot_of(g) for g in self.store.views.metadata.group_names()} - set(assigned))
        for slot in todo:
            revision = self._run(functools.partial(create_slot, slot, sl.encode(self.shard)), PLACE_WAIT_S)
            if revision:
                log.info("group_slot_claimed", slot=slot, shard=self.shard, revision=revision,
                         note="groups of this shard's log (an upgraded one-pair cluster) keep their coordinator")
        self._groups_seen = count

    # -- following etcd into the log (the shard's master) -----------------------------------------
    def _reconcile_loop(self) -> None:
        last_round = 0.0
        while not self._stop.is_set():
            self._wake.wait(RECONCILE_EVERY_S)
            # refused requests wake it again and again: rounds not back to back (a lone wake runs at once)
            self._stop.wait(max(0.0, last_round + RECONCILE_GAP_S - time.monotonic()))
            last_round = time.monotonic()
            self._wake.clear()
            self._export()
            if self._stop.is_set() or self.store.role != "master" or not self.cluster.revision:
                continue
            try:
                self.reconcile()
            except BrokerError as exc:  # not writable now (a full disk, fenced): next time
                log.warning("shard_reconcile_failed", error=exc.message)
            except Exception as exc:  # never end the thread: topics, moves and slots would stop following etcd
                log.exception("shard_reconcile_crashed")
                self.store.incidents.record("shards", f"{type(exc).__name__}: {exc}"[:300])
            else:
                self.store.incidents.clear("shards")

    def _export(self) -> None:
        """The cluster as this node's copy has it, for metrics (every node exports the same)."""
        shards = self.cluster.shards()
        counts = self.cluster.queue_counts()
        for shard, master in shards.items():
            metrics.CLUSTER_SHARD_QUEUES.labels(shard).set(counts.get(shard, 0))
            metrics.CLUSTER_SHARD_HAS_MASTER.labels(shard).set(1 if master is not None else 0)
        draining = self.cluster.draining_shards()
        for shard in shards:
            metrics.CLUSTER_SHARD_DRAINING.labels(shard).set(1 if shard in draining else 0)
        for gone in self._exported - set(shards):  # a shard gone from etcd: its series go
            metrics.CLUSTER_SHARD_QUEUES.remove(gone)
            metrics.CLUSTER_SHARD_HAS_MASTER.remove(gone)
            metrics.CLUSTER_SHARD_DRAINING.remove(gone)
        metrics.CLUSTER_MOVES_IN_FLIGHT.set(len(self.cluster.moves_in_flight()) + len(self._slot_moves()))
        self._exported = set(shards)
        metrics.CLUSTER_REVISION.set(self.cluster.revision)

    def reconcile(self) -> None:
        local = self.store.views.metadata.list_topics()
        gone = [name for name in local if self.cluster.is_deleted(name)]
        if gone:
            self.store.writes.write_system([(system_records.TOPIC_DELETE, {"topic": n}) for n in gone],
                                           applied=self.store.views.metadata)
            log.info("shard_topics_deleted", topics=gone, shard=self.shard)
            local = self.store.views.metadata.list_topics()
        # every placed topic, not only those with a queue here: a group coordinated here commits
        # offsets for queues of other shards, and the log keeps offsets only of topics it holds
        missing = [(name, p.queues) for name, p in self.cluster.placements_snapshot().items() if name not in local]
        if missing:
            failpoint("shards_before_create_topics")
            self.store.writes.write_system([(system_records.TOPIC_CREATE, {"topic": n, "queues": q})
                                            for n, q in missing], applied=self.store.views.metadata)
            log.info("shard_topics_created", topics=[n for n, _ in missing], shard=self.shard)
        self._claim_slots()
        self.moves.seal_moving()
        self.moves.start_moved_in()
        self.slots.seal_moving()
        unplaced = {name: info["queues"] for name, info in local.items()
                    if not name.startswith(system_records.SYSTEM_PREFIX) and self.cluster.placement(name) is None
                    and not self.cluster.is_deleted(name)}
        names = sorted(unplaced)
        for start in range(0, len(names), PLACE_TOPICS_MAX):  # each topic on its own: no need for one transaction
            chunk = names[start:start + PLACE_TOPICS_MAX]
            records = {name: pl.encode(pl.Placement(tuple((pl.Segment(self.shard),) for _ in range(unplaced[name]))))
                       for name in chunk}
            if self._written(functools.partial(_create_placements, records)):
                log.warning("shard_topics_adopted", topics=chunk, shard=self.shard,
                            note="topics of this shard's log that etcd did not place (an upgraded one-pair cluster)")
