"""Acks carried by pops, decided in the pops' own pass (broker/groups/pops.py ``_pass``), against an
in-process store (real files, fsync, LMDB) whose clock the test sets: at the edge of a lease, an
ack the pass accepts is never leased again by it, and one it refuses as expired is leased again
at once; several pops' acks in one pass each get their own outcome."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.errors import BrokerError
from broker.groups import pops as pops_module
from broker.groups import receipts
from broker.groups.pop_parts import FAILED_PRECONDITION
from broker.groups.pops import LeasedRun, PopService, _here
from broker.store import Store
from broker.views.pop_leases import PopQueue
from tests.storeutil import create_topic, open_store, send
from tests.waits import wait_until

T0 = 1_900_000_000_000  # the test's clock (epoch ms)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    yield s
    s.stop()


def _at(monkeypatch: pytest.MonkeyPatch, now: int) -> list[int]:
    """The pops' clock, set to ``now`` (the list's one item: change it to move the clock)."""
    clock = [now]
    monkeypatch.setattr(pops_module, "now_ms", lambda: clock[0])
    return clock


def _each(runs: list[LeasedRun]) -> dict[int, str]:
    """Offset -> the handle of that message alone."""
    out = {}
    for r in runs:
        lease, topic = receipts.lease_of(r.receipt_handle), r.receipt_handle.split(".", 2)[2]
        out.update({o: receipts.run_handle(lease, o, 1, topic) for o in range(r.first_offset, r.first_offset + r.count)})
    return out


def _offsets(runs: list[LeasedRun]) -> list[tuple[int, int]]:
    """(offset, delivery count) of every message of ``runs``."""
    return [(o, r.delivery_count) for r in runs for o in range(r.first_offset, r.first_offset + r.count)]


def test_at_the_edge_of_a_lease_an_accepted_ack_is_never_leased_again(store: Store,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pops = PopService(store)
    send(store, "t", [b"m%d" % i for i in range(4)])
    _at(monkeypatch, T0)
    handles = _each(pops.pop_many("g", "t", [2], 500, True).outs[0])  # 0 and 1 until T0 + 500
    handles.update(_each(pops.pop_many("g", "t", [2], 1_000, True).outs[0]))  # 2 and 3 until T0 + 1,000
    assert sorted(handles) == [0, 1, 2, 3]

    # the last millisecond of 0 and 1's lease: their acks hold, and the pass picks at that same
    # millisecond (the clock moves on once the acks are decided: read again, it finds them expired)
    clock = _at(monkeypatch, T0 + 499)
    decide = pops.ends_record

    def then_later(*args: Any, **kwargs: Any) -> Any:
        out = decide(*args, **kwargs)
        clock[0] = T0 + 500
        return out
    monkeypatch.setattr(pops, "ends_record", then_later)
    done = pops.pop_many("g", "t", [10], 1_000, True, acks=[[handles[0], handles[1]]])
    assert done.acked == [[]] and done.outs == [[]]
    assert done.wake_ms == T0 + 1_000  # when 2 and 3 come back: the acked leases' end does not count
    monkeypatch.setattr(pops, "ends_record", decide)
    _at(monkeypatch, T0 + 1_000)  # the lease ended: the ack of 2 is refused, and 2 and 3 come back
    done = pops.pop_many("g", "t", [10], 1_000, True, acks=[[handles[2]]])
    assert done.acked == [[(handles[2], FAILED_PRECONDITION, "the lease expired: the message will be delivered again")]]
    assert _offsets(done.outs[0]) == [(2, 2), (3, 2)]
    queue = pops.view.queue("g", "t", 0)
    assert queue is not None and queue.base == 2  # 0 and 1 are done for good


def test_acks_of_several_pops_in_one_pass_each_get_their_own_outcome(store: Store,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pops = PopService(store)
    send(store, "t", [b"m%d" % i for i in range(30)])
    _at(monkeypatch, T0)
    handles = _each(pops.pop_many("g", "t", [6], 60_000, True).outs[0])
    calls = [[handles[0], handles[1]], ["not-a-handle", handles[2]], [handles[3], handles[1]], [], [handles[4]]]
    done = pops.pop_many("g", "t", [2, 2, 2, 2, 2], 60_000, True, acks=calls)
    assert done.acked[0] == [] and done.acked[3] == [] and done.acked[4] == []
    malformed = done.acked[1]
    assert isinstance(malformed, Exception) and "not-a-handle" in str(malformed)  # its call's acks alone refused
    assert done.acked[2] == [(handles[1], FAILED_PRECONDITION, "the lease ended: the message was acked")]
    assert [_offsets(out) for out in done.outs] == [[(6 + 2 * i, 1), (7 + 2 * i, 1)] for i in range(5)]
    queue = pops.view.queue("g", "t", 0)
    assert queue is not None
    assert queue.base == 2 and bool(queue.done[3 - 2]) and bool(queue.done[4 - 2]) and not queue.done[0]  # 2 kept


def test_acks_are_kept_when_only_a_busy_queue_has_messages(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The acks' queue has nothing; the other queue is busy: the pass appends the acks, then waits
    for that queue and leases from it (a second record). If that wait fails, the pop is answered
    empty and the acks stand, durable, instead of the call failing."""
    create_topic(store, "two", queues=2)
    pops = PopService(store)
    monkeypatch.setattr(pops.locks, "stripe", lambda key: key[2])  # queue 0 and 1: two stripes
    busy = pops.locks.lock(("g", "two", 1))
    failing = [False]
    real_holding = pops.locks.holding

    @contextlib.contextmanager
    def holding(keys: Iterable[tuple[str, str, int]]) -> Iterator[set[int]]:
        keys = list(keys)
        if keys == [("g", "two", 1)] and busy.locked():  # the second pass waits: the test lets go
            busy.release()
            if failing[0]:
                raise BrokerError("UNAVAILABLE", "the test's wait for the queue fails")
        with real_holding(keys) as held:
            yield held
    monkeypatch.setattr(pops.locks, "holding", holding)

    send(store, "two", [b"a0"], queue=0)
    send(store, "two", [b"b%d" % i for i in range(5)], queue=1)
    _at(monkeypatch, T0)
    first = pops.pop_many("g", "two", [1], 60_000, True).outs[0]  # the rotation starts at queue 0
    assert [r.queue_id for r in first] == [0]
    busy.acquire()
    done = pops.pop_many("g", "two", [10], 60_000, True, acks=[[first[0].receipt_handle]])
    assert not busy.locked()  # the second pass took queue 1
    assert done.acked == [[]] and [(r.queue_id, r.first_offset, r.count) for r in done.outs[0]] == [(1, 0, 5)]
    queue0 = pops.view.queue("g", "two", 0)
    assert queue0 is not None and queue0.base == 1  # the ack is applied

    assert pops.pop_many("g", "two", [10], 60_000, True).outs == [[]]  # nothing left: the topic is idle
    send(store, "two", [b"a1"], queue=0)
    send(store, "two", [b"b5"], queue=1)
    wait_until(lambda: not pops.idle("g", "two")[0], 5, "the dispatcher's word that the queues grew")
    lease = [r for r in pops.pop_many("g", "two", [2], 60_000, True).outs[0] if r.queue_id == 0]
    assert len(lease) == 1
    failing[0] = True
    busy.acquire()
    done = pops.pop_many("g", "two", [10], 60_000, True, acks=[[lease[0].receipt_handle]])
    assert not busy.locked()
    assert done.acked == [[]] and done.outs == [[]]  # answered empty, the ack kept
    assert queue0.base == 2 and store.watermarks.confirm_offset >= store.log.max_offset


def test_base_after_and_next_visible_leave_out_the_leases_that_end() -> None:
    q = PopQueue(10)
    assert q.base_after(np.array([10, 11], np.int64)) == 10  # an empty window: nothing moves
    q.lease(np.arange(10, 16, dtype=np.int64), 5_000, 7)
    q.lease(np.array([16], np.int64), 3_000, 8)
    q.finish(np.array([12], np.int64))
    assert q.base == 10
    assert q.base_after(np.array([11, 10, 10, 99, 3], np.int64)) == 13  # 12 was done; duplicates and strays ignored
    assert q.base_after(np.arange(10, 17, dtype=np.int64)) == 17  # everything done: the window's end
    assert q.next_visible_ms() == 3_000
    assert q.next_visible_ms(np.array([16], np.int64)) == 5_000
    assert q.next_visible_ms(np.arange(10, 17, dtype=np.int64)) is None


def test_an_empty_window_begins_again_past_a_gap_and_fresh_offsets_skip_other_shards_segments() -> None:
    """A queue moved away and back (docs/shards.md): the fresh offsets a shard leases skip the other
    shards' segments; a window with nothing open jumps over one at no cost (no array spans it),
    one with leases open below it counts the gap against its room."""
    gaps = [(100, 10_000_000), (10_000_050, 10_000_060)]
    assert _here(40, 10_000_100, gaps) == (40, 100), "up to the gap"
    assert _here(100, 10_000_100, gaps) == (10_000_000, 10_000_050), "past it, up to the next"
    assert _here(10_000_055, 10_000_100, gaps) == (10_000_060, 10_000_100)
    assert _here(10_000_060, 10_000_040, []) == (10_000_060, 10_000_060), "never a negative range"
    q = PopQueue(90)
    q.lease(np.arange(90, 100, dtype=np.int64), 5_000, 7)
    q.finish(np.arange(90, 100, dtype=np.int64))
    assert (q.base, q.cursor) == (100, 100)
    q.lease(np.arange(10_000_000, 10_000_010, dtype=np.int64), 5_000, 8)
    assert (q.base, q.cursor) == (10_000_000, 10_000_010) and q.until.size < 1000, "no array spans the gap"
    assert q.in_flight() == 10


def test_offsets_gone_before_their_first_delivery_move_the_cursor_past_them() -> None:
    """Aborted (or removed) offsets at the cursor, leased by no one: the cursor passes over the run
    of them that starts at it, never over a fresh offset beyond a hole in that run."""
    q = PopQueue(0)
    q.lease(np.arange(0, 5, dtype=np.int64), 5_000, 7)
    q.finish(np.array([5, 6, 7, 9], np.int64))  # 8 is not gone: the cursor stops there
    assert (q.base, q.cursor) == (0, 8) and q.in_flight() == 5
    q.finish(np.arange(0, 5, dtype=np.int64))
    assert (q.base, q.cursor) == (8, 8)
    q.finish(np.arange(8, 20, dtype=np.int64))  # an empty window: begins again past them
    assert (q.base, q.cursor) == (20, 20) and q.window == 0
    q.finish(np.array([30], np.int64))  # not at the cursor: nothing moves
    assert (q.base, q.cursor) == (20, 20)
