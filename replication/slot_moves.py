"""Moving a group slot between shards (docs/shards.md "Moving a group slot"), this node's part.

A slot (``crc32c(name) % 256``) names the shard coordinating its consumer groups (members,
assignment, committed offsets) and its transactional ids (begins, decisions). Moving it moves
that role; no queue moves:

- **Asked** (``move``, any node): the slot's record in etcd gains ``"to"`` (one transaction that
  compares the record), then the caller waits until the target coordinates it.
- **Closed** (the source shard, from the moment its copy shows the ``to``): offset commits and
  resets of the slot's groups, and transactions begun for its ids or carrying its groups' offsets,
  are refused ``UNAVAILABLE`` with ``tidemark-retry: moving`` (clients retry). Members keep their
  heartbeats and their queues meanwhile.
- **Handed over** (``seal_moving``, the source's master, each reconcile round): once every
  transaction open when it first looked has ended and no decision of the slot's ids is left to
  deliver, the offset buffer is flushed, the slot's committed offsets are sent to the target's
  master (``ImportOffsets``: replicated there before it answers), and the record is switched to
  the target in one etcd transaction that also requires this master's leader key (a deposed
  master cannot). Members then meet a refusal naming the target and join there.
- **Imported** (``import_offsets``, the target's master): only while etcd marks the slot moving
  here from the sender's shard; once the slot is here, a late import is refused (it would put
  back offsets older than the ones committed here since).

A failover of either side mid-move is finished by the next master: the ``to`` is in etcd, and the
offsets are read again from the source's log (an import repeated sets the same values).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import structlog

from broker.errors import MOVING, BrokerError, shown
from broker.logformat import system_records
from broker.ports import MoveDone
from broker.storage.failpoints import failpoint
from broker.store import Store
from replication.coordination import slots as sl
from replication.coordination.cluster_map import ClusterMap
from replication.coordination.etcd import Etcd
from replication.txn_peers import ShardPeers

log = structlog.get_logger("replication.slot_moves")
IMPORT_OFFSETS_MAX = 10_000  # offsets per ImportOffsets call
IMPORT_TIMEOUT_S = 10.0
FLUSH_TIMEOUT_S = 10.0
TXN_VIEW_WAIT_S = 0.5  # a round waits this long for the transactions view to apply the log, else the next

Written = Callable[[Callable[[Etcd], Coroutine[Any, Any, int]]], int]


async def _replace_slot(slot: int, expected: bytes, record: bytes, leader_revision: int, etcd: Etcd) -> int:
    return await etcd.replace_slot(slot, expected, record, leader_revision)


async def create_slot(slot: int, record: bytes, etcd: Etcd) -> int:
    """A slot's first record (create-only); its revision, 0 when one was given meanwhile."""
    return await etcd.create_slot(slot, record)


class SlotMoves:
    def __init__(self, store: Store, shard: str, cluster: ClusterMap, written: Written,
                 leader_revision: Callable[[], int], peers: ShardPeers, wake: Callable[[], None],
                 refusal: Callable[[str, str], BrokerError]) -> None:
        self.store = store
        self._refusal = refusal  # FAILED_PRECONDITION naming the shard that serves what was asked
        self.shard = shard
        self.cluster = cluster
        self._written = written
        self._leader_revision = leader_revision
        self._peers = peers
        self._wake = wake
        # per slot leaving this shard: the transactions open when this master first saw it leave
        # (those that could still commit its groups' offsets); they must end before the hand-over
        self._open_at_close: dict[int, set[int]] = {}

    # -- every node ---------------------------------------------------------------------------------
    def check_open(self, names: set[str], pid: int = 0) -> None:
        """UNAVAILABLE (moving) if one of ``names`` (groups, transactional ids) hashes to a slot
        this shard coordinates that is moving away -- unless transaction ``pid`` is one the move
        waits for (open when this master first saw the slot leave, or before it looked): what it
        commits is in the log before the hand-over reads it."""
        for name in names:
            slot = sl.slot_of(name)
            shard, to = self.cluster.slot_record(slot)  # read together: the switch may land any moment
            if shard is not None and shard != self.shard:  # moved away since the caller's first check
                raise self._refusal(f"group {shown(name)} (slot {slot})", shard)
            if to is None:
                continue
            waited = self._open_at_close.get(slot)
            if not (pid and (waited is None or pid in waited)):
                raise BrokerError("UNAVAILABLE", f"group slot {slot} (of {shown(name)}) is moving to shard {to!r}: "
                                  "nothing of this was stored; retry (it is coordinated there once moved)",
                                  metadata=MOVING)

    def move(self, slot: int, to_shard: str, timeout_s: float) -> str:
        """Ask for the move (in etcd) and wait until ``to_shard`` coordinates the slot."""
        if not 0 <= slot < sl.SLOTS:
            raise BrokerError("INVALID_ARGUMENT", f"a group slot is 0..{sl.SLOTS - 1}, got {slot}")
        current, moving = self.cluster.slot_record(slot)
        if moving is not None and current == to_shard:  # called off: the source keeps it (unless switched meanwhile)
            revision = self._written(functools.partial(_replace_slot, slot, sl.encode(current, moving),
                                                       sl.encode(current), 0))
            if not revision:
                raise BrokerError("ABORTED", f"group slot {slot} changed in etcd meanwhile (switched?); ask again")
            log.warning("slot_move_called_off", slot=slot, shard=current, target=moving, revision=revision)
            moving = None
        if moving is not None and moving != to_shard:
            raise BrokerError("FAILED_PRECONDITION", f"group slot {slot} is moving to shard {moving!r} already; ask "
                              "again once it is there")
        if current != to_shard and moving is None:
            self._check_target(to_shard)
            if current is None:  # no group of it yet: given to the target at once
                revision = self._written(functools.partial(create_slot, slot, sl.encode(to_shard)))
            else:
                revision = self._written(functools.partial(_replace_slot, slot, sl.encode(current),
                                                           sl.encode(current, to_shard), 0))
            if not revision:
                raise BrokerError("ABORTED", f"group slot {slot} changed in etcd meanwhile; ask for the move again")
            log.info("slot_move_asked", slot=slot, source=current or "", target=to_shard, revision=revision)
            self._wake()
        if not self.cluster.wait_for(lambda: self._moved(slot, to_shard), timeout_s):
            raise BrokerError("DEADLINE_EXCEEDED", f"group slot {slot} is not on shard {to_shard!r} yet after "
                              f"{timeout_s:g} s (its open transactions end first); the move goes on (cluster status "
                              "shows it)")
        return to_shard

    def _moved(self, slot: int, to_shard: str) -> bool:
        return self.cluster.slots.get(slot) == to_shard and slot not in self.cluster.slot_moves  # under the copy's lock

    def _check_target(self, to_shard: str) -> None:
        if self.cluster.is_draining(to_shard):
            raise BrokerError("FAILED_PRECONDITION", f"shard {to_shard!r} is being drained: no group slot moves to it")
        if self.cluster.master(to_shard) is None:
            raise BrokerError("FAILED_PRECONDITION", f"shard {to_shard!r} has no master now (or does not exist): "
                              f"the shards with one are {', '.join(sorted(self.cluster.live_shards())) or 'none'}")

    def drain(self, shard: str, deadline: float, dry_run: bool) -> list[MoveDone]:
        """Every slot of ``shard`` to the live shards that are not draining, fewest slots first (each
        a ``MoveDone`` with topic '' and the slot as its queue); ``dry_run``: the plan only."""
        draining = self.cluster.draining_shards() | {shard}
        targets = [s for s in self.cluster.live_shards() if s not in draining]
        held = self.cluster.slots_held()
        done = []
        for slot in sorted(s for s, owner in self.cluster.slot_map().items() if owner == shard):
            if not targets:
                done.append(MoveDone("", slot, shard, "", 0.0, "FAILED_PRECONDITION: no other shard with a master "
                                     "takes group slots"))
                continue
            target = sl.pick(held, targets)
            held[target] = held.get(target, 0) + 1
            if dry_run:
                done.append(MoveDone("", slot, shard, target, 0.0, ""))
                continue
            started = time.monotonic()
            try:
                self.move(slot, target, max(0.1, deadline - time.monotonic()))
                error = ""
            except BrokerError as exc:
                error = f"{exc.code}: {exc.message}"[:300]
            done.append(MoveDone("", slot, shard, target, time.monotonic() - started, error))
        return done

    # -- the source shard's master ------------------------------------------------------------------
    def seal_moving(self) -> None:
        """Each slot leaving this shard is handed over once nothing can commit its groups' offsets
        here any more; one that cannot yet (or fails: etcd, the target) is tried again next round."""
        leaving = {slot: to for slot, (source, to) in self.cluster.slot_moves_in_flight().items() if source == self.shard}
        for slot in set(self._open_at_close) - set(leaving):
            del self._open_at_close[slot]
        leader_revision = self._leader_revision()
        if not leaving or not leader_revision:
            return
        transactions = self.store.views.txns
        # a master that took office moments ago: its transactions view has applied the log first
        if not self.store.dispatcher.wait_applied(transactions, self.store.log.max_offset, TXN_VIEW_WAIT_S):
            return
        open_txns = transactions.open_transactions()
        open_now = {t.pid for t in open_txns}
        failed: set[str] = set()  # targets that failed this round: their other slots wait for the next
        for slot, to in sorted(leaving.items()):
            waiting = self._open_at_close.setdefault(slot, set(open_now)) & open_now
            self._open_at_close[slot] = waiting
            # the slot's own ids open (begun before the close reached this master's copy): one id is
            # never open on two coordinators
            own = [t.pid for t in open_txns if sl.slot_of(t.tid) == slot]
            undelivered = [u.tid for u in transactions.undelivered_decisions() if sl.slot_of(u.tid) == slot]
            if waiting or own or undelivered or to in failed:
                continue  # their end (commit, abort or timeout) comes first
            try:
                self._hand_over(slot, to, leader_revision)
            except BrokerError as exc:
                failed.add(to)
                log.warning("slot_hand_over_failed", slot=slot, target=to, error=exc.message[:200],
                            note="tried again at the next round")

    def _hand_over(self, slot: int, to: str, leader_revision: int) -> None:
        self.store.flush_offsets(FLUSH_TIMEOUT_S)  # what the gate let in before it closed, applied
        if not self.store.wait_metadata_applied(self.store.log.max_offset, FLUSH_TIMEOUT_S):
            raise BrokerError("UNAVAILABLE", "the metadata view has not applied the log's end yet")
        offsets = [e for e in self.store.views.metadata.group_offsets() if sl.slot_of(e[0]) == slot]
        for start in range(0, len(offsets), IMPORT_OFFSETS_MAX):
            self._peers.import_offsets(to, slot, self.shard, offsets[start:start + IMPORT_OFFSETS_MAX], IMPORT_TIMEOUT_S)
        failpoint("slot_after_import")
        revision = self._written(functools.partial(_replace_slot, slot, sl.encode(self.shard, to), sl.encode(to),
                                                   leader_revision))
        if revision:  # nothing of the slot is let in here any more (the copy may show the switch late)
            self._open_at_close[slot] = set()
            log.info("slot_moved", slot=slot, source=self.shard, target=to, offsets=len(offsets), revision=revision)
        else:
            log.warning("slot_switch_not_written", slot=slot, target=to,
                        note="the record changed or this node is no longer the shard's leader")

    # -- the target shard's master ------------------------------------------------------------------
    def import_offsets(self, slot: int, source_shard: str, offsets: list[tuple[str, str, int, int]]) -> int:
        if len(offsets) > IMPORT_OFFSETS_MAX:
            raise BrokerError("INVALID_ARGUMENT", f"an ImportOffsets call takes at most {IMPORT_OFFSETS_MAX} offsets")
        if any(sl.slot_of(g) != slot for g, _, _, _ in offsets):
            raise BrokerError("INVALID_ARGUMENT", f"every group of an import of slot {slot} hashes to that slot")
        shard, to = self.cluster.slot_record(slot)
        if shard == self.shard and to is None:
            raise BrokerError("FAILED_PRECONDITION", f"group slot {slot} is coordinated here already: a late import "
                              "would put back older offsets")
        if shard != source_shard or to != self.shard:
            raise BrokerError("UNAVAILABLE", f"this node's copy of etcd does not show group slot {slot} moving from "
                              f"shard {source_shard!r} to {self.shard!r} (yet); retry")
        metadata = self.store.views.metadata
        kept = []
        for entry in offsets:
            topic = entry[1]
            if metadata.topic(topic) is not None:
                kept.append(list(entry))
            elif not self.cluster.is_deleted(topic):  # placed, not yet created here (or not in this copy yet)
                self._wake()
                raise BrokerError("UNAVAILABLE", f"topic {shown(topic)} is not in shard {self.shard!r}'s log yet; "
                                  "retry in a moment")
            # else: a topic deleted meanwhile; its offsets go with it
        if kept:
            self.store.writes.write_system([(system_records.OFFSETS_COMMIT, {"offsets": kept})],
                                           applied=self.store.views.metadata)
        log.info("slot_offsets_imported", slot=slot, source=source_shard, offsets=len(kept))
        return len(kept)
