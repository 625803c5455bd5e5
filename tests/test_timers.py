"""Timer wheel, firing, cancellation and wheel snapshots on a real in-process store, driven in
simulated time (``SimClock``): no test waits for wall-clock time to pass."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from broker import metrics
from broker.errors import BrokerError
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.store.watermarks import AloneRule
from broker.timers import snapshot as snaps
from broker.timers import timerlog as tl
from broker.timers.index import PENDING
from tests.storeutil import create_topic, send, wait_views_applied
from tests.timerutil import SimClock, deliveries, future_base_ms, schedule, settle, timer_events, timer_log_types, timer_store


def _check_fired_once_never_early(clock: SimClock, offs: list[int], ats: list[int], step_ms: int) -> None:
    assert set(clock.fired_at) == set(offs), f"{len(set(offs) - set(clock.fired_at))} never fired"
    twice = {o: t for o, t in clock.fired_at.items() if len(t) != 1}
    assert not twice, f"fired more than once: {list(twice.items())[:5]}"
    for off, at in zip(offs, ats, strict=True):
        fired = clock.fired_at[off][0]
        assert fired >= at, f"timer {off} due at {at} fired early at {fired}"
        assert fired - at < step_ms, f"timer {off} due at {at} fired late at {fired}"


def test_thousands_of_timers_fire_once_never_early(tmp_path: Path) -> None:
    s = timer_store(str(tmp_path / "d"), **{"timer.precision_ms": 100})
    create_topic(s, "orders", queues=2)
    base = future_base_ms()
    rng = random.Random(7)
    offs: list[int] = []
    ats: list[int] = []
    for batch in range(6):  # 3,000 timers over 10 s, many per slot, in both queues
        times = [base + rng.randrange(0, 10_000) for _ in range(500)]
        offs += schedule(s, "orders", batch % 2, times)
        ats += times
    assert s.status()["timer_pending"] == 3000
    clock = SimClock(s, base - 300)
    clock.advance_to(base + 10_200, 20, "orders", 2)
    _check_fired_once_never_early(clock, offs, ats, 20)
    st = s.status()
    assert st["timer_pending"] == 0 and st["timer_wheel"]["pending"] == 0
    fired_events = [e for e in timer_events(s) if e["__event"] == "fired"]
    assert sorted(int(e["__timer_offset"]) for e in fired_events) == sorted(offs)  # one fired event each
    s.stop()


def test_timers_beyond_one_turn_wait_for_their_turn(tmp_path: Path) -> None:
    """A 64-slot ring at 100 ms turns every 6.4 s: later timers share ring slots and roll."""
    s = timer_store(str(tmp_path / "d"), **{"timer.precision_ms": 100, "timer.wheel_slots": 64})
    create_topic(s, "t")
    base = future_base_ms()
    ats = [base + 300, base + 300 + 6400, base + 300 + 12_800, base + 3050, base + 3050 + 6400 * 3 + 7]
    offs = schedule(s, "t", 0, ats)
    clock = SimClock(s, base)
    clock.advance_to(base + 6400 * 4, 50, "t", 1)
    _check_fired_once_never_early(clock, offs, ats, 50)
    assert (timer_log_types(s) == tl.RELINK).any(), "passed slots with later-turn timers are compacted"
    s.stop()


def test_cancel_before_fire_and_clear_refusals(tmp_path: Path) -> None:
    s = timer_store(str(tmp_path / "d"))
    create_topic(s, "t")
    base = future_base_ms()
    offs = schedule(s, "t", 0, [base + 1000 + i for i in range(10)])
    clock = SimClock(s, base)
    for off in offs[:5]:
        assert s.timers.cancel(off) == (base + 1000 + offs.index(off), "t", 0)
    with pytest.raises(BrokerError, match="already cancelled"):
        s.timers.cancel(offs[0])
    assert s.status()["timer_pending"] == 5
    clock.advance_to(base + 1100, 20, "t", 1)
    assert sorted(clock.fired_at) == offs[5:]
    with pytest.raises(BrokerError, match=r"already (delivered|fired)") as fired:
        s.timers.cancel(offs[7])
    assert fired.value.code == "FAILED_PRECONDITION"
    with pytest.raises(BrokerError, match="no timer at offset") as unknown:
        s.timers.cancel(offs[7] + 1)  # inside a record, not a timer
    assert unknown.value.code == "NOT_FOUND"
    events = timer_events(s)
    assert sorted(int(e["__timer_offset"]) for e in events if e["__event"] == "cancelled") == offs[:5]
    assert s.status()["timer_pending"] == 0
    s.stop()


def test_deleted_topic_drops_its_timers(tmp_path: Path) -> None:

    s = timer_store(str(tmp_path / "d"))
    create_topic(s, "gone")
    base = future_base_ms()
    offs = schedule(s, "gone", 0, [base + 100, base + 200])
    end = s.appender.append_system([(system_records.TOPIC_DELETE, {"topic": "gone"})])
    s.watermarks.wait_ack(end, "flush", 5000)
    clock = SimClock(s, base)
    clock.advance_to(base + 400, 50, "orders-none", 0)
    events = timer_events(s)
    assert sorted(int(e["__timer_offset"]) for e in events if e["__event"] == "dropped") == offs
    assert s.status()["timer_pending"] == 0
    s.stop()


def _wheel_state(s: object) -> tuple[np.ndarray, np.ndarray, list[int]]:
    v = s.views.timers  # type: ignore[attr-defined]
    idx = v.index
    pending = idx.off[idx.low : idx.size][idx.state[idx.low : idx.size] == PENDING]
    return v.wheel.count.copy(), v.wheel.last.copy(), sorted(pending.tolist())


def _pending_by_walk(s: object) -> list[int]:
    """Every pending timer reachable by walking the chains (what firing would find)."""
    v = s.views.timers  # type: ignore[attr-defined]
    found: list[int] = []
    for ring in np.flatnonzero(v.wheel.count > 0).tolist():
        recs = v.wheel.walk(ring, v.read_block, floor=v.log.min_offset)
        offs = recs["off"]
        idx = v.index.find(offs)
        found += offs[(idx >= 0) & (v.index.state[np.maximum(idx, 0)] == PENDING)].tolist()
    return sorted(set(found))


def _busy_store(path: str) -> tuple[object, SimClock]:
    """Timers scheduled, some fired (relinks and deliveries in the log), two snapshots, a tail."""
    s = timer_store(path, **{"timer.precision_ms": 100, "timer.wheel_slots": 1024, "timer.snapshot_keep": 2})
    create_topic(s, "t", queues=3)
    base = future_base_ms()
    rng = random.Random(11)
    for q in range(3):
        schedule(s, "t", q, [base + rng.randrange(0, 400_000) for _ in range(700)])
    clock = SimClock(s, base)
    clock.advance_to(base + 30_000, 500, "t", 3)
    with s.dispatcher.lock:
        s.views.timers.write_snapshot()
    schedule(s, "t", 1, [base + rng.randrange(30_000, 60_000) for _ in range(300)])
    clock.advance_to(base + 45_000, 500, "t", 3)
    with s.dispatcher.lock:
        s.views.timers.write_snapshot()
    schedule(s, "t", 2, [base + rng.randrange(30_000, 60_000) for _ in range(300)])  # the tail after it
    clock.advance_to(base + 50_000, 500, "t", 3)
    settle(s)
    return s, clock


def _reopen_same_wheel(path: Path, before: tuple[np.ndarray, np.ndarray, list[int]], loaded_from: str) -> object:
    """Recover the store at ``path``: the wheel's counts and pending timers are what they were,
    and walking the chains finds exactly the pending timers."""
    s2 = timer_store(str(path), **{"timer.precision_ms": 100, "timer.wheel_slots": 1024})
    assert s2.views.timers.loaded_from.startswith(loaded_from), s2.views.timers.loaded_from
    after = _wheel_state(s2)
    assert np.array_equal(before[0], after[0]) and before[2] == after[2]
    assert _pending_by_walk(s2) == before[2]
    return s2


def test_restart_restores_the_wheel_from_the_newest_snapshot_and_tail(tmp_path: Path) -> None:
    s, _ = _busy_store(str(tmp_path / "d"))
    before = _wheel_state(s)
    assert (timer_log_types(s) == tl.DELIVERED).any() and len(before[2]) > 1000
    s.crash_close()  # type: ignore[attr-defined]
    s2 = _reopen_same_wheel(tmp_path / "d", before, "snapshot@")
    assert np.array_equal(before[1], _wheel_state(s2)[1])  # chain ends too
    s2.stop()  # type: ignore[attr-defined]


def _crashed_busy_store(path: Path) -> tuple[tuple[np.ndarray, np.ndarray, list[int]], str]:
    """A ``_busy_store`` at ``path``, crashed: its wheel state before the crash, and its snapshot directory."""
    s, _ = _busy_store(str(path))
    before = _wheel_state(s)
    s.crash_close()  # type: ignore[attr-defined]
    return before, str(path / "timer" / "snapshots")


def test_a_corrupt_newest_snapshot_is_quarantined_and_the_older_one_used(tmp_path: Path) -> None:
    before, snap_dir = _crashed_busy_store(tmp_path / "d")
    newest, older = snaps.positions(snap_dir)[:2]
    path = snaps.path_for(snap_dir, newest)
    with open(path, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))
    s2 = _reopen_same_wheel(tmp_path / "d", before, f"snapshot@{older}+")
    assert os.path.exists(path + ".broken")
    s2.stop()  # type: ignore[attr-defined]


def test_without_any_snapshot_the_wheel_is_rebuilt_from_the_timer_log(tmp_path: Path) -> None:
    before, snap_dir = _crashed_busy_store(tmp_path / "d")
    for name in os.listdir(snap_dir):
        os.unlink(os.path.join(snap_dir, name))
    _reopen_same_wheel(tmp_path / "d", before, "timer log rebuild").stop()  # type: ignore[attr-defined]


def test_a_torn_timer_log_tail_is_cut_and_replayed_from_the_commit_log(tmp_path: Path) -> None:
    s, _ = _busy_store(str(tmp_path / "d"))
    before = _wheel_state(s)
    seg = s.views.timers.log.segments[-1]  # type: ignore[attr-defined]
    s.crash_close()  # type: ignore[attr-defined]
    with open(seg.path, "r+b") as f:  # garbage over the last group: its CRC no longer matches
        f.seek(seg.size_bytes - 3 * tl.RECORD_BYTES)
        f.write(b"\x55" * tl.RECORD_BYTES)
    s2 = _reopen_same_wheel(tmp_path / "d", before, "snapshot@")
    assert s2.views.timers.cut_bytes > 0  # type: ignore[attr-defined]
    s2.stop()  # type: ignore[attr-defined]


def test_snapshots_keep_only_the_newest_and_hold_retention(tmp_path: Path) -> None:
    s, _ = _busy_store(str(tmp_path / "d"))
    snap_dir = str(tmp_path / "d" / "timer" / "snapshots")
    with s.dispatcher.lock:  # type: ignore[attr-defined]
        s.views.timers.write_snapshot()  # type: ignore[attr-defined]
    assert len(snaps.positions(snap_dir)) == 2
    oldest_pending = s.views.timers.body_hold()  # type: ignore[attr-defined]
    s.dispatcher.checkpoint_views()  # type: ignore[attr-defined]
    assert s.retention.local_floor() <= oldest_pending  # type: ignore[attr-defined]
    s.stop()  # type: ignore[attr-defined]


def test_view_counts_match_the_metadata_counts(tmp_path: Path) -> None:
    s, clock = _busy_store(str(tmp_path / "d"))
    st = s.status()  # type: ignore[attr-defined]
    assert st["timer_pending"] == st["timer_wheel"]["pending"] == len(_wheel_state(s)[2])
    assert st["timer_pending_by_topic"] == {"t": st["timer_pending"]}
    fired = sum(len(v) for v in clock.fired_at.values())
    assert fired == len(deliveries(s, "t", 3))  # type: ignore[arg-type]
    s.stop()  # type: ignore[attr-defined]


def test_bulk_lateness_histogram_equals_one_observe_per_value() -> None:


    bounds = metrics.TIMER_LATENESS_BOUNDS
    one, bulk = CollectorRegistry(), CollectorRegistry()
    h1 = Histogram("lateness", "x", registry=one, buckets=bounds)
    h2 = Histogram("lateness", "x", registry=bulk, buckets=bounds)
    values = [0.0, 0.005, 0.0051, 0.2, 0.25, 31.0, 1.0, *[random.random() for _ in range(500)]]
    for v in values:
        h1.observe(v)
    metrics.observe_many(h2, values, bounds)

    def lines(reg: CollectorRegistry) -> list[bytes]:
        return [x for x in generate_latest(reg).splitlines() if b"_created" not in x and b"_sum" not in x]

    assert lines(one) == lines(bulk)
    assert abs(h1._sum.get() - h2._sum.get()) < 1e-6  # type: ignore[attr-defined]


def test_with_snapshots_disabled_restart_rebuilds_from_the_timer_log(tmp_path: Path) -> None:
    settings = {"timer.snapshot_enabled": False, "timer.precision_ms": 100, "timer.wheel_slots": 1024}
    s = timer_store(str(tmp_path / "d"), **settings)
    create_topic(s, "t")
    base = future_base_ms()
    offs = schedule(s, "t", 0, [base + 100 * i for i in range(200)])
    clock = SimClock(s, base)
    clock.advance_to(base + 5_000, 100, "t", 1)
    s.dispatcher.checkpoint_views()
    before = _wheel_state(s)
    s.crash_close()
    assert not os.path.exists(tmp_path / "d" / "timer" / "snapshots")
    s2 = _reopen_same_wheel(tmp_path / "d", before, "timer log rebuild")
    clock2 = SimClock(s2, base + 5_000)  # type: ignore[arg-type]
    clock2._read = dict(clock._read)  # deliveries before the restart were counted by the first clock
    clock2.advance_to(base + 21_000, 100, "t", 1)
    assert sorted([*clock.fired_at, *clock2.fired_at]) == offs and not set(clock.fired_at) & set(clock2.fired_at)
    s2.stop()  # type: ignore[attr-defined]


class FixedConfirm(AloneRule):
    """A confirm rule stuck at one offset (a stalled in-sync replica)."""

    def __init__(self, offset: int) -> None:
        super().__init__(lambda: "master")
        self.offset = offset

    def confirm(self, flushed_offset: int) -> int:
        return self.offset


def test_a_cancel_that_times_out_still_keeps_its_timer_from_firing(tmp_path: Path) -> None:
    """The cancel is in the log but not confirmed in time: the caller gets an error, and the timer
    must not fire in the meantime (once the cancel is applied it never fires)."""
    s = timer_store(str(tmp_path / "d"), **{"limits.send_timeout_ms": 300})
    create_topic(s, "t")
    base = future_base_ms()
    off = schedule(s, "t", 0, [base + 100])[0]
    clock = SimClock(s, base)
    frozen = s.watermarks.confirm_offset
    s.register_confirm_rule(FixedConfirm(frozen))  # a stalled in-sync replica
    with pytest.raises(BrokerError) as slow:
        s.timers.cancel(off)
    assert slow.value.code == "DEADLINE_EXCEEDED"
    clock.advance_to(base + 400, 50, "t", 1)
    assert not clock.fired_at, "a timer whose cancel is in the log fired"
    s.register_confirm_rule(AloneRule(lambda: "master"))
    s.watermarks.advance_confirm()
    settle(s)
    clock.advance_to(base + 1000, 50, "t", 1)
    assert not clock.fired_at
    assert [e["__event"] for e in timer_events(s)] == ["cancelled"]
    with pytest.raises(BrokerError, match="already cancelled"):
        s.timers.cancel(off)
    s.stop()


def test_a_new_wheel_shape_relinks_every_pending_timer(tmp_path: Path) -> None:
    """Restart with another ring size: old snapshots are skipped and every pending timer is
    reachable from its new slot (and fires on time)."""
    s = timer_store(str(tmp_path / "d"), **{"timer.wheel_slots": 64})
    create_topic(s, "t")
    base = future_base_ms()
    ats = [base + 50 + 37 * i for i in range(300)]
    offs = schedule(s, "t", 0, ats)
    with s.dispatcher.lock:
        s.views.timers.write_snapshot()
    s.crash_close()
    s2 = timer_store(str(tmp_path / "d"), **{"timer.wheel_slots": 100})
    assert s2.views.timers.loaded_from.startswith("timer log rebuild")
    assert _pending_by_walk(s2) == sorted(offs)
    clock = SimClock(s2, base)
    clock.advance_to(base + 37 * 300 + 200, 20, "t", 1)
    _check_fired_once_never_early(clock, offs, ats, 20)
    s2.stop()


def test_a_delivery_is_never_stored_before_its_due_time_when_the_clock_steps_back(tmp_path: Path) -> None:
    """The firing thread finds timers due on one reading of the clock; if the clock steps back before
    the append stamps the delivery (NTP; chaos run seed 1751626363 stored three deliveries 1-16 ms
    early), the delivery still carries a store time at or after its due time. Here the firing's
    clock is an hour ahead of the appender's: a whole step back between the two readings."""
    s = timer_store(str(tmp_path / "d"), **{"timer.precision_ms": 100})
    create_topic(s, "t", queues=2)
    base = future_base_ms()
    ats = [base + 250, base + 420, base + 430, base + 1_000]
    offs = schedule(s, "t", 0, ats[:2]) + schedule(s, "t", 1, ats[2:])
    clock = SimClock(s, base)
    clock.advance_to(base + 1_100, 50, "t", 2)
    _check_fired_once_never_early(clock, offs, ats, 50)
    stored = {off: (at, store_ms) for off, at, store_ms in deliveries(s, "t", 2)}
    assert sorted(stored) == sorted(offs)
    early = {off: v for off, v in stored.items() if v[1] < v[0]}
    assert not early, f"stored before due (timer offset: (due, store time)): {early}"
    wait_views_applied(s, send(s, "t", [b"after"], queue=0))  # and store times never go backwards after it
    times = []
    for raw in s.reads.pull("t", 0, 0, 100, 1 << 20, 0).batches:
        pos = 0
        while pos < len(raw):
            h = bf.verify_batch(raw, pos)
            times.append(h.store_time_ms)
            pos += h.batch_bytes
    assert len(times) >= 2 and times == sorted(times) and times[-1] >= ats[1]  # the deliveries (1 or 2 batches), then the send
    s.stop()
