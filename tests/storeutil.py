"""Helpers for in-process store tests (the store itself is real: files, fsync, LMDB)."""

from __future__ import annotations

import crc32c

from broker.config import Config
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.store import IncomingBatch, Store
from tests.waits import wait_until


def open_store(path: str, **overrides: object) -> Store:
    cfg = Config.build({}, {"checkpoint.interval_ms": 60_000, **overrides}, environ={})
    s = Store.open(cfg, path)
    s.start()
    return s


def create_topic(s: Store, name: str, queues: int = 1) -> None:
    end = s.appender.append_system([(system_records.TOPIC_CREATE, {"topic": name, "queues": queues})])
    s.watermarks.wait_ack(end, "flush", 5000)
    assert s.wait_metadata_applied(end, 5)


def send(s: Store, topic: str, bodies: list[bytes], queue: int = 0) -> int:
    records, _ = bf.encode_records([(b, b"", b"") for b in bodies])
    _, end = s.appender.append([IncomingBatch(topic, queue, records, len(bodies), crc32c.crc32c(records))])
    s.watermarks.wait_ack(end, "flush", 5000)
    return end


def wait_views_applied(s: Store, offset: int, timeout_s: float = 5) -> None:
    """Until the store's applied offset (the lowest of its views') reaches ``offset``."""
    wait_until(lambda: s.watermarks.applied_offset >= offset, timeout_s, f"the views to apply up to {offset}", poll_s=0.002,
               observe=lambda: {v.name: v.applied_offset for v in s.views})


def read_all(s: Store, topic: str, queue: int = 0) -> list[bytes]:
    """Everything readable once the views caught up with the confirm offset."""
    wait_views_applied(s, s.watermarks.confirm_offset)
    out: list[bytes] = []
    offset = s.reads.queue_bounds(topic, queue)[0]
    while True:
        r = s.reads.pull(topic, queue, offset, 100_000, 1 << 30, 0)
        if not r.count:
            return out
        remaining = r.count
        skip = r.skip_first
        for raw in r.batches:  # each blob is a run of adjacent batches
            pos = 0
            while pos < len(raw):
                h = bf.verify_batch(raw, pos)
                batch = memoryview(raw)[pos : pos + h.batch_bytes]
                for i, (_, _, _, body) in enumerate(bf.iter_records(batch, h)):
                    if i < skip or remaining == 0:
                        continue
                    out.append(bytes(body))
                    remaining -= 1
                skip = 0
                pos += h.batch_bytes
        offset = r.next_offset
