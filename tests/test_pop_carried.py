"""Acks carried by pops, decided in the pops' own pass (broker/groups/pops.py ``_pass``), against an
in-process store (real files, fsync, LMDB) whose clock the test sets: at the edge of a lease, an
ack the pass accepts is never leased again by it, and one it refuses as expired is leased again
at once; several pops' acks in one pass each get their own outcome."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.groups import pops as pops_module
from broker.groups import receipts
from broker.groups.pop_parts import FAILED_PRECONDITION
from broker.groups.pops import LeasedRun, PopService
from broker.store import Store
from tests.storeutil import create_topic, open_store, send

T0 = 1_900_000_000_000  # the test's clock (epoch ms)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    yield s
    s.stop()


def _at(monkeypatch: pytest.MonkeyPatch, now: int) -> None:
    monkeypatch.setattr(pops_module, "now_ms", lambda: now)


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
    first = pops.pop_many("g", "t", [10], 1_000, True)
    handles = _each(first.outs[0])
    assert sorted(handles) == [0, 1, 2, 3]

    _at(monkeypatch, T0 + 999)  # the lease's last millisecond: acks of 0 and 1 hold, 2 and 3 stay leased
    done = pops.pop_many("g", "t", [10], 1_000, True, acks=[[handles[0], handles[1]]])
    assert done.acked == [[]] and done.outs == [[]]

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
