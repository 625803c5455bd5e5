"""A divergence cut rebuilds the append side's tail (next queue offsets, topics, producer sequences)
while the dispatcher may be applying a batch that adds queue files (issue 36). The new tail is
built first, from the views held still, and swapped in with the cut: never a stale tail that
answers a retried send "duplicate" of a batch that no longer exists. In-process store, the
dispatcher's queue-file creation slowed down so that the truncation lands in the middle of it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import crc32c
import pytest

from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.ports import Truncation
from broker.store import IncomingBatch
from broker.views import ConsumeQueueView
from tests.storeutil import create_topic, open_store, wait_views_applied
from tests.waits import wait_until

PRODUCER = 7


class HeldConfirm:
    """A confirm rule that confirms no further than ``limit`` (a slave that stopped acking)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def confirm(self, flushed_offset: int) -> int:
        return min(flushed_offset, self.limit)

    def insync_replicas(self) -> int:
        return 0

    def replicas_acked(self, offset: int) -> int:
        return 0


def _idempotent(sequence: int, body: bytes) -> IncomingBatch:
    raw, _ = bf.encode_records([(body, b"", b"")])
    return IncomingBatch("t", 0, raw, 1, crc32c.crc32c(raw), PRODUCER, sequence)


def test_a_cut_during_a_dispatch_round_leaves_a_tail_without_the_cut_batches(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_store(str(tmp_path))
    try:
        create_topic(s, "t")
        end = s.appender.append_system([(system_records.TOPIC_CREATE, {"topic": f"old{i}", "queues": 16}) for i in range(1000)])
        s.watermarks.wait_ack(end, "flush", 10_000)  # 16,000 queues already: walking them takes a while
        s.appender.append([_idempotent(0, b"kept")])
        wait_views_applied(s, s.log.max_offset)
        rule = HeldConfirm(s.log.max_offset)
        s.register_confirm_rule(rule)
        creates = [(system_records.TOPIC_CREATE, {"topic": f"n{i}", "queues": 8}) for i in range(600)]
        metadata_end = s.appender.append_system(creates)  # 4,800 queue files when applied
        _, cut_end = s.appender.append([_idempotent(1, b"cut-1"), _idempotent(2, b"cut-2")])
        assert s.appender.queue_end("t", 0) == 3
        add_file = ConsumeQueueView._add_file

        def slow_add_file(self: ConsumeQueueView, *args: object, **kwargs: object) -> None:
            until = time.perf_counter() + 0.0002
            while time.perf_counter() < until:  # busy: the dispatcher stays runnable all round
                pass
            add_file(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(ConsumeQueueView, "_add_file", slow_add_file)
        monkeypatch.setattr(sys, "getswitchinterval", sys.getswitchinterval)  # (restored below)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # the two threads interleave finely: the truncation meets the round
        rule.limit = metadata_end  # the dispatcher starts applying the creates: a round of ~1.5 s
        s.watermarks.want_flush()
        wait_until(lambda: s.views.queues.queue("n0", 0) is not None, 10, poll_s=0.001,
                   what="the round adding the new topics' queue files")
        assert s.views.queues.queue("n599", 0) is None  # (still at it)
        try:
            assert s.appender.truncate_to(metadata_end) is Truncation.CUT
        finally:
            sys.setswitchinterval(switch)
        assert s.log.max_offset == metadata_end < cut_end
        tail = s.appender.tail
        assert tail.queue_next[("t", 0)] == 1  # the cut batches' offsets are gone
        assert "n599" in tail.topics  # the creates below the cut are there
        wait_views_applied(s, metadata_end)
        receipts, _ = s.appender.append([_idempotent(1, b"again")])  # the retried send is new, not a duplicate
        assert not receipts[0].duplicate and receipts[0].base_queue_offset == 1
        wait_until(lambda: s.views.queues.queue("n599", 7) is not None, 10, what="the creates applied")
    finally:
        s.register_confirm_rule(HeldConfirm(1 << 62))
        s.stop()
