"""A transaction over shards, on its coordinator shard's master (docs/shards.md "Transactions
across shards"): the two-phase commit and the delivery of decisions.

The coordinator's own transaction (begun here, the shard of the transactional id's slot) holds
the messages of its own queues and lists its participants: a transaction of the same id on each
other shard the producer sent to (``txn.participant`` records, replicated before the producer
sends there). Committing:

1. each participant is asked to **prepare** (``TxnPeers.prepare``): its master checks that its
   log holds every message the producer counted there and replicates ``txn.prepare``; from then
   on only this coordinator ends it. A participant that cannot be reached is asked again until
   ``limits.send_timeout_ms`` has passed (its failover takes seconds): a promoted slave knows
   what its old master prepared;
2. the **decision** is appended here (``txn.end`` naming the participants): commit if every
   participant prepared and this log holds the coordinator's own count, else abort. It is
   replicated before the producer is answered. This record is the transaction's outcome;
3. it is **delivered** to each participant (``TxnPeers.decide``) and a ``txn.delivered`` record
   ends the coordinator's part. Any decision without its ``txn.delivered`` (an abort by the
   producer, a timeout, fencing, an operator; a master that died mid-delivery) is delivered by
   the ``TxnDelivery`` thread of whichever node is master, retried until each participant
   answers, across failovers of either side (a retried decision answers the first outcome).

A participant that has not prepared may still abort by itself (its timeout, an operator, a newer
instance): the coordinator's prepare then finds it aborted and the decision is abort. A prepared
participant holds its queues' last stable offset until the decision arrives.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import structlog

from broker.errors import BrokerError
from broker.logformat import txn_records as tr
from broker.ports import TxnPeers
from broker.storage.failpoints import failpoint
from broker.store import Store
from broker.store.appender import TailState
from broker.store.waiters import run
from broker.threads import NamedThread, name_pool_thread
from broker.txn.service import OffsetEntry, Outcome, TxnService, check_parties, check_tid
from broker.views.transactions import Undelivered

log = structlog.get_logger("txn")
CALL_TIMEOUT_S = 5.0  # one call to a participant's master
PEER_CALLS_MAX = 8  # calls to participants' masters at once (prepares and decisions of every transaction)
RETRY_PAUSE_S = 0.2
DELIVERY_INTERVAL_S = 0.2
DELIVERY_BACKOFF_MAX_S = 5.0


class OverShards:
    """The coordinator's side of transactions over shards."""

    def __init__(self, store: Store, service: TxnService) -> None:
        self.store = store
        self.service = service
        self.kick = threading.Event()  # a decision to deliver now
        # per decision being delivered: a lock (the producer's commit and the thread, one at a time),
        # the participants that answered, and those whose txn.delivered is appended (the view applies
        # it later: not delivered twice meanwhile)
        self._state_lock = threading.Lock()
        self._locks: dict[int, threading.Lock] = {}
        self._answered: dict[int, set[tuple[str, int]]] = {}
        self._done: set[int] = set()
        self._pending_before: set[int] = set()
        self._pool = ThreadPoolExecutor(PEER_CALLS_MAX, thread_name_prefix="txn-peer", initializer=name_pool_thread)

    def peers(self) -> TxnPeers:
        if self.store.txn_peers is None:
            raise BrokerError("FAILED_PRECONDITION", "this node is not in a cluster of shards: a transaction has no "
                              "participants here")
        return self.store.txn_peers

    def commit(self, tid: str, pid: int, messages_sent: int, offsets: list[OffsetEntry],
               parties: tuple[tr.Party, ...]) -> Outcome:
        """Commit transaction ``pid`` and its participants ``parties`` (each with its count and
        offsets, as the producer gives them): prepare each, decide, deliver."""
        check_tid(tid)
        self.store.check_writable()
        peers = self.peers()
        appender = self.store.appender
        with appender.lock:  # nothing is prepared but exactly the registered participants of an open one
            if appender.tail.txn_open.get(pid) == tid:
                check_parties(appender.tail, tid, pid, parties)
                ended, registered_end = False, appender.tail.txn_end
            else:
                ended, registered_end = True, 0
        if ended:  # a retried commit: its first outcome
            return self.service.end(tid, pid, True, offsets, messages_sent=messages_sent, parties=parties)
        # registrations are answered once appended: replicated before any participant prepares, so
        # that a prepared participant is always known to whichever node is this shard's master
        self.store.writes.acknowledged(registered_end, "replica", what="the participants' registrations")
        deadline = time.monotonic() + self.store.config["limits.send_timeout_ms"] / 1000.0
        # every participant at once: a commit waits for the slowest prepare, not for their sum
        asked = [(party, self._pool.submit(self._prepare, peers, tid, party, deadline)) for party in parties]
        refusal = ""
        for party, answer in asked:
            if answer.result():
                refusal = answer.result()
                log.warning("txn_participant_refused", transactional_id=tid, pid=f"{pid:#x}", shard=party.shard,
                            reason=refusal)
        if refusal:
            outcome = self.service.end(tid, pid, False, reason="participant")
        else:
            outcome = self.service.end(tid, pid, True, offsets, messages_sent=messages_sent, parties=parties)
        failpoint("txn_after_global_decision")
        try:
            self.deliver_now(pid)
        except Exception as exc:  # decided and durable: the producer's answer stands, the thread delivers
            log.warning("txn_delivery_deferred", transactional_id=tid, error=f"{type(exc).__name__}: {exc}"[:300])
            self.kick.set()
        return outcome

    def _prepare(self, peers: TxnPeers, tid: str, party: tr.Party, deadline: float) -> str:
        """'' once ``party`` prepared, else why not (the reason it aborted, or its last error)."""
        while True:
            try:
                return peers.prepare(tid, party, CALL_TIMEOUT_S)
            except BrokerError as exc:
                if exc.code in ("INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "UNAUTHENTICATED") \
                        or time.monotonic() >= deadline:
                    return f"{exc.code}: {exc.message}"[:300]
                log.info("txn_prepare_retried", transactional_id=tid, shard=party.shard, error=exc.message[:200])
                time.sleep(RETRY_PAUSE_S)
            except Exception as exc:  # not prepared, as far as this node knows: abort
                log.warning("txn_prepare_failed", transactional_id=tid, shard=party.shard,
                            error=f"{type(exc).__name__}: {exc}"[:300])
                return f"{type(exc).__name__}: {exc}"[:300]

    def deliver_now(self, pid: int) -> None:
        """One attempt at delivering ``pid``'s decision (the producer's answer waits for it, so
        that its next read on a participant's shard finds it); what fails is left to the thread."""
        decision = next((u for u in self.service.view.undelivered_decisions() if u.pid == pid), None)
        if decision is None or not self.deliver(decision, wait=False):  # not applied yet, or delivering
            self.kick.set()

    def deliver(self, decision: Undelivered, *, wait: bool = True) -> bool:
        """Deliver ``decision`` to each participant that has not answered yet; True once all have
        (``txn.delivered`` appended). One delivery of a decision at a time (``wait``: for another
        one of the same decision to end; else False at once)."""
        if decision.at >= self.store.watermarks.confirm_offset:
            return False  # not confirmed yet: a master deposed now would take it with its log's tail
        with self._state_lock:
            lock = self._locks.setdefault(decision.pid, threading.Lock())
        if not lock.acquire(blocking=wait):
            return False
        try:
            if decision.pid in self._done:
                return True
            return self._deliver(decision)
        finally:
            lock.release()

    def _deliver(self, decision: Undelivered) -> bool:
        peers = self.peers()
        answered = self._answered.setdefault(decision.pid, set())
        told = [(party, self._pool.submit(self._decide, peers, decision, party)) for party in decision.parties
                if (party.shard, party.pid) not in answered]  # every one at once: one down holds up only itself
        for party, done in told:
            if done.result():
                answered.add((party.shard, party.pid))
        if len(answered) < len({(p.shard, p.pid) for p in decision.parties}):
            return False
        self._delivered(decision)
        self._done.add(decision.pid)
        return True

    @staticmethod
    def _decide(peers: TxnPeers, decision: Undelivered, party: tr.Party) -> bool:
        """Tell ``party`` the decision; whether it answered."""
        try:
            committed = peers.decide(decision.tid, party, decision.commit, CALL_TIMEOUT_S)
        except BrokerError as exc:
            if exc.code != "NOT_FOUND":  # NOT_FOUND: forgotten there, it ended long ago (as decided)
                log.info("txn_delivery_retried", transactional_id=decision.tid, shard=party.shard,
                         error=exc.message[:200])
                return False
            committed = decision.commit
        except Exception as exc:  # a credential file that does not read, say: retried
            log.warning("txn_delivery_failed", transactional_id=decision.tid, shard=party.shard,
                        error=f"{type(exc).__name__}: {exc}"[:300])
            return False
        if committed != decision.commit:
            log.error("txn_participant_disagrees", transactional_id=decision.tid, shard=party.shard,
                      pid=f"{party.pid:#x}", decision=decision.commit)
        return True

    def forget(self, pending: set[int]) -> None:
        """Drop what is kept of decisions pending in neither this snapshot of the view nor the one
        before (delivered and applied; one decided between two snapshots is kept)."""
        with self._state_lock:
            keep = pending | self._pending_before
            self._pending_before = pending
            self._locks = {p: lock for p, lock in self._locks.items() if p in keep or lock.locked()}
            self._answered = {p: shards for p, shards in self._answered.items() if p in self._locks}
            self._done &= keep

    def reset(self) -> None:
        """A new term (this node's role or epoch changed): what the last one delivered is not
        trusted (a ``txn.delivered`` it appended may have been cut with its log's tail)."""
        with self._state_lock:
            self._answered.clear()
            self._done.clear()
            self._pending_before = set()

    def _delivered(self, decision: Undelivered) -> None:
        def build(_tail: TailState, _offset: int) -> list[tuple[bytes, bytes]]:
            return [tr.encode_delivered(decision.tid, decision.pid)]
        run(self.store.writes.txn_steps(build, None, lambda _: "leader"))  # lost with a failover: delivered again


class TxnDelivery:
    """The master's thread delivering decisions without their ``txn.delivered``: each retried with
    a growing pause (up to ``DELIVERY_BACKOFF_MAX_S``) until every participant has it."""

    def __init__(self, store: Store, over_shards: OverShards) -> None:
        self.store = store
        self.over_shards = over_shards
        self._next_try: dict[int, tuple[float, float]] = {}  # pid -> (monotonic time, pause)
        self._term: tuple[str, int] = ("", -1)  # the role and epoch the kept state belongs to
        self._stop = threading.Event()
        self._thread = NamedThread(target=self._run, name="txn-delivery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.over_shards.kick.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.over_shards.kick.wait(DELIVERY_INTERVAL_S)
            self.over_shards.kick.clear()
            if self._stop.is_set() or self.store.closing:
                return
            term = (self.store.role, self.store.epoch)
            if term != self._term:
                self._term = term
                self._next_try.clear()
                self.over_shards.reset()
            if self.store.role != "master" or self.store.txn_peers is None or self.store.fenced_reason:
                continue
            try:
                self._round()
            except BrokerError as exc:  # not writable now (fenced, a full disk): next round
                log.debug("txn_delivery_refused", error=exc.message[:200])
            except Exception as exc:  # never end the thread: decisions would stay undelivered
                log.error("txn_delivery_failed", error=f"{type(exc).__name__}: {exc}"[:300])

    def _round(self) -> None:
        now = time.monotonic()
        pending = self.over_shards.service.view.undelivered_decisions()
        pids = {u.pid for u in pending}
        for pid in [p for p in self._next_try if p not in pids]:
            del self._next_try[pid]
        self.over_shards.forget(pids)
        for decision in pending:
            at, pause = self._next_try.get(decision.pid, (0.0, DELIVERY_INTERVAL_S))
            if now < at:
                continue
            try:
                delivered = self.over_shards.deliver(decision)
            except BrokerError as exc:  # txn.delivered not written (a full disk, fenced): this one later
                log.debug("txn_delivered_not_written", transactional_id=decision.tid, error=exc.message[:200])
                delivered = False
            if not delivered:
                self._next_try[decision.pid] = (now + pause, min(pause * 2, DELIVERY_BACKOFF_MAX_S))
