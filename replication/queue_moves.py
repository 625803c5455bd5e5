"""Moving a queue between shards (docs/shards.md "Moving a queue", "Rebalance and drain"), this
node's part: asking for a move, sealing a queue this shard writes, starting one it receives, and
rebalancing.

- **Asked** (``move``, any node): one etcd transaction that compares the topic's record marks the
  queue's writable segment ``sealing`` toward the target; then the caller waits until the target
  writes the queue.
- **Sealed** (``seal_moving``, the source's master): a ``queue.seal`` record in the log (every
  write after it refused), the log confirmed past it, then the segment read-only at the queue's
  end and a writable one on the target from there, with the queue's latest producers, in one etcd
  transaction that also requires this master's leader key: a deposed master cannot write it.
- **Started** (``start_moved_in``, the target's master): a ``queue.start`` record moves the queue's
  next offset in the log to the new segment's start, before the shard takes a write for it.
- **Rebalanced** (``rebalance``): the fewest moves that even the shards out
  (``coordination/rebalance.py``), ``cluster.moves_max_in_flight`` at a time.

A move interrupted by a failover of either shard is finished by the next master: the sealing state
is in etcd, the seal in the log it replicated or not (a new master seals again from what it holds).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from broker.errors import BrokerError, shown
from broker.logformat import system_records
from broker.ports import MoveDone, SegmentRoute
from broker.storage.failpoints import failpoint
from broker.store import Store
from replication.coordination import placement as pl
from replication.coordination import rebalance as rb
from replication.coordination.cluster_map import ClusterMap
from replication.coordination.etcd import Etcd

log = structlog.get_logger("replication.queue_moves")
SEAL_CONFIRM_MS = 5000  # a seal waits this long for the log to be confirmed past it, then tries again
# producers whose last batch a move carries to the target (the latest ones): a send retried across
# the move by one of them is stored once (one request in flight per producer and shard)
PRODUCERS_CARRIED_MAX = 64

Written = Callable[[Callable[[Etcd], Coroutine[Any, Any, int]]], int]


async def _set_draining(shard: str, draining: bool, etcd: Etcd) -> int:
    return await etcd.set_draining(shard, draining)


async def _replace(topic: str, expected: bytes, record: bytes, leader_revision: int, etcd: Etcd) -> int:
    return await etcd.replace_placement(topic, expected, record, leader_revision)


def segment_route(seg: pl.Segment) -> SegmentRoute:
    return SegmentRoute(seg.shard, seg.logical_start, seg.end, seg.state)


class QueueMoves:
    def __init__(self, store: Store, shard: str, cluster: ClusterMap, written: Written,
                 leader_revision: Callable[[], int], moves_max_in_flight: int, wake: Callable[[], None]) -> None:
        self.store = store
        self.shard = shard
        self.cluster = cluster
        self._written = written  # one etcd write of ours, waited for in this node's copy
        self._leader_revision = leader_revision  # our leader key's create revision while we hold it (else 0)
        self.moves_max_in_flight = moves_max_in_flight
        self._wake = wake  # the reconciler, which seals and starts

    def started(self, topic: str, queue: int, seg: pl.Segment) -> bool:
        """Whether this shard's log began ``seg``, a segment of ``queue`` here: its next offset at
        the segment's start or past it, and no seal but this segment's own (a sealing segment's
        seal is at or past its start; an older segment's, before it)."""
        appender = self.store.appender
        if appender.queue_end_hint(topic, queue) < seg.logical_start:
            return False
        sealed_at = appender.sealed_end(topic, queue)
        return sealed_at is None or (seg.state != "rw" and sealed_at >= seg.logical_start)

    def move(self, topic: str, queue: int, to_shard: str, timeout_s: float) -> tuple[SegmentRoute, ...]:
        """Ask for the move (its first step, in etcd) and wait until the target writes the queue."""
        p, raw = self.cluster.placement(topic), self.cluster.raw_record(topic)
        if p is None or raw is None:
            raise BrokerError("NOT_FOUND", f"topic {shown(topic)} does not exist")
        if not 0 <= queue < p.queues:
            raise BrokerError("INVALID_ARGUMENT", f"topic {shown(topic)} has {p.queues} queues; there is no queue {queue}")
        last = p.last(queue)
        if not (last.shard == to_shard and last.state == "rw"):  # (a fresh one there: only wait for it)
            if last.state == "sealing":
                if last.to != to_shard:
                    raise BrokerError("FAILED_PRECONDITION", f"queue {queue} of topic {shown(topic)} is moving to shard "
                                      f"{last.to!r} already; ask again once it is there")
            else:
                self._ask_move(topic, queue, to_shard, p, raw)
        ok = self.cluster.wait_for(lambda: self._moved(topic, queue, to_shard), timeout_s)
        p = self.cluster.placement(topic)
        if not ok or p is None:
            raise BrokerError("DEADLINE_EXCEEDED", f"queue {queue} of topic {shown(topic)} is not on shard {to_shard!r} "
                              f"yet after {timeout_s:g} s; the move goes on (cluster status shows it)")
        return tuple(segment_route(seg) for seg in p.segments[queue])

    def _ask_move(self, topic: str, queue: int, to_shard: str, p: pl.Placement, raw: bytes) -> None:
        if self.cluster.is_draining(to_shard):
            raise BrokerError("FAILED_PRECONDITION", f"shard {to_shard!r} is being drained: no queue moves to it "
                              f"(tidemark cluster drain {to_shard} --cancel ends that)")
        if self.cluster.master(to_shard) is None:
            raise BrokerError("FAILED_PRECONDITION", f"shard {to_shard!r} has no master now (or does not exist): "
                              f"the shards with one are {', '.join(sorted(self.cluster.live_shards())) or 'none'}")
        moving = self.cluster.moves_in_flight()
        if len(moving) >= self.moves_max_in_flight:
            raise BrokerError("RESOURCE_EXHAUSTED", f"{len(moving)} queue moves are under way "
                              f"(cluster.moves_max_in_flight = {self.moves_max_in_flight}); retry once one is done")
        record = pl.encode(pl.sealing(p, queue, to_shard))
        revision = self._written(functools.partial(_replace, topic, raw, record, 0))
        if not revision:
            raise BrokerError("ABORTED", f"topic {shown(topic)} changed in etcd meanwhile; ask for the move again")
        log.info("queue_move_asked", topic=topic, queue=queue, source=p.owner(queue), target=to_shard, revision=revision)
        self._wake()

    def _moved(self, topic: str, queue: int, to_shard: str) -> bool:
        p = self.cluster.placement(topic)
        if p is None or queue >= p.queues:
            return True  # deleted meanwhile: the caller says what it finds
        last = p.last(queue)
        return last.shard == to_shard and last.state == "rw" and not last.fresh  # begun there

    def rebalance(self, drain: str, undrain: str, dry_run: bool, timeout_s: float) -> list[MoveDone]:
        """Even out the live shards' writable queues (``rebalance.plan``), ``drain`` marked draining
        first (or ``undrain`` no longer); the moves run up to ``moves_max_in_flight`` at a time.
        ``dry_run``: the plan, nothing moved. Each move's outcome; a failed one does not stop the rest.
        ``undrain`` moves nothing (a rebalance afterwards fills the shard)."""
        if drain and drain not in self.cluster.shards():
            raise BrokerError("NOT_FOUND", f"shard {drain!r} is not in this cluster")
        for shard, on in ((drain, True), (undrain, False)):
            if shard and not dry_run:
                self._written(functools.partial(_set_draining, shard, on))
                log.warning("shard_draining" if on else "shard_undrained", shard=shard)
        if undrain and not drain:
            return []
        draining = self.cluster.draining_shards() | ({drain} if drain else set())
        try:
            moves = rb.plan(self.cluster.placements_snapshot(), self.cluster.live_shards(), draining)
        except ValueError as exc:
            raise BrokerError("FAILED_PRECONDITION", str(exc)) from None
        if dry_run or not moves:
            return [MoveDone(m.topic, m.queue, m.source, m.target, 0.0, "") for m in moves]
        deadline = time.monotonic() + timeout_s
        with ThreadPoolExecutor(max_workers=self.moves_max_in_flight, thread_name_prefix="rebalance") as pool:
            return list(pool.map(functools.partial(self._move_one, deadline), moves))

    def _move_one(self, deadline: float, m: rb.Move) -> MoveDone:
        started = time.monotonic()
        while True:
            try:
                self.move(m.topic, m.queue, m.target, max(0.1, deadline - time.monotonic()))
                return MoveDone(m.topic, m.queue, m.source, m.target, time.monotonic() - started, "")
            except BrokerError as exc:
                if exc.code in ("RESOURCE_EXHAUSTED", "ABORTED") and time.monotonic() < deadline:
                    time.sleep(0.05)  # other moves under way, or the record changed: again
                    continue
                return MoveDone(m.topic, m.queue, m.source, m.target, time.monotonic() - started,
                                f"{exc.code}: {exc.message}"[:300])

    def seal_moving(self) -> None:
        """On this shard's master: each queue of ours that etcd marks sealing is sealed in the log,
        the log confirmed past the seal, then the switch written (fenced by our leader key). A
        queue that fails (etcd, the slave's acknowledgement) is tried again next round; the others
        go on."""
        for topic, queue, source, _ in self.cluster.moves_in_flight():  # kept as placements change
            p = self.cluster.placement(topic)
            if source != self.shard or p is None or queue >= p.queues or self.store.views.metadata.topic(topic) is None:
                continue
            seg = p.last(queue)
            leader_revision = self._leader_revision()
            if seg.state != "sealing" or not leader_revision:
                continue
            try:
                self._seal(topic, queue, seg, leader_revision)
            except BrokerError as exc:
                log.warning("queue_seal_failed", topic=topic, queue=queue, error=exc.message[:200],
                            note="tried again at the next round")

    def _seal(self, topic: str, queue: int, seg: pl.Segment, leader_revision: int) -> None:
        if not self.started(topic, queue, seg):  # moved here and away again before it ever started here
            self._start([(topic, queue, seg)])
        end, at = self.store.appender.seal_queue(topic, queue)
        end = max(end, seg.logical_start)
        self.store.watermarks.wait_ack(at, "replica", SEAL_CONFIRM_MS)
        failpoint("move_after_seal")
        raw = self.cluster.raw_record(topic)
        if raw is None or pl.decode(raw).last(queue) != seg:
            return  # changed meanwhile (deleted): the next round sees what it is now
        producers = self.store.appender.producers_of(topic, queue, PRODUCERS_CARRIED_MAX)
        # every pop window begun before the seal is in the view (a group new to the sealing segment
        # after it begins on the target: pop_window_start)
        if not self.store.dispatcher.wait_applied(self.store.views.pops, at, SEAL_CONFIRM_MS / 1000.0):
            log.warning("queue_seal_views_behind", topic=topic, queue=queue, note="tried again at the next round")
            return
        pop_groups = self.store.views.pops.groups_of(topic, queue)
        record = pl.encode(pl.switched(pl.decode(raw), queue, end, producers, pop_groups))
        pl.decode(record)  # never write a record no node could read
        revision = self._written(functools.partial(_replace, topic, raw, record, leader_revision))
        if revision:
            failpoint("move_after_switch")
            log.info("queue_sealed", topic=topic, queue=queue, end=end, target=seg.to, revision=revision)
        else:
            log.warning("queue_seal_not_written", topic=topic, queue=queue, end=end,
                        note="the record changed or this node is no longer the shard's leader")

    def start_moved_in(self) -> None:
        """On this shard's master: each writable segment etcd gives this shard that its log has not
        begun (a move's target; or a queue that left sealed and came back) starts there (one
        ``queue.start`` record each) before it takes a write; then etcd is told it began. Only the
        segments a move began and the queues sealed here are looked at (not every queue)."""
        candidates = {(t, q) for t, q, _ in self.cluster.fresh_segments()} | set(self.store.appender.sealed_queues())
        todo = []
        for topic, queue in sorted(candidates):
            p = self.cluster.placement(topic)
            if p is None or queue >= p.queues or self.store.views.metadata.topic(topic) is None:
                continue
            last = p.last(queue)
            if last.shard == self.shard and last.state == "rw" and not self.started(topic, queue, last):
                todo.append((topic, queue, last))
        if todo:
            self._start(todo)
        self._settle_begun()

    def _start(self, todo: list[tuple[str, int, pl.Segment]]) -> None:
        starts = [(system_records.QUEUE_START, {"topic": t, "queue": q, "start": seg.logical_start,
                                                "producers": [list(r) for r in seg.producers]}) for t, q, seg in todo]
        failpoint("move_before_start")
        self.store.writes.write_system(starts, applied=self.store.views.queues)
        log.info("queues_started", queues=[(t, q, seg.logical_start) for t, q, seg in todo], shard=self.shard)

    def _settle_begun(self) -> None:
        """Writable segments of ours that a move began, now begun in the log: rewritten in etcd as
        begun (a move's caller waits for that) and without their carried producers (the log holds
        them now; each switch would otherwise grow the topic's record for good)."""
        leader_revision = self._leader_revision()
        if not leader_revision:
            return
        by_topic: dict[str, list[int]] = {}
        for topic, q, seg in self.cluster.fresh_segments():
            if seg.shard == self.shard and seg.state == "rw" and self.started(topic, q, seg):
                by_topic.setdefault(topic, []).append(q)
        for topic, done in sorted(by_topic.items()):
            raw = self.cluster.raw_record(topic)
            if raw is None:
                continue
            settled = pl.decode(raw)
            for q in done:
                last = settled.last(q)
                if last.shard == self.shard and last.state == "rw":  # still ours as etcd holds it now
                    settled = settled.with_last(q, last.unlisted())
            try:
                self._written(functools.partial(_replace, topic, raw, pl.encode(settled), leader_revision))
            except BrokerError as exc:
                log.warning("segment_not_settled", topic=topic, error=exc.message[:200])
