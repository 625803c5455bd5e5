"""Helpers for timer tests: schedule through a real in-process store, drive firing rounds in
simulated time, read deliveries back by their origin ``timer_offset``."""

from __future__ import annotations

import time

import crc32c
import numpy as np

from broker.logformat import batch as bf
from broker.logformat import timer_props as tr
from broker.store import IncomingBatch, Store
from broker.timers import timerlog as tl
from tests.storeutil import open_store

HOUR_MS = 3_600_000


def future_base_ms() -> int:
    """A slot-aligned time an hour ahead: the store's own firing thread (real clock) never reaches it."""
    return (int(time.time() * 1000) + HOUR_MS) // 1000 * 1000


def timer_store(path: str, **overrides: object) -> Store:
    """A real store whose firing is driven by the test (``SimClock``), not by its thread."""
    s = open_store(path, **overrides)
    s.timers.stop()
    return s


def schedule(s: Store, topic: str, queue: int, ats: list[int]) -> list[int]:
    """Append scheduled records (one batch); return their timer offsets."""
    items = [(b"body-%d" % at, b"k", tr.scheduled_props(at, topic, queue, {"n": str(i)})) for i, at in enumerate(ats)]
    records, positions = bf.encode_records(items)
    batch = IncomingBatch(tr.TIMER_TOPIC, 0, records, len(items), crc32c.crc32c(records), timer_target=(topic, queue))
    receipts, end = s.appender.append([batch])
    s.watermarks.wait_ack(end, "flush", 5000)
    settle(s)
    base = receipts[0].commit_offset + bf.HEADER_BYTES + len(tr.TIMER_TOPIC)
    return [base + p for p in positions]


def settle(s: Store) -> None:
    assert s.dispatcher.wait_applied(s.views.timers, s.log.max_offset, 10), "timer view did not catch up"
    assert s.wait_metadata_applied(s.log.max_offset, 10)


def deliveries(s: Store, topic: str, queues: int, start: dict[int, int] | None = None) -> list[tuple[int, int, int]]:
    """(timer_offset, deliver_at_ms, store_time_ms) of every delivery in ``topic`` (from the queue
    offsets in ``start``, which is advanced), queue by queue."""
    settle(s)
    out: list[tuple[int, int, int]] = []
    start = {} if start is None else start
    for q in range(queues):
        offset = start.get(q, 0)
        while True:
            r = s.reads.pull(topic, q, offset, 100_000, 1 << 30, 0)
            if not r.count:
                break
            for raw in r.batches:
                pos = 0
                while pos < len(raw):
                    h = bf.verify_batch(raw, pos)
                    batch = memoryview(raw)[pos : pos + h.batch_bytes]
                    assert h.flags & bf.FLAG_TIMER_DELIVERY
                    for _, _, props, _ in bf.iter_records(batch, h):
                        p = bf.decode_props(props)
                        out.append((int(p[tr.TIMER_OFFSET]), int(p[tr.DELIVER_AT]), h.store_time_ms))
                    pos += h.batch_bytes
            offset = r.next_offset
        start[q] = offset
    return out


def timer_events(s: Store) -> list[dict[str, str]]:
    """Every event record in ``__timer`` (fired, cancelled, dropped)."""
    settle(s)
    out: list[dict[str, str]] = []
    r = s.reads.pull(tr.TIMER_TOPIC, 0, 0, 1_000_000, 1 << 30, 0)
    for raw in r.batches:
        pos = 0
        while pos < len(raw):
            h = bf.verify_batch(raw, pos)
            batch = memoryview(raw)[pos : pos + h.batch_bytes]
            if tr.is_event_batch(batch, h):
                out.extend(tr.iter_events(batch, h))
            pos += h.batch_bytes
    return out


class SimClock:
    """Drives ``store.timers`` in simulated time: ``advance_to`` runs a round every ``step_ms``
    and records, for each timer fired, the simulated time of the round that fired it."""

    def __init__(self, s: Store, start_ms: int) -> None:
        self.s = s
        self.now = start_ms
        s.timers.clock_ms = lambda: self.now
        s.timers._stop.clear()  # stopped only so that its thread is gone: the test drives it
        s.timers._catch_up()
        settle(s)
        self.fired_at: dict[int, list[int]] = {}  # timer offset -> simulated times it was delivered
        self._read: dict[int, int] = {}

    def advance_to(self, end_ms: int, step_ms: int, topic: str, queues: int) -> None:
        while self.now < end_ms:
            self.now = min(end_ms, self.now + step_ms)
            if self.s.timers.round():
                self.collect(topic, queues)

    def collect(self, topic: str, queues: int) -> None:
        for off, _, _ in deliveries(self.s, topic, queues, self._read):
            self.fired_at.setdefault(off, []).append(self.now)


def timer_log_types(s: Store) -> np.ndarray:
    recs = tl.read_records(s.views.timers.log, s.views.timers.log.min_offset, s.views.timers.log.max_offset)
    return recs["type"]
