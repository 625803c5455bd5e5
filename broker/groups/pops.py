"""Pop mode on the master (DESIGN §12): lease messages, end leases, move dead ones to the DLQ.

Every change is one ``__pop`` record per call, or per pass of calls that arrived together
(``broker/daemon/combine.py``; ``broker/logformat/pop_records.py``; a pass of pops carrying acks
writes its ack record and its lease record in one append), applied by
the pop view like any other view, so leases replicate, survive kill -9 and failover, and restart
is bounded by the view's checkpoint. The master decides under a lock per (group, topic, queue):
it first waits until the view has applied its own last record that touched the queue (the whole
log, the first time in an epoch), reads the state, appends the record, and lets the next call on
that queue in; the caller then waits until the record is as durable as an ack=replica send and
applied, and only then answers. So two calls of one group never lease the same message, calls
on different queues run side by side (their records share fsyncs), and an answered pop or ack is
never undone by a failover.

A pop answers runs of adjacent messages as the log batches that hold them (as a pull does) with
one receipt handle per run, and an ack of a run names it by that one handle, so the per-message
cost on both sides is a slice of bytes, not an object.

A lease ends at its deadline; no record marks that: the next pop finds the message available
(the view keeps deadlines; see ``broker/views/pop_leases.py``) and leases it again with
``delivery_count + 1``, or, past ``groups.max_deliveries``, appends it to ``<group>.dlq`` in the
same request as the record that ends it. Acks name leases by receipt handle
(``broker/groups/receipts.py``); an ack whose lease already ended is refused per handle
(FAILED_PRECONDITION: the message is or will be delivered again).
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from broker import metrics
from broker.errors import BrokerError, invalid
from broker.groups import receipts
from broker.groups.dead_letters import DeadLetters
from broker.groups.lease_ends import EndResult, Ends, LeaseEnds
from broker.groups.pop_idle import IdlePops
from broker.groups.pop_locks import KEYS_MAX, QueueKey, QueueLocks
from broker.groups.pop_parts import log, now_ms, record_batch
from broker.groups.pop_reports import PopReports
from broker.logformat import batch as bf
from broker.logformat import pop_records as pr
from broker.ports import POP_AS_ASKED, IncomingBatch
from broker.store import Store
from broker.views.pop_leases import PopQueue
from proto import tidemark_pb2 as pb

# Byte budgets (``limits.pull_bytes_max`` each) one pass of combined pops reads at most: what it
# holds until its record is durable. Pops beyond it are answered empty and ask again.
RUN_BUDGETS = 4


@dataclass(frozen=True, slots=True)
class LeasedRun:
    """A run of adjacent messages leased together, as ``PoppedRun`` carries it (the same fields),
    its batches the bytes the read returned: written to the answer once, never copied into a
    protobuf message first (``rpc/pops.py``)."""

    queue_id: int
    first_offset: int
    count: int
    delivery_count: int
    receipt_handle: str
    batches: list[bytes]  # runs of whole, adjacent batches
    skip_first: int  # records of the first batch before ``first_offset``


class PopPass(NamedTuple):
    """What one pass of combined pops answers."""

    outs: list[list[LeasedRun]]  # per pop: its runs
    wake_ms: int | None  # when the next lease ends (for pops answered empty)
    acked: list[EndResult]  # per pop: its carried acks' refusals, or its error


_Leased = tuple[list[list[LeasedRun]], int, int]  # per pop its runs; where the pass's records end; dead letters


class _Terms(NamedTuple):
    """What the pops of one pass share, and each one's ``max_messages``."""

    group: str
    topic: str
    asks: list[int]
    invisible_ms: int
    start_earliest: bool
    may_create_dlq: bool
    committed: bool


@dataclass(slots=True)
class _Pick:
    """What one pop takes from one queue."""

    queue_id: int
    start: int | None  # the group's first pop of this queue: where its state starts
    offsets: np.ndarray  # to lease (sorted)
    counts: np.ndarray  # deliveries so far, per offset
    dead: np.ndarray
    gone: np.ndarray


class PopService(LeaseEnds, PopReports):
    def __init__(self, store: Store) -> None:
        self.store = store
        self.config = store.config
        self.view = store.views.pops
        self.idle_pops = IdlePops(lambda: store.epoch, self._topic_id)
        self.locks = QueueLocks(store, self.view, self.idle_pops.records_appended)
        self.dead = DeadLetters(store)
        self._rotation: dict[tuple[str, str], int] = {}
        self._rotation_lock = threading.Lock()
        store.register_queue_listener(self.idle_pops.queues_grew)
        store.register_role_listener(self.idle_pops.forget)

    def _topic_id(self, topic: str) -> int:
        info = self.store.views.metadata.topic(topic)
        return int(info["id"]) if info is not None else -1


    # -- requests checks -------------------------------------------------------------------------



    def idle(self, group: str, topic: str) -> tuple[bool, int | None]:
        """A pop would find nothing now, as the last one did (``IdlePops``), and when to look again.
        Only a writable master answers so: anywhere else the pop is refused as it would be."""
        self.store.check_writable()
        return self.idle_pops.still_idle(group, topic, now_ms())



    # -- pop ---------------------------------------------------------------------------------------
    def pop(self, group: str, topic: str, max_messages: int, invisible_ms: int,
            start_earliest: bool, may_create_dlq: bool = True,
            committed: bool = True) -> tuple[list[LeasedRun], int | None]:
        """One pop's runs (``pop_many`` of one)."""
        done = self.pop_many(group, topic, [max_messages], invisible_ms, start_earliest, may_create_dlq, committed)
        return done.outs[0], done.wake_ms

    def pop_many(self, group: str, topic: str, asks: list[int], invisible_ms: int,
                 start_earliest: bool, may_create_dlq: bool = True, committed: bool = True,
                 acks: list[list[str]] | None = None) -> PopPass:
        """Pops of one group and topic that arrived together (``asks``: each one's ``max_messages``),
        leased in one pass and one record: each gets its own runs (what was picked, dealt out in
        order, each read within its own byte budget and all within ``RUN_BUDGETS`` of them; a pop
        left with nothing is answered empty and may ask again at once), all under the record's
        one tag. ``acks``: the receipt handles each pop carries, ended in the same pass (their
        record is appended with the lease record: one write, one durable wait). As one pop each:

        Lease up to ``max_messages``; return them as runs of adjacent messages with the log
        batches that hold them (at most ``limits.pull_bytes_max`` and one batch), or no run and when
        the next lease ends (ms). ``may_create_dlq``: the caller has the role creating a topic needs
        (admin), so a first dead letter may create ``<group>.dlq``. ``committed`` (read_committed):
        nothing at or past a queue's LSO is leased, and aborted transactions' messages end unleased.

        Calls of one group on different queues run side by side (their records share fsyncs): a
        pop takes the queues that no other call holds, from a rotating start; only when every queue
        is busy or empty does it wait for one, then the next."""
        self.check_group(group)
        queues = self.topic_queues(topic)
        self._check_duration("invisible_ms", invisible_ms)
        if min(asks) <= 0:
            raise invalid("max_messages must be positive")
        ends = self.resolve_ends(group, acks, empty_ok=True) if acks is not None else None
        acked = ends.results if ends is not None else []
        if ends is not None and not ends.resolved:
            ends = None  # nothing to end: a pass like any other
        idle, wake_at = self.idle(group, topic)
        if idle and ends is None:
            return PopPass([[] for _ in asks], wake_at, acked)
        order: list[QueueKey] = []
        if idle and ends is not None:  # only the queues the acks touch changed: they may have room now
            order = sorted({(group, topic, h.queue_id) for h in ends.resolved if h.topic == topic and h.queue_id < queues})
        else:
            with self._rotation_lock:
                first = self._rotation.get((group, topic), 0)
                self._rotation[(group, topic)] = (first + 1) % queues
                if len(self._rotation) > KEYS_MAX:
                    self._rotation.clear()
            order = [(group, topic, (first + i) % queues) for i in range(queues)]
        if self.store.placement is not None:  # a cluster of shards: pop leases stay with the segment's shard
            order = [key for key in order if self.store.placement.segment_here(topic, key[2]) is not None]
        asks = [min(ask, self.config["groups.pop_messages_max"]) for ask in asks]
        outs, wake = self._pass(_Terms(group, topic, asks, invisible_ms, start_earliest, may_create_dlq, committed),
                                order, ends, whole=not idle)
        return PopPass(outs, wake if not idle else _earliest(wake, wake_at), acked)

    def _pass(self, t: _Terms, order: list[QueueKey], ends: Ends | None,
              whole: bool) -> tuple[list[list[LeasedRun]], int | None]:
        """One pass over ``order`` (``whole``: the topic's queues here, from a rotating start; else,
        the topic being idle, those of its queues that the acks touch): the queues nobody else
        holds first; only if they gave nothing, each busy one in turn. With ``ends``: their queues
        are held first (in stripe order, settled), the acks decided, and their record appended
        with the lease record. The pick reads the state before the acks: an acked message is still
        leased there (its lease holds past ``now``, the ``now`` of the ack's check), so it is never
        picked again; the room the acks make in a window (``groups.pop_window_max``) is counted at
        once."""
        group, topic, asks = t.group, t.topic, t.asks
        max_messages = sum(asks)
        nothing: list[list[LeasedRun]] = [[] for _ in asks]
        state = self.idle_pops.state(group, topic)
        found = False
        wake: int | None = None
        busy: list[QueueKey] = []
        leased: _Leased | None = None
        settled = set(ends.keys(group)) if ends is not None else set()  # (by holding)
        holding = self.locks.holding(settled) if ends is not None else contextlib.nullcontext(set[int]())
        with holding as mine:
            held: list[threading.Lock] = []
            try:
                now = now_ms()
                acked: list[IncomingBatch] = []
                finished: dict[tuple[str, int], np.ndarray] = {}
                if ends is not None:
                    record, finished = self.ends_record(group, ends, pr.ACK, now)
                    acked = [record] if record is not None else []
                    if not whole:  # an idle topic: only the queues whose leases end here may have room
                        order = [key for key in order if (key[1], key[2]) in finished]
                picks: list[_Pick] = []
                left = max_messages
                for key in order:  # first pass: the queues nobody else holds
                    if left <= 0 and not self._new_queue(key):
                        continue  # (a queue new to the group is visited anyway: its state starts now)
                    if self.locks.stripe(key) not in mine:  # (a stripe the acks hold is this pass's already)
                        lock = self.locks.lock(key)
                        if not lock.acquire(blocking=False):  # busy (or a stripe this call already holds)
                            busy.append(key)
                            continue
                        held.append(lock)
                    if key not in settled:
                        self.locks.settle([key])
                    pick, nxt = self._pick(key, left, t.start_earliest, now, t.committed, finished.get((topic, key[2])))
                    wake = _earliest(wake, nxt)
                    if pick is not None:
                        picks.append(pick)
                        left -= int(pick.offsets.size)
                        found = True
                if picks or acked:
                    leased = self._lease(t, picks, now, acked, [(group, tq[0], tq[1]) for tq in finished])
            finally:
                for lock in held:
                    lock.release()
        idle = False
        try:
            if leased is None or not any(leased[0]):  # second pass: wait for each busy queue, one at a time
                for key in busy:
                    idle, wake_at = self.idle(group, topic)
                    if idle:  # another pop walked every queue since this one began, and found nothing
                        wake = wake_at
                        break
                    with self.locks.holding([key]):
                        now = now_ms()
                        pick, nxt = self._pick(key, max_messages, t.start_earliest, now, t.committed)
                        wake = _earliest(wake, nxt)
                        if pick is not None:
                            found = True
                            got = self._lease(t, [pick], now)
                            leased = got if leased is None else (got[0], max(leased[1], got[1]), leased[2] + got[2])
                            break
        except BrokerError as exc:
            if leased is None or not leased[1]:
                raise
            # the first pass wrote a record (the acks, a queue's start) that nothing leased yet: answer
            # it, empty, once it is durable (failing the call would hide acks done from the retry)
            log.warning("pop_second_pass_failed", group=group, topic=topic, error=str(exc)[:300])
        if leased is None:
            if not found and whole and not idle:  # every queue visited, under its lock
                self.idle_pops.remember(group, topic, state, wake)
            return nothing, wake
        return self._leased(t, leased), wake  # (for a pop answered empty: when a lease ends)

    def _leased(self, t: _Terms, leased: _Leased) -> list[list[LeasedRun]]:
        """Once the pass's record is durable and applied: its runs (counted)."""
        outs, end, dead = leased
        if not end:
            return outs
        self._durable(end)
        redelivered = sum(r.count for out in outs for r in out if r.delivery_count > 1)
        if redelivered:
            metrics.POP_REDELIVERIES.inc(redelivered)
        if dead:
            metrics.POP_DLQ.inc(dead)
            log.info("pop_dead_letters", group=t.group, topic=t.topic, count=dead)
        return outs

    def _lease(self, t: _Terms, picks: list[_Pick], now: int, before: list[IncomingBatch] | None = None,
               before_keys: list[QueueKey] | None = None) -> _Leased:
        """With the picked queues' locks held: read, append the lease record (and dead letters in
        the same append, and ``before``: the pass's ack record, touching ``before_keys``); return
        each pop's runs (``t.asks``: how many each takes of the picks, in order), the record's end
        and the number of dead letters. Dead messages whose DLQ cannot take them (``_dlq_ready``)
        stay where they are, neither leased nor dead: no consumer gets them again, and the next pop
        tries once more."""
        group, topic, asks = t.group, t.topic, t.asks
        before, before_keys = before or [], before_keys or []
        tag = secrets.randbits(63) + 1
        dlq_ready = any(p.dead.size for p in picks) and self.dead.ready(group, t.may_create_dlq)
        epoch, cluster = self.store.epoch, self.cluster
        pull_bytes = self.config["limits.pull_bytes_max"]
        total_budget = pull_bytes * RUN_BUDGETS
        outs: list[list[LeasedRun]] = [[] for _ in asks]
        read: list[tuple[list[np.ndarray], list[np.ndarray]]] = [([], []) for _ in picks]  # per pick: got, gone
        i = at = 0  # the picks are dealt out in order: what one pop leaves, the next one takes
        for who, ask in enumerate(asks):
            budget = min(pull_bytes, total_budget)  # each pop's own, as if it came alone, within the run's
            left = ask
            while left > 0 and budget > 0 and i < len(picks):
                p = picks[i]
                if at >= p.offsets.size:
                    i, at = i + 1, 0
                    continue
                offsets, counts = p.offsets[at : at + left], p.counts[at : at + left]
                runs, got, gone, after = self._read_runs(topic, p.queue_id, offsets, counts, budget)
                total_budget -= budget - after
                budget = after
                covered = max(int(got[-1]) if got.size else -1, int(gone[-1]) if gone.size else -1)
                advanced = int(np.searchsorted(offsets, covered, side="right"))  # cut by the budget: the rest waits
                at = at + advanced if advanced else p.offsets.size  # nothing read: this queue is done for the pass
                left -= int(got.size)
                prefix = receipts.lease_prefix(cluster, epoch, tag, p.queue_id)
                for first, count, delivery, batches, skip in runs:
                    outs[who].append(LeasedRun(p.queue_id, first, count, delivery,
                                               receipts.run_handle(prefix, first, count, topic), batches, skip))
                read[i][0].append(got)
                read[i][1].append(gone)
        dlq: list[tuple[bytes, bytes, bytes]] = []
        entries = []
        touched: list[int] = []
        for p, (gots, gones) in zip(picks, read, strict=True):
            got = np.concatenate(gots) if gots else p.offsets[:0]  # a prefix of the pick's offsets: sorted
            gone = np.union1d(p.gone, np.concatenate(gones) if gones else p.gone[:0])  # removed by retention meanwhile
            dead = np.setdiff1d(p.dead, gone) if dlq_ready else p.dead[:0]
            if not (got.size or dead.size or gone.size or p.start is not None):
                continue  # nothing changes on this queue (its dead letters wait for their DLQ)
            dlq += self._dead_letters(topic, p.queue_id, dead)
            entry: dict[str, object] = {"q": p.queue_id, "runs": pr.to_runs(got), "dead": pr.to_runs(dead),
                                        "gone": pr.to_runs(gone)}
            if p.start is not None:
                entry["from"] = p.start
            entries.append(entry)
            touched.append(p.queue_id)
        if not entries and not before:
            return outs, 0, 0  # no record: a pop that only found dead letters held back writes nothing
        batches_out = list(before)
        if dlq:
            batches_out.append(self.dead.batch(group, dlq))
        if entries:
            batches_out.append(record_batch(pr.LEASE, {"g": group, "t": topic, "until": now + t.invisible_ms,
                                                        "tag": tag, "queues": entries}))
        end = self._append(batches_out)
        self.locks.appended([*before_keys, *((group, topic, q) for q in touched)], end)
        return outs, end, len(dlq)

    def _new_queue(self, key: QueueKey) -> bool:
        with self.view.lock:
            return self.view.queue(*key) is None

    def _pick(self, key: QueueKey, left: int, start_earliest: bool, now: int, committed: bool = True,
              finished: np.ndarray | None = None) -> tuple[_Pick | None, int | None]:
        """With the queue's lock held: what a pop of up to ``left`` messages takes from it, and
        when its next lease ends. ``committed``: fresh messages stop at the queue's LSO, and those
        of aborted transactions are ended as ``gone`` (never leased, never delivered).
        ``finished``: offsets whose leases this pass ends (acks): the window's room counts them."""
        group, topic, q = key
        max_deliveries = self.config["groups.max_deliveries"]
        window_max = self.config["groups.pop_window_max"]
        with self.view.lock:
            low, end = self.store.reads.queue_bounds(topic, q)
            high = self.store.reads.stable_end(topic, q, end, committed)
            pq = self.view.queue(group, topic, q)
            start = None
            placement = self.store.placement
            if pq is None:
                # a queue that moved (docs/shards.md): the writable segment a move began here, or an
                # old one whose move carried the group's window, begins it at its start, whatever the
                # group asked for (an existing group's messages since the move must not be skipped);
                # other old segments go on only with windows begun on them (a new group from the
                # earliest: its window begins at their low)
                begin = POP_AS_ASKED if placement is None or start_earliest else placement.pop_window_start(topic, q, group)
                if begin is None:
                    return None, None
                start = low if start_earliest else high if begin == POP_AS_ASKED else max(low, begin)
                pq = PopQueue(start)
            none = np.empty(0, np.int64)
            ask = left
            while True:
                offs, counts = pq.available(now, ask) if left > 0 else (none, none)
                gone = offs[offs < low]
                keep = offs >= low
                offs, counts = offs[keep], counts[keep]
                dead_mask = counts >= max_deliveries
                dead, offs, counts = offs[dead_mask], offs[~dead_mask], counts[~dead_mask]
                # dead letters (held back when their DLQ cannot take them) and gone offsets must not
                # take the places of messages to deliver again: ask once more for as many more
                if len(offs) >= left or ask > left or not (dead.size or gone.size):
                    break
                ask = left + int(dead.size) + int(gone.size)
            offs, counts = offs[:left], counts[:left]
            fresh_from, fresh_end = _here(max(pq.cursor, low), high,
                                          placement.pop_gaps(topic, q) if placement is not None else [])
            base = pq.base_after(finished) if finished is not None else pq.base
            if base >= pq.cursor:  # nothing open: the window starts again where the fresh ones do
                base = fresh_from
            n_fresh = max(0, min(left - len(offs), fresh_end - fresh_from, window_max - (fresh_from - base)))
            if n_fresh:
                fresh = np.arange(fresh_from, fresh_from + n_fresh, dtype=np.int64)
                if committed:
                    aborted = self.store.reads.aborted_mask(topic, q, fresh)
                    fresh, gone = fresh[~aborted], np.union1d(gone, fresh[aborted])
                offs = np.concatenate((offs, fresh))
                counts = np.concatenate((counts, np.zeros(fresh.size, dtype=np.int64)))
            nxt = pq.next_visible_ms(finished)
            wake = nxt if nxt is not None and nxt > now else None
            if offs.size or dead.size or gone.size or start is not None:
                return _Pick(q, start, offs, counts, dead, gone), wake
            return None, wake

    def _read_runs(self, topic: str, queue_id: int, offsets: np.ndarray, counts: np.ndarray,
                   budget: int) -> tuple[list[tuple[int, int, int, list[bytes], int]], np.ndarray, np.ndarray, int]:
        """Read ``offsets`` (sorted; ``counts``: deliveries so far) as runs of adjacent messages with
        equal counts: (first, count, delivery count, batches, records to skip in the first batch)
        each, the offsets read, the offsets removed by retention, and the byte budget left. Reading
        stops once ``budget`` bytes are read (at least one batch): the rest is neither read nor gone."""
        pull_bytes = self.config["limits.pull_bytes_max"]
        runs: list[tuple[int, int, int, list[bytes], int]] = []
        got: list[tuple[int, int]] = []
        gone: list[tuple[int, int]] = []
        for start, n, delivered in _equal_runs(offsets, counts):
            pos, end = start, start + n
            while pos < end:
                if budget <= 0:
                    return runs, pr.from_runs(got), pr.from_runs(gone), budget
                try:
                    # the offsets were picked below the LSO and without aborted ones: read them as they are
                    r = self.store.reads.pull(topic, queue_id, pos, end - pos, min(pull_bytes, budget), 0,
                                              committed=False)
                except BrokerError as exc:
                    if exc.code != "OUT_OF_RANGE":
                        raise
                    r = None
                if r is None or not r.count:
                    gone.append((pos, end - pos))
                    break
                runs.append((pos, r.count, delivered + 1, r.batches, r.skip_first))
                got.append((pos, r.count))
                budget -= sum(len(b) for b in r.batches)
                pos += r.count
        return runs, pr.from_runs(got), pr.from_runs(gone), budget

    def _dead_letters(self, topic: str, queue_id: int, dead: np.ndarray) -> list[tuple[bytes, bytes, bytes]]:
        """(body, key, props) of each dead message, its origin added to its properties."""
        if dead.size == 0:
            return []
        deliveries = self.config["groups.max_deliveries"]
        runs, _, _, _ = self._read_runs(topic, queue_id, dead, np.zeros(dead.size, np.int64), 1 << 62)
        return [self.dead.letter(topic, queue_id, r.queue_offset, deliveries, r.key, r.props, r.body)
                for first, count, _, batches, _ in runs for r in run_records(first, count, batches)]

    # -- ending leases -----------------------------------------------------------------------------






    # -- what describe shows (broker/daemon/group_admin.py PopState) --------------------------------




def _earliest(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _here(start: int, end: int, gaps: list[tuple[int, int]]) -> tuple[int, int]:
    """The fresh offsets [start, end) this shard may lease: from ``start``, or past the other
    shards' segments (``gaps``, in order) it lies in, up to the next of them."""
    for gap_start, gap_end in gaps:
        if start >= gap_end:
            continue
        if start >= gap_start:
            start = gap_end
            continue
        return start, min(end, gap_start)
    return start, max(start, end)


def _equal_runs(offsets: np.ndarray, counts: np.ndarray) -> list[tuple[int, int, int]]:
    """(first, length, count) of each run of adjacent offsets with equal counts."""
    if offsets.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(offsets) != 1) | (np.diff(counts) != 0)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [offsets.size]))
    return [(int(offsets[a]), int(b - a), int(counts[a])) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


class RunRecord(NamedTuple):
    queue_offset: int
    header: bf.BatchHeader
    record: memoryview  # the whole encoded record
    key: memoryview
    props: memoryview
    body: memoryview


def run_records(first: int, count: int, batches: Iterable[bytes]) -> Iterator[RunRecord]:
    """Each message of the run ``first .. first + count - 1`` found in ``batches``."""
    end = first + count
    for header, batch in _batches(batches):
        qoff = header.base_queue_offset
        for rpos, key, props, body in bf.iter_records(batch, header):
            if first <= qoff < end:
                size = bf.RECORD_HEAD.unpack_from(batch, rpos)[0]
                yield RunRecord(qoff, header, batch[rpos : rpos + 4 + size], key, props, body)
            qoff += 1
        if qoff >= end:
            return


def as_messages(runs: list[LeasedRun]) -> list[pb.PoppedMessage]:
    """One PoppedMessage each (for clients that ask for them: PopRequest.as_runs unset)."""
    out = []
    for r in runs:
        lease, topic = receipts.lease_of(r.receipt_handle), r.receipt_handle.split(".", 2)[2]
        for m in run_records(r.first_offset, r.count, r.batches):
            out.append(pb.PoppedMessage(queue_id=r.queue_id, queue_offset=m.queue_offset, commit_offset=m.header.base_offset,
                                        store_time_ms=m.header.store_time_ms, record=bytes(m.record),
                                        receipt_handle=receipts.run_handle(lease, m.queue_offset, 1, topic),
                                        delivery_count=r.delivery_count))
    return out


def _batches(runs: Iterable[bytes]) -> Iterator[tuple[bf.BatchHeader, memoryview]]:
    """Each batch of runs of whole, adjacent batches (as reads return them)."""
    for run in runs:
        mv = memoryview(run)
        pos = 0
        while pos < len(mv):
            header = bf.decode_header(mv, pos, check_crc=False)
            yield header, mv[pos : pos + header.batch_bytes]
            pos += header.batch_bytes
