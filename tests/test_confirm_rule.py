"""The confirm rule and the watermarks under role changes, truncations and misbehaving replicas
(in process: a real store, the replication plugin's in-sync set, simulated peers)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import crc32c

from broker.logformat import batch as bf
from broker.ports import IncomingBatch, Truncation
from replication.confirm import InSyncSet
from tests.storeutil import create_topic, open_store
from tests.waits import holds_for, wait_until


def _batch(body_bytes: int) -> IncomingBatch:
    records, _ = bf.encode_records([(b"y" * body_bytes, b"", b"")])
    return IncomingBatch("t", 0, records, 1, crc32c.crc32c(records))


class _Frozen:
    """A confirm rule that confirms nothing new (as on a slave whose master is silent)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def confirm(self, flushed_offset: int) -> int:
        return self.at

    def insync_replicas(self) -> int:
        return 0

    def replicas_acked(self, offset: int) -> int:
        return 0


def test_a_demoted_node_forgets_an_old_masters_confirm_offset(tmp_path: Path) -> None:
    """A node that once followed a master (which confirmed up to X), became master, then is demoted:
    its confirm offset must not jump to min(flushed, X) before it follows anyone."""
    s = open_store(str(tmp_path), **{"replication.max_lag_ms": 60_000, "replication.max_lag_bytes": 1 << 30})
    create_topic(s, "t")
    insync = InSyncSet(s.config, lambda: s.role, lambda: s.log.max_offset)
    s.register_confirm_rule(insync)
    insync.master_confirmed(s.log.max_offset + 3000)  # what its master confirmed, long ago
    replica = insync.connected("b", "b:1", acked_offset=s.watermarks.confirm_offset)  # a lagging in-sync slave
    insync.sent_to_end(replica, s.log.max_offset)
    insync.acked(replica, s.watermarks.confirm_offset)
    for _ in range(10):
        s.appender.append([_batch(900)])
    low = s.watermarks.confirm_offset
    s.set_role("slave", "new-master:1")  # demoted: it follows only later
    holds_for(lambda: s.watermarks.confirm_offset == low, 0.3, what="the confirm offset to stay put")
    s.crash_close()


def test_an_fsync_that_overlapped_a_truncation_publishes_nothing(tmp_path: Path) -> None:
    """The flusher's fsync returns after the tail was cut: the flushed offset must not come back above
    the new log end, and a later ack=flush really waits for its own fsync."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    base = s.log.max_offset
    s.register_confirm_rule(_Frozen(s.watermarks.confirm_offset))
    real_sync = s.log.sync
    inside = threading.Event()

    def slow_sync() -> int:
        target = real_sync()
        inside.set()
        time.sleep(0.3)  # the window between the fsync and publishing its offset
        return target

    s.log.sync = slow_sync  # type: ignore[method-assign]
    s.appender.append([_batch(5000)])  # ack=leader: not flushed yet
    assert inside.wait(2)
    assert s.appender.truncate_to(base) is Truncation.CUT
    holds_for(lambda: s.watermarks.flushed_offset <= s.log.max_offset, 0.5, what="flushed <= log end")
    s.log.sync = real_sync  # type: ignore[method-assign]
    _, end = s.appender.append([_batch(100)])
    s.watermarks.wait_ack(end, "flush", 2000)
    assert s.watermarks.flushed_offset >= end
    s.crash_close()


def test_a_truncation_below_the_confirm_offset_asks_for_a_bootstrap(tmp_path: Path) -> None:
    """Confirmed but not yet applied (the dispatcher lags): a divergence point below it is not cut."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    base = s.log.max_offset
    with s.dispatcher.lock:  # the dispatcher stands still: confirmed records stay unapplied
        _, end = s.appender.append([_batch(500)])
        s.watermarks.wait_ack(end, "flush", 2000)
        wait_until(lambda: s.watermarks.confirm_offset >= end, 5, what="the confirm offset")
        assert s.appender.truncate_to(base) is Truncation.BELOW_APPLIED
        assert s.log.max_offset == end
    s.crash_close()


def test_an_evicted_replica_leaves_like_a_silent_one() -> None:
    """A replica thrown out for a false claim is not dropped at once (a genuine slave cut off then
    still believes itself promotable until max_lag_ms): the confirm offset stays where it really was."""
    config = {"replication.max_lag_bytes": 1 << 20, "replication.max_lag_ms": 10_000}
    insync = InSyncSet(config, lambda: "master", lambda: 10_000)  # type: ignore[arg-type]
    replica = insync.connected("b", "b:1", acked_offset=6_000)
    replica.sent_end = 6_000
    insync.sent_to_end(replica, 10_000)
    assert insync.confirm(10_000) == 6_000
    insync.evict(replica, "ack beyond what was sent")
    assert insync.confirm(10_000) == 6_000 and replica.evicted
