"""The firing service and cancellation (DESIGN §5). Fires on the master only.

A round: walk the wheel's due slots (the current slot incrementally, each passed slot a last
time, then compact it: its later-turn timers are relinked into a fresh chain), read the due
timers' scheduled records from the commit log, and append in ONE request a delivery batch per
target queue (``FLAG_TIMER_DELIVERY``, each record naming its origin ``__timer_offset``: the
authoritative fire marker) followed by one ``__timer`` batch of ``fired`` events. A timer never
fires before its ``deliver_at_ms``: only records whose exact time has come are taken.

Exactly once: a timer is fired only while the view shows it PENDING and it is in no earlier
round still in flight; cancels and rounds exclude each other under one lock. On start (and on
promotion) the service first waits for the view to apply the whole log, re-announces every
delivered timer whose ``fired`` event a crash separated from it, then fires everything overdue
(from the index), and only then starts walking the wheel from the current slot.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

import crc32c
import numpy as np
import structlog

from broker import clock, metrics
from broker.config import Config
from broker.errors import BrokerError, not_found
from broker.logformat import batch as bf
from broker.logformat import timer_props as tr
from broker.ports import IncomingBatch
from broker.storage.commitlog import CommitLog
from broker.storage.failpoints import failpoint
from broker.store.appender import Appender
from broker.store.dispatcher import Dispatcher
from broker.store.forwarding import Due, TimerForwarder
from broker.store.reads import Reads
from broker.store.writes import WriteStep
from broker.threads import NamedThread
from broker.timers import timerlog as tl
from broker.timers.index import CANCELLED, PENDING, STATE_NAMES
from broker.timers.view import TimerView

log = structlog.get_logger("timer.firing")
READ_GAP_BYTES = 256 << 10  # scheduled records closer than this are read with one pread
SWEEP_INTERVAL_MS = 1000  # how often the index is searched for overdue timers the wheel missed


class _SlotState:
    """What the service knows of the slot it is walking: where its walk stopped and the
    timers seen but not yet due (the slot's later part, or later turns of the ring)."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.walked_to = tl.NONE  # newest chain position already read
        self.offs = np.empty(0, dtype=np.uint64)
        self.ats = np.empty(0, dtype=np.int64)
        self.dirty = False  # something left this slot's chain: compact it when passed


class TimerService:
    def __init__(self, config: Config, view: TimerView, log_: CommitLog, appender: Appender, writes: WriteStep,
                 dispatcher: Dispatcher, reads: Reads, role: Callable[[], str], check_writable: Callable[[], None],
                 report: Callable[[str], None] = lambda _message: None) -> None:
        """``report``: told each round's outcome (a failure's message, or "" when it worked)."""
        self.view = view
        self.log = log_
        self.appender = appender
        self.writes = writes
        self.dispatcher = dispatcher
        self.reads = reads
        self.role = role
        self.check_writable = check_writable
        self.report = report
        self.send_timeout_ms = config["limits.send_timeout_ms"]
        cfg = config
        self.precision_ms = cfg["timer.precision_ms"]
        self.fire_batch_max = cfg["timer.fire_batch_max"]
        self.tick_s = max(0.005, self.precision_ms / 4000.0)
        self.lock = threading.Lock()  # one round or one cancel at a time
        self.inflight: set[int] = set()  # fired, not yet applied by the view
        self.cancelling: set[int] = set()
        self.forwarding: set[int] = set()  # handed to the forwarder (their queue moved to another shard)
        self.forwarder: TimerForwarder | None = None  # set by the store (a cluster of shards)
        self._slot: _SlotState | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.clock_ms = clock.wall_ms
        self._last_sweep_ms = 0

    # -- life cycle (the store calls on_role) ------------------------------------------------------
    def on_role(self, role: str) -> None:
        if role == "master":
            self.start()
        else:
            self.stop()

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            if self._stop.is_set():
                log.warning("timer_firing_not_restarted", note="the previous firing thread has not ended yet")
            return
        self._stop.clear()
        self._thread = NamedThread(target=self._run, name="timer-firing", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        if self._thread is not None and not self._thread.is_alive():
            self._thread = None  # one still alive (stuck in an append) is kept: start() must not add a second
        if self.forwarder is not None:
            self.forwarder.stop()
        self.view.fire_floor_ms = None
        self._slot = None
        self.inflight.clear()
        self.cancelling.clear()
        self.forwarding.clear()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set() and self.role() == "master":
            try:
                if self._slot is None:
                    self._catch_up()
                elif self._stop.wait(self.tick_s):
                    break
                else:
                    self.round()
                if failures:
                    self.report("")
                failures = 0
            except BrokerError as exc:  # e.g. a full disk or a lost role: retry, quietly after the first
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    log.warning("timer_round_failed", error=exc.message, failures=failures)
                self.report(f"{exc.code}: {exc.message}")
                self._stop.wait(min(1.0, 0.05 * failures))
            except Exception as exc:  # a bug must not take the daemon down; keep trying
                failures += 1
                log.exception("timer_round_failed", error=str(exc), failures=failures)
                self.report(f"{type(exc).__name__}: {exc}")
                self._stop.wait(1.0)

    def _catch_up(self) -> None:
        """Before the first round: the view has applied the whole log; repair; fire overdue."""
        target = self.log.max_offset
        while not self._stop.is_set() and not self.dispatcher.wait_applied(self.view, target, 1.0):
            if self.role() != "master":
                return
        if self._stop.is_set():
            return
        with self.dispatcher.lock:
            offs, ats = self.view.index.undelivered_events()
        if len(offs):
            log.warning("timer_fired_events_repaired", count=len(offs), note="a crash separated deliveries from their fired events")
            self._append_events(offs, ats)
        now = self.clock_ms()
        with self.lock:  # cancels wait for this (they are refused until _slot is set)
            self._settle_inflight()
            with self.dispatcher.lock:
                due_offs, due_ats = self.view.index.due(now)
                keep = self._eligible(due_offs)
                due_offs, due_ats = due_offs[keep], due_ats[keep]
                self.view.fire_floor_ms = (now // self.precision_ms) * self.precision_ms
                self._slot = _SlotState(now // self.precision_ms)
            self._fire_all(due_offs, due_ats)
        if len(due_offs):
            log.info("timer_overdue_fired", count=len(due_offs))

    # -- one round --------------------------------------------------------------------------------
    def round(self) -> int:
        """Fire what is due now; return how many timers were fired."""
        now = self.clock_ms()
        with self.lock:
            self._settle_inflight()
            offs, ats = self._collect(now)
            self._fire_all(offs, ats)
        return len(offs)

    def _fire_all(self, offs: np.ndarray, ats: np.ndarray) -> None:
        for i in range(0, len(offs), self.fire_batch_max):
            self._fire(offs[i : i + self.fire_batch_max], ats[i : i + self.fire_batch_max])

    def _settle_inflight(self) -> None:
        """Forget fired or cancelled timers the view has applied (one vectorised lookup each)."""
        for busy in (self.inflight, self.cancelling):
            if not busy:
                continue
            offs = np.fromiter(busy, dtype=np.uint64, count=len(busy))
            with self.dispatcher.lock:
                idx = self.view.index.find(offs)
                done = (idx < 0) | (self.view.index.state[np.maximum(idx, 0)] != PENDING)
            busy.difference_update(offs[done].tolist())

    def _collect(self, now: int) -> tuple[np.ndarray, np.ndarray]:
        offs_out: list[np.ndarray] = []
        ats_out: list[np.ndarray] = []
        current = now // self.precision_ms
        with self.dispatcher.lock:
            state = self._slot
            if state is None:
                state = self._slot = _SlotState(current)
            # the node's clock stepped back (NTP): the cursor and the last sweep are in its future.
            # Walk again from now (what already fired is no longer eligible) and sweep at once;
            # waiting for the clock to catch up delayed every timer by the size of the step
            stepped_back = current < state.slot or now < self._last_sweep_ms
            stalled = current - state.slot > self.view.wheel.slots
            sweep = stepped_back or stalled or now - self._last_sweep_ms >= SWEEP_INTERVAL_MS
            if stepped_back or stalled:  # stalled for a whole turn: restart here too
                state = self._slot = _SlotState(current)
            if sweep:  # the safety net: anything the wheel did not hand over in time
                o, a = self.view.index.due(now - 2 * self.precision_ms)
                offs_out.append(o)
                ats_out.append(a)
                self._last_sweep_ms = now
            while True:
                o, a = self._take_due(state, now)
                offs_out.append(o)
                ats_out.append(a)
                if state.slot >= current:
                    break
                self._compact(state)
                state = self._slot = _SlotState(state.slot + 1)
            self.view.fire_floor_ms = state.slot * self.precision_ms
            with self.view.lock:
                late, self.view.late = self.view.late, []
            if late:
                offs_out.append(np.array([x for x, _ in late], dtype=np.uint64))
                ats_out.append(np.array([y for _, y in late], dtype=np.int64))
            offs = np.concatenate(offs_out)
            ats = np.concatenate(ats_out)
            if len(offs):
                keep = (ats <= now) & self._eligible(offs)
                offs, ats = offs[keep], ats[keep]
                offs, first = np.unique(offs, return_index=True)
                ats = ats[first]
        return offs, ats

    def _eligible(self, offs: np.ndarray) -> np.ndarray:
        """Pending in the view, and neither in flight nor being cancelled."""
        idx = self.view.index.find(offs)
        ok = idx >= 0
        ok[ok] = self.view.index.state[idx[ok]] == PENDING
        busy = self.inflight | self.cancelling | self.forwarding
        if busy:
            ok &= ~np.isin(offs, np.fromiter(busy, dtype=np.uint64, count=len(busy)))
        return ok

    def _take_due(self, state: _SlotState, now: int) -> tuple[np.ndarray, np.ndarray]:
        """Walk what is new in the slot's chain; return its timers due at ``now``."""
        wheel = self.view.wheel
        ring = state.slot % wheel.slots
        last = int(wheel.last[ring])
        if last not in (state.walked_to, tl.NONE):
            recs = wheel.walk(ring, self.view.read_block, stop_at=state.walked_to, floor=self.view.log.min_offset)
            state.walked_to = last
            state.offs = np.concatenate([state.offs, recs["off"]])
            state.ats = np.concatenate([state.ats, recs["at"]])
        if not len(state.offs):
            return state.offs, state.ats
        eligible = self._eligible(state.offs)
        busy = self.inflight | self.cancelling | self.forwarding
        held = np.isin(state.offs, np.fromiter(busy, np.uint64, len(busy))) if busy else np.zeros(len(eligible), bool)
        due = eligible & (state.ats <= now)
        if due.any() or not (eligible | held).all():
            state.dirty = True  # timers leave this chain: compact it once the slot has passed
        out = state.offs[due], state.ats[due]
        keep = (eligible & ~due) | held
        state.offs, state.ats = state.offs[keep], state.ats[keep]
        return out

    def _compact(self, state: _SlotState) -> None:
        """The slot has passed: its chain keeps only later-turn timers, in a fresh chain."""
        ring = state.slot % self.view.wheel.slots
        if not state.dirty:
            return
        later = self._eligible(state.offs)
        if self.view.wheel.count[ring] > 0 and later.any():
            self.view.relink(ring, state.offs[later], state.ats[later])

    # -- firing -----------------------------------------------------------------------------------
    def _fire(self, offs: np.ndarray, ats: np.ndarray) -> None:
        """Deliver these timers (lock held): one append of deliveries + fired events."""
        if not len(offs):
            return
        held, aborted = self.reads.scheduled_in_transactions(offs)
        if held.any():  # of a transaction still open: delivered once it commits (the sweep finds them)
            offs, ats, aborted = offs[~held], ats[~held], aborted[~held]
            if not len(offs):
                return
        records = self._read_scheduled(offs)
        by_queue: dict[tuple[str, int], list[tuple[bytes, bytes, bytes]]] = defaultdict(list)
        fired_events: list[tuple[bytes, bytes, bytes]] = []
        dropped_events: list[tuple[bytes, bytes, bytes]] = []
        targets: dict[tuple[str, int], tuple[bool, bool, bytes]] = {}  # (exists, sealed, its event suffix)
        fired = 0
        parked: list[int] = []  # not fired here: their queue moved away (some handed to the forwarder)
        forwards: dict[tuple[str, int], list[Due]] = defaultdict(list)
        for off, at, dropped in zip(offs.tolist(), ats.tolist(), aborted.tolist(), strict=True):
            key, props, body, topic, queue = records[off]
            target = targets.get((topic, queue))
            if target is None:
                target = targets[(topic, queue)] = (self.appender.queue_exists(topic, queue),
                                                    self.appender.queue_sealed(topic, queue), tr.target_props(topic, queue))
            if dropped:  # its transaction aborted: it never fires
                dropped_events.append((b"", b"", tr.event_props(tr.DROPPED, off, at, target[2])))
            elif target[1]:  # its queue moved to another shard: forwarded there (docs/shards.md), or kept
                if self.forwarder is not None and self.forwarder.available() and not self.forwarder.resting(topic, queue):
                    forwards[(topic, queue)].append(Due(off, at, bytes(key), bytes(body), tr.delivery_props(off, props)))
                parked.append(off)
            elif target[0]:
                by_queue[(topic, queue)].append((body, key, tr.delivery_props(off, props)))
                fired_events.append((b"", b"", tr.event_props(tr.FIRED, off, at, target[2])))
                fired += 1
            else:
                dropped_events.append((b"", b"", tr.event_props(tr.DROPPED, off, at, target[2])))
                log.warning("timer_dropped", timer_offset=off, topic=topic, queue=queue, reason="no such topic/queue")
        for (topic, queue), due in forwards.items():
            assert self.forwarder is not None
            self.forwarding.update(t.offset for t in due)
            self.forwarder.submit(topic, queue, sorted(due, key=lambda t: (t.at, t.offset)))
        if parked:
            log.debug("timers_parked", count=len(parked), forwarded=sum(len(d) for d in forwards.values()),
                      reason="their queue is sealed here by a move")
            kept = ~np.isin(offs, np.array(parked, dtype=offs.dtype))
            offs, ats = offs[kept], ats[kept]
            if not len(offs):
                return
        batches: list[IncomingBatch] = []
        for (topic, queue), items in by_queue.items():
            raw, _ = bf.encode_records(items)
            batches.append(IncomingBatch(topic, queue, raw, len(items), crc32c.crc32c(raw), flags=bf.FLAG_TIMER_DELIVERY))
        for events, flags in ((fired_events, bf.FLAG_TIMER_FIRED), (dropped_events, 0)):
            if events:
                raw, _ = bf.encode_records(events)
                batches.append(IncomingBatch(tr.TIMER_TOPIC, 0, raw, len(events), crc32c.crc32c(raw), flags=flags))
        failpoint("timer_before_fire")
        # never stored before it is due, on this node's clock, even if the clock stepped back since
        # this round found the timers due
        _, end = self.appender.append(batches, internal=True, not_before_ms=int(ats.max()))
        failpoint("timer_after_fire")
        self.inflight.update(offs.tolist())
        now = self.clock_ms()
        metrics.observe_many(metrics.TIMER_LATENESS, np.maximum(0, now - ats) / 1000.0, metrics.TIMER_LATENESS_BOUNDS)
        metrics.TIMER_FIRED.inc(fired)
        self.writes.acknowledged(end, "flush", what="a timer delivery")

    def forwarded(self, offsets: list[int], done: bool) -> None:
        """The forwarder is done with these timers: forwarded (their events appended), or not (the
        sweep hands them over again)."""
        with self.lock:
            self.forwarding.difference_update(offsets)
            if done:
                self.inflight.update(offsets)

    def _append_events(self, offs: np.ndarray, ats: np.ndarray) -> None:
        events = []
        for off, at in zip(offs.tolist(), ats.tolist(), strict=True):
            _, _, _, topic, queue = self._read_scheduled(np.array([off], dtype=np.uint64))[off]
            events.append((b"", b"", tr.event_props(tr.FIRED, off, at, tr.target_props(topic, queue))))
        raw, _ = bf.encode_records(events)
        self.writes.write([IncomingBatch(tr.TIMER_TOPIC, 0, raw, len(events), crc32c.crc32c(raw))], "flush",
                          internal=True, what="fired events")

    def _read_scheduled(self, offs: np.ndarray) -> dict[int, tuple[bytes, bytes, bytes, str, int]]:
        """(key, props, body, target topic, target queue) of the scheduled record at each timer
        offset, in few preads."""
        out: dict[int, tuple[bytes, bytes, bytes, str, int]] = {}
        order = np.sort(offs).tolist()
        head = bf.RECORD_HEAD
        targets: dict[bytes, tuple[str, int]] = {}
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and order[j] - order[j - 1] < READ_GAP_BYTES:
                j += 1
            start = order[i]
            data = self.log.read(start, order[j - 1] - start + bf.RECORD_HEAD_BYTES)
            size_last = head.unpack_from(data, order[j - 1] - start)[0]
            need = order[j - 1] - start + 4 + size_last
            if len(data) < need:
                data = self.log.read(start, need)
            if len(data) < need:
                raise BrokerError("DATA_LOSS", f"scheduled timer record at {order[j - 1]} is not in the local log")
            for off in order[i:j]:
                p = off - start
                size, kl, pl = head.unpack_from(data, p)
                k0 = p + bf.RECORD_HEAD_BYTES
                props = data[k0 + kl : k0 + kl + pl]
                tail = tr.target_of_scheduled(props)  # the target's bytes: one decode per target
                target = targets.get(tail)
                if target is None:
                    target = targets[tail] = tr.scheduled_target(props)[1:]
                out[off] = (data[k0 : k0 + kl], props, data[k0 + kl + pl : p + 4 + size], target[0], target[1])
            i = j
        return out

    # -- cancel -----------------------------------------------------------------------------------
    def cancel(self, timer_offset: int, target: tuple[str, int] | None = None) -> tuple[int, str, int]:
        """Cancel a pending timer; return (deliver_at_ms, topic, queue). Refuses a fired,
        cancelled, firing or unknown timer with a clear status; with ``target``, also one whose
        message is for another queue (a timer offset is an offset of one shard's log)."""
        self.check_writable()
        self.writes.watermarks.check_replica_ack_possible()
        timeout_ms = self.send_timeout_ms
        with self.lock:
            if self._slot is None:  # not caught up with its log yet (starting, or just promoted)
                raise BrokerError("UNAVAILABLE", "the timer service is starting on this master; retry shortly")
            self._settle_inflight()
            state = self._state_of(timer_offset, timeout_ms)
            if state is not None and target is not None:  # named first: nothing told of another queue's timer
                try:  # (a fired timer's record may be gone with retention: then its state answers)
                    found = self._read_scheduled(np.array([timer_offset], dtype=np.uint64)).get(timer_offset)
                except BrokerError:
                    found = None
                if found is not None and (found[3], found[4]) != target:
                    raise not_found(f"no timer for {target[0]!r} queue {target[1]} at offset {timer_offset}")
            if state is None:
                if self.reads.is_scheduled_record(timer_offset):
                    raise BrokerError("FAILED_PRECONDITION", f"timer {timer_offset} has already fired or was cancelled")
                raise not_found(f"no timer at offset {timer_offset}")
            if timer_offset in self.inflight:
                raise BrokerError("FAILED_PRECONDITION", f"timer {timer_offset} is firing now")
            if timer_offset in self.cancelling:
                raise BrokerError("FAILED_PRECONDITION", f"timer {timer_offset} is being cancelled")
            if state != PENDING:
                raise BrokerError("FAILED_PRECONDITION", f"timer {timer_offset} is already {STATE_NAMES[state]}")
            _, props, _, topic, queue = self._read_scheduled(np.array([timer_offset], dtype=np.uint64))[timer_offset]
            at = tr.scheduled_target(props)[0]
            raw, _ = bf.encode_records([(b"", b"", tr.event_props(tr.CANCELLED, timer_offset, at, tr.target_props(topic, queue)))])
            _, end = self.appender.append([IncomingBatch(tr.TIMER_TOPIC, 0, raw, 1, crc32c.crc32c(raw))], internal=True)
            # from here the cancel is in the log: rounds skip the timer until the view applied it
            # (``_settle_inflight``), even if this call times out below
            self.cancelling.add(timer_offset)
        self.writes.acknowledged(end, "replica", timeout_ms=timeout_ms, applied=self.view,
                                 what=f"the cancel of timer {timer_offset}")
        with self.dispatcher.lock:
            final = self.view.index.state_of(timer_offset)
        if final != CANCELLED:  # a delivery the view had not applied yet came first in the log
            raise BrokerError("FAILED_PRECONDITION", f"timer {timer_offset} has already fired")
        return at, topic, queue

    def _state_of(self, timer_offset: int, timeout_ms: int) -> int | None:
        """The view's state of a timer; an offset the view has not reached yet (a send that was
        just acknowledged) is waited for, up to the log end as it is now."""
        with self.dispatcher.lock:
            state = self.view.index.state_of(timer_offset)
        if state is None and timer_offset >= self.view.applied_offset:
            self.dispatcher.wait_applied(self.view, self.log.max_offset, timeout_ms / 1000.0)
            with self.dispatcher.lock:
                state = self.view.index.state_of(timer_offset)
        return state
