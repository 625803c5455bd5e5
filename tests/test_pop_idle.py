"""The pop service's shortcuts keep its promises (issue 35's review): the idle cache never answers
"nothing" where a pop would lease something or be refused, dead letters held back for want of a
DLQ do not hold up redeliveries, one group's DLQ does not clear another's incident, and a decode
in the event loop never gives the interpreter lock away. In-process store (real files and LMDB)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.daemon import plain
from broker.errors import BrokerError
from broker.groups.pops import PopService
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.store import Store
from tests.storeutil import create_topic, open_store, send, wait_views_applied


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(str(tmp_path), **{"groups.max_deliveries": 2})
    create_topic(s, "t")
    yield s
    s.stop()


def _offsets(runs: list) -> list[int]:  # type: ignore[type-arg]
    return [r.first_offset + i for r in runs for i in range(r.count)]


def _send(s: Store, *bodies: bytes) -> None:
    send(s, "t", list(bodies))
    wait_views_applied(s, s.log.max_offset)


def test_a_demoted_or_fenced_node_refuses_instead_of_answering_from_the_cache(store: Store) -> None:
    pops = PopService(store)
    assert pops.pop("g", "t", 10, 30_000, True) == ([], None)
    assert pops.pop("g", "t", 10, 30_000, True)[0] == []  # remembered as idle now
    store.fenced_reason = "a higher epoch exists"
    with pytest.raises(BrokerError) as fenced:
        pops.pop("g", "t", 10, 30_000, True)
    assert fenced.value.code == "FAILED_PRECONDITION"
    store.fenced_reason = ""
    store.set_role("slave", "10.0.0.2:7700")
    store.set_redirect("10.0.0.2:7600")
    with pytest.raises(BrokerError) as demoted:
        pops.pop("g", "t", 10, 30_000, True)
    assert demoted.value.code == "FAILED_PRECONDITION" and ("tidemark-master", "10.0.0.2:7600") in demoted.value.metadata


def test_a_topic_deleted_and_created_again_is_another_topic_to_the_cache(store: Store) -> None:
    pops = PopService(store)
    _send(store, b"a")
    assert _offsets(pops.pop("g", "t", 10, 30_000, True)[0]) == [0]
    assert pops.pop("g", "t", 10, 30_000, True)[0] == []  # idle
    for change in (system_records.TOPIC_DELETE, system_records.TOPIC_CREATE):
        fields = {"topic": "t"} if change == system_records.TOPIC_DELETE else {"topic": "t", "queues": 1}
        store.writes.write_system([(change, fields)], applied=store.views.metadata)
    wait_views_applied(store, store.log.max_offset)
    assert pops.pop("g", "t", 10, 30_000, False)[0] == []  # the group starts again on the new topic
    _send(store, b"x", b"y", b"z")
    assert _offsets(pops.pop("g", "t", 10, 30_000, False)[0]) == [0, 1, 2]


def test_dead_letters_held_back_do_not_hold_up_redeliveries(store: Store) -> None:
    """max_deliveries 2, no DLQ and no right to create one: 0 and 1 die and wait; 2 and 3, nacked,
    come back to a pop of 2, as they did before any letter died."""
    pops = PopService(store)
    _send(store, b"m0", b"m1", b"m2", b"m3")
    for _ in range(2):  # two deliveries of 0 and 1, each nacked at once
        runs, _ = pops.pop("g", "t", 2, 30_000, True, may_create_dlq=False)
        assert _offsets(runs) == [0, 1]
        assert pops.nack("g", [r.receipt_handle for r in runs], 0) == []
    runs, _ = pops.pop("g", "t", 2, 30_000, True, may_create_dlq=False)
    assert _offsets(runs) == [2, 3]
    assert pops.nack("g", [r.receipt_handle for r in runs], 0) == []
    again, _ = pops.pop("g", "t", 2, 30_000, True, may_create_dlq=False)  # 0 and 1 are dead, held back
    assert _offsets(again) == [2, 3] and {r.delivery_count for r in again} == {2}
    assert store.incidents.snapshot()["dlq"]["active"]


def test_one_groups_dlq_does_not_clear_anothers_held_letters(store: Store) -> None:
    pops = PopService(store)
    assert not pops.dead.ready("a", may_create=False)
    assert pops.dead.ready("b", may_create=True)  # b's DLQ created; a's letters still wait
    incident = store.incidents.snapshot()["dlq"]
    assert incident["active"] and "'a'" in incident["error"]
    assert pops.dead.ready("a", may_create=True)
    assert not store.incidents.snapshot()["dlq"]["active"]


def test_a_decode_gives_the_lock_away_only_in_a_pool_thread_and_only_while_it_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A count of 499 once made every record after the 499th sleep(0) (19,501 of them: 82 s next
    to a busy thread); on the event loop it must never yield at all."""
    records, _ = bf.encode_records([(b"r", b"", b"")] * 20_000)
    header = bf.build_header(batch_bytes=bf.HEADER_BYTES + 1 + len(records), record_count=20_000, base_offset=0,
                             base_queue_offset=0, store_time_ms=0, producer_id=0, base_sequence=-1, epoch=1, queue_id=0,
                             topic_raw=b"t", body_crc=0)
    sleeps: list[float] = []
    monkeypatch.setattr(time, "sleep", sleeps.append)
    assert len(plain.decode([header + records], 0, 499)) == 499
    assert sleeps == []  # not in a pool thread's heavy job: never
    with plain.yielding():
        assert len(plain.decode([header + records], 0, 499)) == 499
        assert len(sleeps) <= 1
        sleeps.clear()
        assert len(plain.decode([header + records], 0, 10_000)) == 10_000
        assert len(sleeps) == 10_000 // plain.YIELD_EVERY
