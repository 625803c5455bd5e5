"""The producer table (idempotent sends): the last batches per (producer, topic, queue), copies that
share their lists yet never see each other's changes, rollback, and the checkpoint round trip."""

from __future__ import annotations

from broker.views.producer_state import BATCHES_KEPT_PER_PRODUCER, ProducerTable


def record(t: ProducerTable, seq: int, pid: int = 7, queue: int = 0) -> None:
    t.record_batch(pid, "t", queue, seq, 2, 1000 + seq, seq)


def test_a_copy_and_its_original_change_apart() -> None:
    a = ProducerTable()
    for seq in range(0, 12, 2):
        record(a, seq)
    b = a.copy()  # the append path's tail copy, made at start-up
    record(b, 12)
    record(a, 100, queue=1)
    assert [r[0] for r in a.table[(7, "t", 0)]] == [2, 4, 6, 8, 10]
    assert [r[0] for r in b.table[(7, "t", 0)]] == [4, 6, 8, 10, 12]
    assert (7, "t", 1) not in b.table
    assert len(b.table[(7, "t", 0)]) == BATCHES_KEPT_PER_PRODUCER
    assert b.check(7, "t", 0, 12).duplicate_of == (12, 2, 1012, 12)
    assert a.check(7, "t", 0, 12).duplicate_of is None and not a.check(7, "t", 0, 12).error


def test_rollback_restores_what_a_failed_append_changed() -> None:
    t = ProducerTable()
    record(t, 0)
    before = {k: list(v) for k, v in t.table.items()}
    undo = t.savepoint()
    record(t, 2)
    record(t, 0, pid=8)
    t.rollback(undo)
    assert {k: list(v) for k, v in t.table.items()} == before


def test_the_checkpoint_round_trip_keeps_order_and_values() -> None:
    t = ProducerTable(producers_max=3)
    for pid in range(5):
        record(t, pid, pid=pid)
    back = ProducerTable.from_json(t.to_json(), producers_max=3)
    assert list(back.table.items()) == list(t.table.items())
    assert [k[0] for k in back.table] == [2, 3, 4]  # the least recently used were forgotten


def test_forwarded_timers_are_kept_apart_from_clients_producers() -> None:
    """A forwarded timer's pseudo-producer (docs/shards.md) never pushes a client's producer out,
    never counts among a queue's latest producers, and survives a checkpoint."""
    t = ProducerTable(producers_max=2)
    t.record_batch(7, "t", 0, 0, 3, 100, 0)
    for pid in range(1000, 1010):
        t.record_batch(pid, "t", 0, 0, 1, 200 + pid, pid, forwarded=True)
    assert t.of_queue("t", 0, 64) == [[7, 0, 3, 100, 0]]
    assert t.check(7, "t", 0, 0).duplicate_of is not None, "the client's producer is still known"
    assert t.check(1009, "t", 0, 0, forwarded=True).duplicate_of is not None
    assert t.check(1000, "t", 0, 0, forwarded=True).duplicate_of is None, "the oldest forwarded one went"
    back = ProducerTable.from_json(t.to_json(), 10, forwarded=t.forwarded_json())
    assert back.table == t.table and back.forwarded == t.forwarded
    undo = back.savepoint()
    back.record_batch(2000, "t", 0, 0, 1, 1, 1, forwarded=True)
    back.rollback(undo)
    assert back.forwarded == t.forwarded
