"""Transactions on the master (DESIGN §14): begin, end, an operator's abort, timeouts.

Every decision is a ``__txn`` record appended under the append lock (``Appender.append_txn``),
so it is taken against the transactions open at that instant in the log's order: a begin that
finds its transactional id's older transaction open aborts it in the same batch (reason
``fenced``), an end of a transaction that is no longer open appends nothing and answers the
first outcome, a send of a transaction that ended is refused by the appender. The producer's
begin and end are answered once replicated, not once the transactions view applied them (the
append side's own state decides every later call; a read_committed pull waits for the view,
``rpc/data.py``); an operator's, the sweeper's and a check-back's end, and an end with consumer
offsets, are answered once applied.

Acknowledgement: an end is acknowledged as ack=replica. A **counted** transaction (its producer
gives, with its commit, the number of messages it sent; no check-back) has its begin and its sends
acknowledged at the ack mode they ask for, as Kafka's producer pipelines its transaction's sends:
the commit record, replicated, covers everything before it in the log, and the commit is decided
under the append lock against the messages this node's log holds for the transaction. A send
answered by a master that failed before replicating it is not in the next master's log; a commit
there finds its count short and aborts the transaction instead (reason ``incomplete``), so no
commit ever makes part of a transaction visible. A begin that fences an older instance is always
acknowledged as ack=replica (the fence must survive a failover). An uncounted transaction's sends
are answered as ack=replica whatever they ask (``rpc/data.py``).

The sweeper (``sweep``, run by ``TxnSweeper`` on the master) ends transactions past their
timeout, counted from their first write: a ``check_back`` one is first asked about
(``checks.py``) every ``transactions.check_interval_ms``, ``transactions.check_max`` times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from broker import clock
from broker.errors import BrokerError, invalid, not_found, shown
from broker.logformat import batch as bf
from broker.logformat import txn_records as tr
from broker.logformat.errors import CorruptionError
from broker.storage.failpoints import failpoint
from broker.store import Store
from broker.store.appender import TailState, TxnBuild
from broker.store.waiters import Steps, run, run_async
from broker.views.transactions import Ended, OpenTxn, TxnView

log = structlog.get_logger("txn")
TID_BYTES_MAX = 200
OffsetEntry = tuple[str, str, int, int]  # group, topic, queue, offset
END_LOOKUP_WAIT_S = 5.0  # a retried end waits this long for the view to apply the first end


PARTIES_MAX = 64  # shards one transaction spans


def _check_over_shards(tail: TailState, tid: str, pid: int, commit: bool, reason: str,
                       parties: tuple[tr.Party, ...] | None) -> None:
    """Under the append lock: who may end a transaction over shards, and how (docs/shards.md). A
    participant's is ended by its coordinator only (or, before it prepared, by its own timeout, an
    operator, a newer instance); a coordinator's is committed only with exactly its registered
    participants, each prepared (``coordinator.py``)."""
    coordinator = tail.txn_coordinated.get(pid)
    if coordinator is None and reason == "coordinator":
        raise invalid(f"transaction {pid:#x} of {shown(tid)} is not a participant transaction: no coordinator "
                      "decides it")
    if coordinator is not None:
        if reason == "client":
            raise BrokerError("FAILED_PRECONDITION", f"transaction {pid:#x} of {shown(tid)} is a participant: its "
                              f"coordinator shard {shown(coordinator)} decides it (end it there)")
        if pid in tail.txn_prepared and reason != "coordinator":
            raise BrokerError("FAILED_PRECONDITION", f"transaction {pid:#x} of {shown(tid)} is prepared: only its "
                              f"coordinator shard {shown(coordinator)} ends it now")
        if commit and pid not in tail.txn_prepared:
            raise BrokerError("FAILED_PRECONDITION", f"transaction {pid:#x} of {shown(tid)} was not prepared: a "
                              "commit reaches a participant only after it prepared")
        return
    if commit:
        check_parties(tail, tid, pid, parties or ())


def check_parties(tail: TailState, tid: str, pid: int, parties: tuple[tr.Party, ...]) -> None:
    """Under the append lock: ``parties`` are exactly the participants registered for ``pid``, each
    once (a commit over shards prepares them first, and its decision is delivered to them)."""
    registered = {(p.shard, p.pid) for p in tail.txn_parties.get(pid, ())}
    given = [(p.shard, p.pid) for p in parties]
    if len(set(given)) != len(given) or set(given) != registered:
        raise BrokerError("FAILED_PRECONDITION", f"transaction {pid:#x} of {shown(tid)} has {len(registered)} "
                          f"participants registered, the commit names {len(given)}: a transaction over shards "
                          "commits with exactly its registered participants, each once "
                          "(EndTransactionRequest.participants)")


@dataclass(frozen=True)
class Begun:
    pid: int
    epoch: int
    timeout_ms: int
    counted: bool


@dataclass(frozen=True)
class Outcome:
    committed: bool
    reason: str


def check_tid(tid: str) -> None:
    if not tid or len(tid.encode()) > TID_BYTES_MAX or not tid.isprintable():
        raise invalid(f"transactional id {shown(tid)} must be 1-{TID_BYTES_MAX} bytes of printable characters")


@dataclass
class BeginPlan:
    tid: str
    timeout_ms: int
    check_back: bool
    counted: bool
    open_max: int
    begin_id: int = 0
    coordinator: str = ""  # a participant transaction: the shard deciding it (docs/shards.md)
    coordinator_epoch: int = 0  # and that transaction's epoch there: the participant's own
    replicated: bool = False  # acknowledged as ack=replica (a coordinator's begin over shards)
    rejoined: Begun | None = None  # set under the append lock when a retry joins its first attempt's

    def rejoin(self, tail: TailState) -> int | None:
        """Under the append lock: the transaction this call's first attempt began (its begin
        carried the same begin id and is the id's latest), or None."""
        latest = tail.txn_latest.get(self.tid) if self.begin_id else None
        if latest is None or latest[2] != self.begin_id:
            return None
        pid, epoch, _ = latest
        self.rejoined = Begun(pid, epoch, self.timeout_ms, self.counted)
        log.info("txn_begin_retried", transactional_id=self.tid, pid=f"{pid:#x}", open=pid in tail.txn_open)
        return pid

    def build(self, tail: TailState, offset: int) -> list[tuple[bytes, bytes]]:
        """Under the append lock: an older open transaction of the id is aborted (fenced) first.
        Nothing for a retry whose first attempt began it (``rejoin``)."""
        if self.rejoin(tail) is not None:
            return []
        older = tail.txn_by_tid.get(self.tid)
        if older is not None and older in tail.txn_prepared:
            raise BrokerError("UNAVAILABLE", f"transaction {older:#x} of {shown(self.tid)} is prepared and waits for "
                              f"its coordinator shard {shown(tail.txn_coordinated.get(older, ''))}'s decision; "
                              "retry shortly")
        if older is None and len(tail.txn_open) >= self.open_max:
            raise BrokerError("RESOURCE_EXHAUSTED", f"{self.open_max} transactions are open on this node "
                              "(transactions.open_max); commit or abort some, or wait for their timeouts")
        latest_epoch = tail.txn_latest[self.tid][1] if self.tid in tail.txn_latest else 0
        # a late participant of an older instance never fences the newer one's (KIP-890's lesson)
        if self.coordinator and older in tail.txn_coordinated and latest_epoch > self.coordinator_epoch:
            raise BrokerError("FAILED_PRECONDITION", f"{shown(self.tid)} epoch {self.coordinator_epoch} was fenced: "
                              f"a newer instance (epoch {latest_epoch}) began here; nothing of this one is visible")
        items = ([tr.encode_end(self.tid, older, False, "fenced", participants=tuple(tail.txn_parties.get(older, ())))]
                 if older is not None else [])
        # a participant takes its coordinator transaction's epoch: an older instance's arrives late
        epoch = self.coordinator_epoch if self.coordinator else latest_epoch + 1
        items.append(tr.encode_begin(self.tid, epoch, self.timeout_ms, self.check_back, self.counted,
                                     tr.new_pid(offset), self.begin_id, self.coordinator))
        return items

    def ack(self, records: list[tr.Record]) -> str:
        """A counted begin is acknowledged as ack=leader (its commit, replicated, covers it), unless
        it fenced an older instance (two records): that abort must survive a failover; or it begins
        a transaction over shards on its coordinator (``replicated``): its epoch, which its
        participants carry, must never be given twice."""
        return "leader" if self.counted and len(records) == 1 and not self.replicated else "replica"

    def begun(self, records: list[tr.Record]) -> Begun:
        if not records:  # a retry joined the transaction its first attempt began
            assert self.rejoined is not None
            return self.rejoined
        begin = records[-1]
        assert isinstance(begin, tr.Begin)
        if len(records) > 1:
            log.info("txn_fenced", transactional_id=self.tid, pid=f"{records[0].pid:#x}", epoch=begin.epoch)
        return Begun(begin.pid, begin.epoch, self.timeout_ms, begin.counted)


class TxnService:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.config = store.config
        self.view = store.views.txns

    # -- begin --------------------------------------------------------------------------------------
    # Each call has one plan (checks, and what to write, decided under the append lock) and two
    # drivers: a thread's (the sweeper, operators, an end with offsets) and the event loop's (the
    # client's begin and end: one thread hand-off fewer per call, issue 37's throughput).
    def begin(self, tid: str, timeout_ms: int, check_back: bool, count_messages: bool = False,
              begin_id: int = 0) -> Begun:
        return run(self._begin_steps(self.begin_plan(tid, timeout_ms, check_back, count_messages, begin_id)))

    async def begin_async(self, tid: str, timeout_ms: int, check_back: bool, count_messages: bool = False,
                          begin_id: int = 0, coordinator: str = "", coordinator_epoch: int = 0) -> Begun:
        return await run_async(self._begin_steps(self.begin_plan(tid, timeout_ms, check_back, count_messages,
                                                                 begin_id, coordinator, coordinator_epoch)))

    def _begin_steps(self, plan: BeginPlan) -> Steps[Begun]:
        records, _ = yield from self.store.writes.txn_steps(plan.build, None, plan.ack)
        return plan.begun(records)

    def begin_plan(self, tid: str, timeout_ms: int, check_back: bool, count_messages: bool,
                   begin_id: int = 0, coordinator: str = "", coordinator_epoch: int = 0) -> BeginPlan:
        check_tid(tid)
        if coordinator and (check_back or not count_messages or not coordinator_epoch):
            raise invalid("a participant transaction (coordinator set) is counted, has no check-back and names its "
                          "coordinator transaction's epoch (coordinator_epoch)")
        top = self.config["transactions.max_timeout_ms"]
        if timeout_ms > top:
            raise invalid(f"timeout_ms {timeout_ms} is above transactions.max_timeout_ms ({top})")
        timeout_ms = timeout_ms or min(self.config["transactions.timeout_ms"], top)
        counted = count_messages and not check_back  # a check-back's commit has no count to check
        return BeginPlan(tid, timeout_ms, check_back, counted, self.config["transactions.open_max"], begin_id,
                         coordinator, coordinator_epoch, replicated=self.store.placement is not None and not coordinator)

    # -- end ----------------------------------------------------------------------------------------
    def end(self, tid: str, pid: int, commit: bool, offsets: list[OffsetEntry] | None = None,
            reason: str = "client", messages_sent: int | None = None,
            parties: tuple[tr.Party, ...] | None = None) -> Outcome:
        """Commit or abort; a transaction that is no longer open answers how it ended first.
        ``messages_sent``: a counted transaction's count, checked against its messages in the log.
        ``parties``: a transaction over shards committed by its coordinator after every participant
        prepared (``coordinator.py``): exactly the participants registered, with their counts."""
        offsets = self._end_checks(tid, pid, commit, offsets)
        if offsets:
            self.store.offsets.commit([], wait_s=self.config["limits.send_timeout_ms"] / 1000.0)  # older commits first
        return run(self._end_steps(tid, pid, commit, reason, offsets, messages_sent, self.view, parties))

    async def end_async(self, tid: str, pid: int, commit: bool, messages_sent: int | None = None) -> Outcome:
        """``end`` by the client, without offsets, on the event loop."""
        self._end_checks(tid, pid, commit, None)
        return await run_async(self._end_steps(tid, pid, commit, "client", [], messages_sent, None))

    def _end_steps(self, tid: str, pid: int, commit: bool, reason: str, offsets: list[OffsetEntry],
                   messages_sent: int | None, applied: TxnView | None,
                   parties: tuple[tr.Party, ...] | None = None) -> Steps[Outcome]:
        build = self._end_build(tid, pid, commit, reason, offsets, messages_sent, parties)
        records, _ = yield from self.store.writes.txn_steps(build, applied, None)
        failpoint("txn_after_decision")
        decided = self.decided(records)
        if decided is not None:
            return decided
        if self.view.ended_of(pid) is None:  # the first end may not be applied yet
            yield from self.store.watermarks.view_steps(self.view.name, lambda: self.view.applied_offset,
                                                        self.store.appender.log.max_offset, END_LOOKUP_WAIT_S)
        return self._first_outcome(tid, pid, commit)

    def commit_build(self, tid: str, messages_sent: int) -> Callable[[int], TxnBuild]:
        """The commit a send carries (SendRequest.commit), for ``Appender.append_in_txn``: decided
        under the append lock after the send's batches, for the transaction's producer id."""
        check_tid(tid)
        return lambda pid: self._end_build(tid, pid, True, "client", [], messages_sent)

    @staticmethod
    def decided(records: list[tr.Record]) -> Outcome | None:
        """The outcome an end just appended, or None: the transaction was not open (ended before)."""
        if not records:
            return None
        end = records[0]
        assert isinstance(end, tr.End)
        return Outcome(end.commit, end.reason)

    def _end_checks(self, tid: str, pid: int, commit: bool, offsets: list[OffsetEntry] | None) -> list[OffsetEntry]:
        check_tid(tid)
        if not tr.is_txn_pid(pid):
            raise invalid(f"producer id {pid:#x} is not a transaction's (BeginTransactionResponse.producer_id)")
        return (offsets or []) if commit else []

    @staticmethod
    def _end_build(tid: str, pid: int, commit: bool, reason: str, offsets: list[OffsetEntry],
                   messages_sent: int | None, parties: tuple[tr.Party, ...] | None = None) -> TxnBuild:
        def build(tail: TailState, _offset: int) -> list[tuple[bytes, bytes]]:
            if tail.txn_open.get(pid) != tid:
                return []
            _check_over_shards(tail, tid, pid, commit, reason, parties)
            registered = tuple(tail.txn_parties.get(pid, ()))
            # a prepared participant's count was checked when it prepared
            if commit and pid in tail.txn_counted and pid not in tail.txn_prepared \
                    and tail.txn_messages.get(pid, 0) != messages_sent:
                log.warning("txn_incomplete", transactional_id=tid, pid=f"{pid:#x}", sent=messages_sent,
                            in_log=tail.txn_messages.get(pid, 0))
                return [tr.encode_end(tid, pid, False, "incomplete", participants=registered)]
            return [tr.encode_end(tid, pid, commit, reason, offsets, parties if commit and parties else registered)]
        return build

    def _first_outcome(self, tid: str, pid: int, commit: bool) -> Outcome:
        """How a transaction that is not open ended (a retried end, a fenced instance, a timeout),
        as the view knows it."""
        ended = self.view.ended_of(pid)
        if ended is None:
            if not self._begun_here(pid):
                log.warning("txn_lost", transactional_id=tid, pid=f"{pid:#x}")
                return Outcome(False, "lost")
            raise not_found(f"transaction {pid:#x} of {shown(tid)} is unknown here: it ended long ago (the last "
                            f"{len(self.view.ended)} decisions are remembered), or retention removed its begin")
        if ended.tid != tid:
            raise invalid(f"transaction {pid:#x} belongs to {shown(ended.tid)}, not {shown(tid)}")
        if ended.reason == "fenced" and commit:
            raise BrokerError("FAILED_PRECONDITION", f"transaction {pid:#x} of {shown(tid)} was fenced: a newer "
                              "instance began a transaction with the same transactional id, and this one was "
                              "aborted; nothing of it is visible")
        return Outcome(ended.committed, ended.reason)

    def _begun_here(self, pid: int) -> bool:
        """Whether this node's log holds (or held, below retention) ``pid``'s begin. Its ``__txn`` batch
        starts at the producer id's low 48 bits (``tr.new_pid``). A begin answered before it was
        replicated or synced, then lost with a failed master's tail, is not here: the transaction
        can never become visible anywhere, and its end answers aborted, reason ``lost``."""
        at = pid & tr.OFFSET_BITS_MASK
        log_ = self.store.appender.log
        if at < log_.min_offset:
            return True  # retention took it: cannot tell
        if at >= log_.max_offset:
            return False
        try:
            head = log_.read(at, bf.HEADER_BYTES + len(tr.TXN_TOPIC))
            header = bf.decode_header(head, 0)
            if header.topic != tr.TXN_TOPIC or header.base_offset != at:
                return False
            batch = memoryview(log_.read(at, header.batch_bytes))
            return any(isinstance(rec, tr.Begin) and rec.pid == pid for rec in tr.records(header, batch))
        except (CorruptionError, ValueError):  # no batch starts there
            return False

    # -- over shards: the participant's side (the coordinator's is coordinator.py) ------------------
    def add_participant(self, tid: str, pid: int, party: tr.Party) -> None:
        """On the coordinator shard: transaction ``pid`` has participant ``party`` (its transaction
        on another shard), recorded before the producer sends there."""
        check_tid(tid)

        def build(tail: TailState, _offset: int) -> list[tuple[bytes, bytes]]:
            if tail.txn_open.get(pid) != tid:
                raise BrokerError("FAILED_PRECONDITION", f"transaction {pid:#x} of {shown(tid)} is not open here")
            if pid in tail.txn_coordinated:
                raise invalid(f"transaction {pid:#x} is a participant: it has no participants of its own")
            known = tail.txn_parties.get(pid, [])
            if any(p.shard == party.shard and p.pid == party.pid for p in known):
                return []  # a retry
            if any(p.shard == party.shard for p in known):
                raise invalid(f"transaction {pid:#x} has a participant on shard {shown(party.shard)} already")
            if len(known) >= PARTIES_MAX:
                raise BrokerError("RESOURCE_EXHAUSTED", f"a transaction spans at most {PARTIES_MAX} shards")
            return [tr.encode_participant(tid, pid, party)]
        # acknowledged as appended: one lost with a failover leaves a participant the coordinator does
        # not know, which never prepares (a commit must name exactly the registered ones) and ends
        # by its own timeout; the decision, replicated, covers every record before it
        run(self.store.writes.txn_steps(build, None, lambda _: "leader"))

    def prepare(self, tid: str, pid: int, messages_sent: int) -> Outcome | None:
        """On a participant: prepare participant transaction ``pid`` (its ``messages_sent`` in the
        log, a ``txn.prepare`` replicated: it can no longer end by itself). None once prepared;
        else how it ended (aborted: a timeout, a short count, lost with a failed master)."""
        check_tid(tid)

        def build(tail: TailState, _offset: int) -> list[tuple[bytes, bytes]]:
            if tail.txn_open.get(pid) != tid:
                return []
            if pid not in tail.txn_coordinated:
                raise invalid(f"transaction {pid:#x} is not a participant transaction (BeginTransaction.coordinator)")
            if pid in tail.txn_prepared:
                return []
            if tail.txn_messages.get(pid, 0) != messages_sent:
                log.warning("txn_incomplete", transactional_id=tid, pid=f"{pid:#x}", sent=messages_sent,
                            in_log=tail.txn_messages.get(pid, 0))
                return [tr.encode_end(tid, pid, False, "incomplete")]
            return [tr.encode_prepare(tid, pid)]
        records, _ = run(self.store.writes.txn_steps(build, None, None))
        failpoint("txn_after_prepare")
        if records:
            ended = self.decided(records) if isinstance(records[0], tr.End) else None
            return ended
        tail = self.store.appender.tail
        if tail.txn_open.get(pid) == tid:  # prepared by a first attempt: answered once that is replicated
            self.store.writes.acknowledged(tail.txn_end, "replica", what="the transaction record")
            return None
        run(self.store.watermarks.view_steps(self.view.name, lambda: self.view.applied_offset,
                                             self.store.appender.log.max_offset, END_LOOKUP_WAIT_S))
        return self._first_outcome(tid, pid, False)

    def decide(self, tid: str, pid: int, commit: bool, offsets: list[OffsetEntry]) -> Outcome:
        """On a participant: its coordinator's decision (a retried one answers the first outcome).
        Its offsets were checked when it prepared: applied as they are. ``NOT_FOUND`` only when
        the transaction ended so long ago that it is forgotten (it ended as decided: prepared, it
        ended by this decision alone; not prepared, only an abort could reach it)."""
        failpoint("txn_before_decide")
        log_end = self.store.appender.log.max_offset  # a transaction that ended ended below it
        try:
            return self.end(tid, pid, commit, offsets, reason="coordinator")
        except BrokerError as exc:
            if exc.code == "NOT_FOUND" and self.view.applied_offset < log_end:
                raise BrokerError("UNAVAILABLE", f"transaction {pid:#x}'s end is not applied here yet; retry") from exc
            raise

    # -- operators ----------------------------------------------------------------------------------
    def abort_by_operator(self, tid: str) -> Ended:
        check_tid(tid)
        self.store.check_writable()  # before any wait: a slave or a fenced node refuses at once
        self._caught_up()
        pid = self._open_pid(tid)
        self.end(tid, pid, False, reason="operator")
        ended = self.view.ended_of(pid)
        if ended is None:
            raise BrokerError("INTERNAL", f"transaction {pid:#x} ended but the view does not know it")
        return ended

    def _caught_up(self) -> None:
        """A producer's begin or end answered before an operator looks is in what it sees
        (``Decisions.caught_up``: bounded)."""
        self.store.decisions.caught_up(self.store.role == "master")

    def _open_pid(self, tid: str) -> int:
        t = self.view.open_for(tid)
        if t is None:
            raise not_found(f"no open transaction of {shown(tid)}")
        return t.pid

    def open_transactions(self) -> list[OpenTxn]:
        self._caught_up()
        return self.view.open_transactions()

    def describe(self, tid: str) -> OpenTxn | Ended:
        check_tid(tid)
        self._caught_up()
        t = self.view.open_for(tid)
        if t is not None:
            return t
        latest = self.view.latest_of(tid)
        ended = self.view.ended_of(latest[0]) if latest else None
        if ended is None:
            raise not_found(f"transactional id {shown(tid)} has no transaction this node remembers")
        return ended

    # -- timeouts -----------------------------------------------------------------------------------
    def sweep(self, ask: Callable[[OpenTxn, int], bool], attempts: dict[int, tuple[int, float]]) -> int:
        """End the transactions past their timeout; returns how many ended. ``ask(t, attempt)``
        sends a check to ``t``'s producer (False: none connected). ``attempts``: per producer
        id, (checks sent, monotonic time of the last), kept by the caller across sweeps."""
        now_ms = clock.wall_ms()
        ended = 0
        interval_s = self.config["transactions.check_interval_ms"] / 1000.0
        check_max = self.config["transactions.check_max"]
        for t in self.view.open_transactions():
            since = t.first_write_ms or t.begun_ms
            if now_ms - since < t.timeout_ms or t.prepared:  # a prepared one waits for its coordinator
                continue
            if t.check and check_max:
                sent, last = attempts.get(t.pid, (0, 0.0))
                if sent < check_max:
                    if time.monotonic() - last >= interval_s:
                        ask(t, sent + 1)
                        attempts[t.pid] = (sent + 1, time.monotonic())
                    continue
            checks, _ = attempts.pop(t.pid, (0, 0.0))
            try:
                self.end(t.tid, t.pid, False, reason="timeout")
                ended += 1
                log.warning("txn_timed_out", transactional_id=t.tid, pid=f"{t.pid:#x}", timeout_ms=t.timeout_ms,
                            checks=checks)
            except BrokerError as exc:
                log.warning("txn_timeout_not_written", transactional_id=t.tid, error=exc.message[:200])
                if exc.code == "FAILED_PRECONDITION":  # prepared meanwhile (the view lags the append side)
                    continue
                break
        for pid in [p for p in attempts if p not in self.view.open]:
            del attempts[pid]
        return ended
