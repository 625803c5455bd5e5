"""The store: one commit log, its views, group commit, the dispatcher and queue reads.

Write path: validate batches (outside the lock) → under the append lock fill headers, check
producer sequences against the *tail* state and write all batches with one writev → wait for
the ack mode (leader: now; flush: the group-commit fsync passed the batch; replica: the confirm
offset passed it).

The flusher thread fsyncs whenever someone waits (group commit: one fsync serves every waiter)
and at least every ``commitlog.flush_interval_ms``. The confirm offset is computed from the
flushed offset by a pluggable ``confirm_source`` (alone: the flushed offset itself; replication
plugs in min(flushed, in-sync acks)). The dispatcher applies records to every view only up to
the confirm offset, and checkpoints them every ``checkpoint.interval_ms``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import crc32c
import lmdb
import structlog

from broker import metrics
from broker.config import Config
from broker.errors import BrokerError, invalid, not_found
from broker.invariant import invariant
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.logformat import timer_props as timer_records
from broker.storage.commitlog import CommitLog
from broker.storage.deferred_close import DEFERRED
from broker.storage.epochs import EpochHistory
from broker.storage.failpoints import failpoint
from broker.storage.segment import FsyncFailed
from broker.store.offset_buffer import OffsetBuffer
from broker.timers.firing import TimerService
from broker.timers.view import TimerView
from broker.views import ConsumeQueueView, MetadataView, ProducerStateView, View
from broker.views.consume_queue import Entry
from broker.views.producer_state import ProducerTable

log = structlog.get_logger("store")

READ_CHUNK_BYTES = 4 << 20
PULL_ENTRIES_PER_READ = 256
ACKS = ("leader", "flush", "replica")
TIMER_BODIES_HOLD = -1  # retention_holds key: the oldest pending timer's scheduled record


class ColdReader(Protocol):
    """Reads of log ranges below the local log start (tiered storage plugs one in)."""

    def min_offset(self) -> int:
        """Lowest offset readable contiguously up to the local log start (the log start when none)."""
        ...

    def read(self, offset: int, length: int) -> bytes:
        """Log bytes [offset, offset + length) (whole batches); shorter when they are not stored."""
        ...


@dataclass(slots=True)
class IncomingBatch:
    """A batch as a client sent it: records already encoded, with their CRC32C."""

    topic: str
    queue_id: int
    records: bytes
    record_count: int
    body_crc: int
    producer_id: int = 0
    base_sequence: int = bf.NO_SEQUENCE
    flags: int = 0
    timer_target: tuple[str, int] | None = None  # a delayed batch for __timer: the (topic, queue) it fires into


@dataclass(frozen=True, slots=True)
class BatchReceipt:
    commit_offset: int
    base_queue_offset: int
    record_count: int
    duplicate: bool = False


@dataclass(frozen=True, slots=True)
class PullResult:
    batches: list[bytes]
    skip_first: int
    count: int
    next_offset: int
    min_offset: int
    max_offset: int


class Store:
    def __init__(self, config: Config, data_dir: str) -> None:
        from broker.store.recovery import is_new_data_dir, load_identity

        self.config = config
        self.data_dir = data_dir
        os.makedirs(data_dir, mode=0o700, exist_ok=True)
        self.is_new = is_new_data_dir(data_dir)  # before any component creates files
        self.identity = load_identity(self)  # recovery pass 1, before LMDB or the log create files
        self.log = CommitLog(os.path.join(data_dir, "log"), config["commitlog.segment_bytes"])
        ckpt = os.path.join(data_dir, "checkpoints")
        os.makedirs(ckpt, exist_ok=True)
        self.consume_queues = ConsumeQueueView(os.path.join(data_dir, "cq"), os.path.join(ckpt, "consume_queue.ckpt"))
        self.metadata = MetadataView(os.path.join(data_dir, "metadata"))
        self.producer_view = ProducerStateView(os.path.join(ckpt, "producer_state.ckpt"))
        self.timer_view = TimerView(os.path.join(data_dir, "timer"), config)
        self.views: list[View] = [self.metadata, self.consume_queues, self.producer_view, self.timer_view]
        self.epochs = EpochHistory(data_dir)
        self.role = config["node.role"]
        self.master_address = config["node.master"]  # where a slave sends writers (redirects)
        self.role_listeners: list[Callable[[str], None]] = []
        self.status_providers: list[Callable[[dict[str, object]], None]] = []
        self.insync_source: Callable[[], int] = lambda: 0  # replication plugs in: in-sync replicas besides us
        self.replica_acked: Callable[[int], int] = lambda offset: 0  # replicas whose ack passed an offset
        self.role_controller: object | None = None  # replication plugs in: promote(unclean) / demote(master)
        self.fenced_reason = ""
        self.closing = False
        # offsets and their condition (flushed / confirm / applied)
        self._cond = threading.Condition()
        self._appended = threading.Condition()  # notified after every append (replication senders wait here)
        self.flushed_offset = 0
        self.confirm_offset = 0
        self.applied_offset = 0  # min over views
        self.confirm_source: Callable[[int], int] = self._default_confirm_source()
        self._flush_wanted = False
        # tail state: what the next append needs, including unconfirmed batches
        self._append_lock = threading.Lock()
        self._tail_queue_next: dict[tuple[str, int], int] = {}
        self._tail_topics: set[str] = set()
        self._tail_producers = ProducerTable()
        self._last_store_time_ms = 0
        self._checkpointed: dict[str, int] = {}
        self.retention_holds: dict[int, int] = {}  # id -> offset retention must keep (snapshot streams)
        # tiered storage plugs in (broker never imports tieredstore): reads below the local log
        # start, and retention floors (only uploaded ranges may be deleted locally)
        self.cold_reader: ColdReader | None = None
        self.retention_floors: list[Callable[[], int]] = []
        self.views_lock = threading.Lock()  # held by the dispatcher while it touches views; a snapshot takes it
        self._last_ckpt = self._last_retention = 0.0
        self._checkpointed_prev: dict[str, int] = {}  # the .bak copy recovery may fall back to
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.offsets = OffsetBuffer(
            config["offsets.flush_interval_ms"], config["offsets.buffer_entries_max"], self._write_offsets
        )
        self.recovery_report: dict[str, object] = {}
        self._free_checked_at = 0.0
        self._free_bytes = 1 << 62
        self.timers = TimerService(self, self.timer_view)
        self.role_listeners.append(self.timers.on_role)

    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        from broker.store import recovery  # recovery drives this store's internals

        t0 = time.monotonic()
        self.recovery_report = recovery.run(self)
        metrics.RECOVERY_SECONDS.set(time.monotonic() - t0)
        for target, name in ((self._flush_loop, "flusher"), (self._dispatch_loop, "dispatcher")):
            t = threading.Thread(target=_fatal_on_error(target, name), name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self.offsets.start()
        if self.role == "master":
            self.timers.start()

    def stop(self) -> None:
        """Graceful stop: flush offsets, fsync, apply and checkpoint every view, mark clean."""
        from broker.store import recovery

        self.timers.stop()
        with contextlib.suppress(BrokerError):
            self.offsets.flush()
        self.offsets.stop()
        with self._append_lock:
            self._sync_log()
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            for t in self._threads:
                t.join()
            self.apply_until(self.confirm_offset)
            self.checkpoint_views()
            recovery.write_clean_marker(self)
        for v in self.views:
            v.close()
        self.log.close()
        DEFERRED.reap(everything=True)

    def crash_close(self) -> None:
        """Close files without a clean marker (tests of recovery inside one process)."""
        self.timers.stop()
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        for v in self.views:
            v.close()
        self.log.close()

    @property
    def epoch(self) -> int:
        return self.epochs.current

    def _default_confirm_source(self) -> Callable[[int], int]:
        """Alone, a master confirms what it flushed; a slave confirms nothing by itself (its
        follower supplies the master's confirm offset)."""
        if self.role == "master":
            return lambda flushed: flushed
        return lambda flushed: self.confirm_offset

    def set_role(self, role: str, master_address: str = "") -> None:
        """Change role and tell the listeners (replication, later timers and tiered upload)."""
        with self._append_lock:
            self.role = role
            self.master_address = master_address
            if role == "slave":
                self.confirm_source = self._default_confirm_source()
        log.info("role_changed", role=role, epoch=self.epoch, master=master_address)
        for listener in self.role_listeners:
            listener(role)

    def fence(self, reason: str) -> None:
        """Stop taking writes for good (a higher epoch exists elsewhere)."""
        if not self.fenced_reason:
            self.fenced_reason = reason
            log.warning("fenced", reason=reason)

    def wait_appended(self, offset: int, timeout_s: float) -> int:
        """Wait until the log grows past ``offset`` (or the timeout); return the log end."""
        with self._appended:
            self._appended.wait_for(lambda: self.log.max_offset > offset or self._stop.is_set(), timeout_s)
        return self.log.max_offset

    def _notify_appended(self) -> None:
        with self._appended:
            self._appended.notify_all()

    # -- tail state -------------------------------------------------------------------------------
    def rebuild_tail(self) -> None:
        """Derive the append-side state from the views plus log records above their offsets."""
        self._tail_queue_next = {}
        for (topic, q), qf in self.consume_queues._files.items():
            self._tail_queue_next[(topic, q)] = qf.next_queue_offset
            if qf.entries:  # store times never go back, even if the clock did while we were down
                self._last_store_time_ms = max(self._last_store_time_ms, qf.entry(qf.entries - 1).store_time_ms)
        self._tail_producers = self.producer_view.producers.copy()
        start = min(self.consume_queues.applied_offset, self.producer_view.applied_offset)
        self._tail_topics = {t for t in self.consume_queues.topics if not t.startswith(system_records.SYSTEM_PREFIX)}
        for header, batch in self.iter_batches(start, self.log.max_offset):
            self._tail_apply(header, batch, queues=header.base_offset >= self.consume_queues.applied_offset,
                             producers=header.base_offset >= self.producer_view.applied_offset)

    def _tail_apply(self, header: bf.BatchHeader, batch: memoryview, *, queues: bool = True, producers: bool = True) -> None:
        """Advance the append-side state past one batch that is already in the log."""
        if queues:
            self._tail_queue_next[(header.topic, header.queue_id)] = header.next_queue_offset
            if header.topic == system_records.METADATA_TOPIC:
                self._apply_topic_changes([
                    system_records.decode(k, b) for _, k, _, b in bf.iter_records(batch, header)
                    if bytes(k) in system_records.TOPIC_CHANGE_KEYS
                ])
        if producers:
            self._tail_producers.record(header)
        self._last_store_time_ms = max(self._last_store_time_ms, header.store_time_ms)

    # -- replicated writes (slave side) ---------------------------------------------------------------
    def append_replicated(self, data: bytes) -> int:
        """Append raw batches shipped by the master, byte for byte; return the new log end.

        Every batch is verified (both CRCs, its offset) before anything is written: a bad chunk
        is refused whole and the stream restarts from our log end.
        """
        mv = memoryview(data)
        headers: list[bf.BatchHeader] = []
        with self._append_lock:
            expected = self.log.max_offset
            pos = 0
            while pos < len(data):
                h = bf.verify_batch(mv, pos, path="replication stream")
                invariant(h.base_offset == expected + pos,
                          f"replicated batch claims offset {h.base_offset}, expected {expected + pos}")
                headers.append(h)
                pos += h.batch_bytes
            if not headers:
                return expected
            failpoint("replication_before_append")
            self.log.append([[data]])
            pos = 0
            for h in headers:
                if h.epoch > self.epochs.current:
                    self.epochs.start(h.epoch, h.base_offset)
                self._tail_apply(h, mv[pos : pos + h.batch_bytes])
                pos += h.batch_bytes
            end = self.log.max_offset
        self._notify_appended()
        with self._cond:
            self._flush_wanted = True
            self._cond.notify_all()
        return end

    def truncate_to(self, offset: int) -> None:
        """Cut the unconfirmed tail at ``offset`` (a batch boundary) after a divergence (DESIGN §4)."""
        with self._append_lock:
            if offset >= self.log.max_offset:
                return
            applied = max(v.applied_offset for v in self.views)
            if offset < applied:
                raise BrokerError(
                    "FAILED_PRECONDITION",
                    f"divergence at {offset} is below offset {applied} that the views applied: "
                    "this node must re-bootstrap (unclean)",
                )
            failpoint("replication_before_truncate")
            self.log.truncate(offset)
            self.epochs.truncate(offset)
            with self._cond:
                self.flushed_offset = min(self.flushed_offset, offset)
            self.rebuild_tail()
            log.warning("log_truncated", offset=offset, reason="divergence from the master")

    # -- writes -----------------------------------------------------------------------------------
    def begin_close(self) -> None:
        """Stop taking writes and wake long-polls before the gRPC server drains its calls."""
        self.closing = True
        with self._cond:
            self._cond.notify_all()

    def check_writable(self) -> None:
        if self.closing:
            raise BrokerError("UNAVAILABLE", "the broker is shutting down; retry against it or another node")
        if self.fenced_reason:
            raise BrokerError("FAILED_PRECONDITION", f"this node is fenced: {self.fenced_reason}")
        if self.role != "master":
            raise BrokerError("FAILED_PRECONDITION", f"this node is a slave; send writes to the master at "
                              f"{self.master_address or '(unknown)'}", metadata=(("tidemark-master", self.master_address),))
        free = self.free_bytes()
        if free < self.config["storage.min_free_bytes"]:
            raise BrokerError(
                "RESOURCE_EXHAUSTED",
                f"free disk space {free} bytes is below storage.min_free_bytes "
                f"({self.config['storage.min_free_bytes']}); writes resume when space returns",
            )

    def free_bytes(self) -> int:
        now = time.monotonic()
        if now - self._free_checked_at > 0.1:
            st = os.statvfs(self.data_dir)
            self._free_bytes = st.f_bavail * st.f_frsize
            self._free_checked_at = now
            metrics.FREE_DISK.set(self._free_bytes)
        return self._free_bytes

    def validate(self, batch: IncomingBatch, *, internal: bool = False) -> list[int]:
        """Check a batch before the append lock; return its record positions."""
        if batch.timer_target is not None:
            return self._validate_delayed(batch)
        if batch.topic.startswith(system_records.SYSTEM_PREFIX):
            if not internal:
                raise invalid(f"topic {batch.topic!r} is a reserved system topic")
            queues = 1
        else:
            info = self.metadata.topic(batch.topic)
            if info is None:
                raise not_found(f"unknown topic {batch.topic!r}")
            queues = info["queues"]
        if not 0 <= batch.queue_id < queues:
            raise invalid(f"queue {batch.queue_id} out of range: topic {batch.topic!r} has {queues} queues")
        if batch.record_count <= 0:
            raise invalid("a batch must hold at least one record")
        if crc32c.crc32c(batch.records) != batch.body_crc:
            raise invalid(f"batch for {batch.topic}/{batch.queue_id}: records checksum mismatch")
        try:
            positions = bf.record_positions(batch.records, batch.record_count)
        except ValueError as exc:
            raise invalid(f"batch for {batch.topic}/{batch.queue_id}: {exc}") from None
        if batch.base_sequence < bf.NO_SEQUENCE or batch.base_sequence > 0x7FFFFFFF:
            raise invalid(f"base_sequence {batch.base_sequence} out of range")
        return positions

    def _validate_delayed(self, batch: IncomingBatch) -> list[int]:
        """A delayed batch: valid for its target queue, then every record a scheduled record."""
        topic, queue_id = batch.timer_target or ("", 0)
        if batch.topic != system_records.TIMER_TOPIC or batch.queue_id != 0:
            raise invalid("a delayed batch is stored in __timer queue 0")
        positions = self.validate(IncomingBatch(topic, queue_id, batch.records, batch.record_count, batch.body_crc,
                                                batch.producer_id, batch.base_sequence))
        try:
            timer_records.check_scheduled(batch.records, positions, topic, queue_id, int(time.time() * 1000),
                                          self.config["timer.max_delay_ms"])
        except timer_records.TimerRecordError as exc:
            raise invalid(f"delayed batch for {topic}/{queue_id}: {exc}") from None
        return positions

    def append(
        self, batches: list[IncomingBatch], *, internal: bool = False,
        topic_changes: list[tuple[str, dict[str, Any]]] | None = None,
    ) -> tuple[list[BatchReceipt], int]:
        """Validate and append; return receipts and the end offset the caller must wait for.

        ``topic_changes``: topic creations/deletions this (metadata) append carries; checked and
        applied to the append-side topic set under the append lock.
        """
        self.check_writable()
        for b in batches:
            self.validate(b, internal=internal)
        receipts: list[BatchReceipt] = []
        with self._append_lock:
            self.check_writable()
            for b in batches:  # the append side's own view of topics: deletes may not be applied yet
                name = b.timer_target[0] if b.timer_target else b.topic
                if not name.startswith(system_records.SYSTEM_PREFIX) and name not in self._tail_topics:
                    raise not_found(f"unknown topic {name!r}")
            self._check_topic_changes(topic_changes or [])
            offset = self.log.max_offset
            now = max(int(time.time() * 1000), self._last_store_time_ms)
            chunks: list[list[bytes]] = []
            queue_next: dict[tuple[str, int], int] = {}
            producers = self._tail_producers
            undo = producers.savepoint()  # sequences are recorded as we go, so a request sees its own batches
            wait_offset = 0
            for b in batches:
                verdict = producers.check(b.producer_id, b.topic, b.queue_id, b.base_sequence)
                if verdict.error:
                    producers.rollback(undo)
                    raise BrokerError("FAILED_PRECONDITION", verdict.error)
                if verdict.duplicate_of is not None:
                    _, count, dup_offset, dup_qoff = verdict.duplicate_of
                    receipts.append(BatchReceipt(dup_offset, dup_qoff, count, duplicate=True))
                    wait_offset = max(wait_offset, dup_offset + 1)
                    continue
                key = (b.topic, b.queue_id)
                qoff = queue_next.get(key, self._tail_queue_next.get(key, 0))
                topic_raw = b.topic.encode()
                size = bf.HEADER_BYTES + len(topic_raw) + len(b.records)
                head = bf.build_header(
                    batch_bytes=size, record_count=b.record_count, base_offset=offset, base_queue_offset=qoff,
                    store_time_ms=now, producer_id=b.producer_id, base_sequence=b.base_sequence, epoch=self.epoch,
                    queue_id=b.queue_id, topic_raw=topic_raw, body_crc=b.body_crc, flags=b.flags,
                )
                chunks.append([head, b.records])
                producers.record_batch(b.producer_id, b.topic, b.queue_id, b.base_sequence, b.record_count, offset, qoff)
                receipts.append(BatchReceipt(offset, qoff, b.record_count))
                queue_next[key] = qoff + b.record_count
                offset += size
            if chunks:
                start = self.log.max_offset
                try:
                    end = self.log.append(chunks)
                except (OSError, FsyncFailed) as exc:
                    producers.rollback(undo)
                    full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
                    if not full or self.log.max_offset != start:
                        # part of the request is in the log (or an fsync failed): the tail state no
                        # longer matches it. Restart; recovery derives the tail from the log itself.
                        log.critical("append_failed_partially", error=str(exc), start=start,
                                     now_at=self.log.max_offset)
                        os._exit(1)
                    self._free_checked_at = 0.0
                    raise BrokerError("RESOURCE_EXHAUSTED", f"disk full: {exc}") from None
                invariant(end == offset, f"log end {end} != expected {offset}")
                self._apply_topic_changes(topic_changes or [])
                self._tail_queue_next.update(queue_next)
                self._last_store_time_ms = now
                wait_offset = max(wait_offset, end)
        if wait_offset:
            self._notify_appended()
        return receipts, wait_offset

    def append_system(self, items: list[tuple[str, dict[str, object]]]) -> int:
        """Append metadata records (one batch) to ``__metadata``; return the batch end offset."""
        encoded = [system_records.encode(t, f) for t, f in items]
        records, _ = bf.encode_records([(body, key, b"") for key, body in encoded])
        batch = IncomingBatch(system_records.METADATA_TOPIC, 0, records, len(items), crc32c.crc32c(records))
        changes = [(t, f) for t, f in items if t in (system_records.TOPIC_CREATE, system_records.TOPIC_DELETE)]
        _, end = self.append([batch], internal=True, topic_changes=changes)
        return end

    def _check_topic_changes(self, changes: list[tuple[str, dict[str, Any]]]) -> None:
        for change, fields in changes:
            name = str(fields["topic"])
            if change == system_records.TOPIC_CREATE and name in self._tail_topics:
                raise BrokerError("ALREADY_EXISTS", f"topic {name!r} already exists")
            if change == system_records.TOPIC_DELETE and name not in self._tail_topics:
                raise not_found(f"unknown topic {name!r}")

    def _apply_topic_changes(self, changes: list[tuple[str, dict[str, Any]]]) -> None:
        """Created or deleted topics restart their queue offsets at 0; buffered offsets of a deleted one go."""
        for change, fields in changes:
            name = str(fields["topic"])
            for key in [k for k in self._tail_queue_next if k[0] == name]:
                del self._tail_queue_next[key]
            if change == system_records.TOPIC_CREATE:
                self._tail_topics.add(name)
            elif change == system_records.TOPIC_DELETE:
                self._tail_topics.discard(name)
                self.offsets.drop_topic(name)

    def wait_ack(self, offset: int, ack: str, timeout_ms: int) -> None:
        if ack == "leader" or offset == 0:
            return
        deadline = time.monotonic() + timeout_ms / 1000.0
        with self._cond:
            if ack == "flush":
                self._flush_wanted = True
                self._cond.notify_all()
                ok = self._cond.wait_for(lambda: self.flushed_offset >= offset, deadline - time.monotonic())
            else:
                self._flush_wanted = True
                self._cond.notify_all()
                need = self.config["replication.min_insync_replicas"] - 1  # replicas besides this node
                ok = self._cond.wait_for(
                    lambda: self.confirm_offset >= offset and self.replica_acked(offset) >= need,
                    deadline - time.monotonic(),
                )
        if not ok:
            raise BrokerError("DEADLINE_EXCEEDED", f"not acknowledged ({ack}) within {timeout_ms} ms; the records may still be stored")

    def check_replica_ack_possible(self) -> None:
        if self.config["replication.min_insync_replicas"] > 1 + self.insync_replicas():
            raise BrokerError(
                "UNAVAILABLE",
                f"ack=replica needs {self.config['replication.min_insync_replicas']} in-sync replicas "
                f"(replication.min_insync_replicas); {1 + self.insync_replicas()} available",
            )

    def insync_replicas(self) -> int:
        """In-sync replicas besides this node (replication replaces this)."""
        return self.insync_source()

    # -- group commit -----------------------------------------------------------------------------
    def _sync_log(self) -> None:
        t0 = time.perf_counter()
        try:
            target = self.log.sync()
        except OSError as exc:  # after a failed fsync the page cache can no longer be trusted
            log.critical("fsync_failed", error=str(exc))
            os._exit(1)
        metrics.FSYNC_SECONDS.observe(time.perf_counter() - t0)
        with self._cond:
            if target > self.flushed_offset:
                self.flushed_offset = target
                self._advance_confirm()
            self._cond.notify_all()

    def _advance_confirm(self) -> None:
        confirm = min(self.confirm_source(self.flushed_offset), self.flushed_offset)
        self.confirm_offset = max(self.confirm_offset, confirm)

    def advance_confirm(self) -> None:
        """Recompute the confirm offset (replication calls this when a replica acknowledges)."""
        with self._cond:
            self._advance_confirm()
            self._cond.notify_all()

    def _flush_loop(self) -> None:
        interval_s = self.config["commitlog.flush_interval_ms"] / 1000.0
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._flush_wanted or self._stop.is_set(), interval_s)
                self._flush_wanted = False
            if self.log.max_offset > self.flushed_offset:
                self._sync_log()
            elif self.confirm_offset < self.flushed_offset:  # a replica may have left the in-sync set
                self.advance_confirm()
            metrics.OFFSET.labels("max").set(self.log.max_offset)
            metrics.OFFSET.labels("confirm").set(self.confirm_offset)

    # -- dispatcher -------------------------------------------------------------------------------
    def iter_batches(self, start: int, end: int) -> BatchIterator:
        return BatchIterator(self.log, start, end)

    def apply_until(self, end: int) -> None:
        """Apply every view up to ``end`` (each from its own applied offset)."""
        start = min(v.applied_offset for v in self.views)
        if start >= end:
            return
        views = self.views
        for header, batch in self.iter_batches(start, end):
            for v in views:
                if header.base_offset >= v.applied_offset:
                    v.apply(header, batch)
        for v in views:
            if v.applied_offset < end:
                v.end_round(end)
        with self._cond:
            self.applied_offset = min(v.applied_offset for v in self.views)
            self._cond.notify_all()

    def _dispatch_loop(self) -> None:
        self._last_ckpt = self._last_retention = time.monotonic()
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self.confirm_offset > self.applied_offset or self._stop.is_set(), 0.05)
                target = self.confirm_offset
            if self._stop.is_set():
                break
            with self.views_lock:
                self._dispatch_round(target)

    def _dispatch_round(self, target: int) -> None:
        """One round: apply up to ``target``, checkpoint and enforce retention when due."""
        if target > self.applied_offset:
            self.apply_until(target)
        for v in self.views:
            metrics.VIEW_LAG.labels(v.name).set(self.confirm_offset - v.applied_offset)
        now = time.monotonic()
        if now - self._last_ckpt >= self.config["checkpoint.interval_ms"] / 1000.0:
            # also once more after the views went idle, so the previous checkpoint (the .bak that
            # recovery may fall back to, and so the retention floor) catches up as well
            if any(self._checkpointed.get(v.name) != v.applied_offset
                   or self._checkpointed_prev.get(v.name) != v.applied_offset for v in self.views):
                try:
                    self.checkpoint_views()
                except (OSError, lmdb.Error) as exc:  # the previous checkpoint stays valid: retry later
                    log.warning("checkpoint_failed", error=str(exc))
            elif self.timer_view.snapshot_due():  # the wheel snapshot is on its own clock, idle log or not
                try:
                    self.timer_view.checkpoint()
                except OSError as exc:
                    log.warning("timer_snapshot_failed", error=str(exc))
            self._last_ckpt = now
        if now - self._last_retention >= self.config["retention.check_interval_ms"] / 1000.0:
            try:
                self.enforce_retention()
            except OSError as exc:  # retention can wait; the dispatcher must not die
                log.warning("retention_failed", error=str(exc))
            self._last_retention = now
        DEFERRED.reap()

    def checkpoint_views(self) -> None:
        failpoint("views_before_checkpoint")
        for v in self.views:
            v.checkpoint()
            self._checkpointed_prev[v.name] = self._checkpointed.get(v.name, 0)
            self._checkpointed[v.name] = v.applied_offset
        hold = self.timer_view.body_hold()  # the bodies of pending timers stay (locally, or in tiered storage)
        if hold is None:
            self.retention_holds.pop(TIMER_BODIES_HOLD, None)
        else:
            self.retention_holds[TIMER_BODIES_HOLD] = hold
        failpoint("views_after_checkpoint")

    # -- retention --------------------------------------------------------------------------------
    def retention_floor(self) -> int:
        """Lowest offset some view may still replay from (or a snapshot is streaming): nothing at or above it may go."""
        if len(self._checkpointed_prev) < len(self.views):
            return 0
        floors = [*self._checkpointed_prev.values(), *self.retention_holds.values(), self.timer_view.recovery_floor(),
                  *(floor() for floor in self.retention_floors)]
        return min(floors)

    def enforce_retention(self) -> list[str]:
        local_bytes = self.config["retention.local_bytes"]
        local_ms = self.config["retention.local_ms"]
        if not local_bytes and not local_ms:
            return []
        floor = self.retention_floor()
        segs = self.log.segments
        total = sum(s.size_bytes for s in segs)
        cut = 0
        now = time.time()
        for seg in segs[:-1]:
            too_big = bool(local_bytes) and total > local_bytes
            too_old = bool(local_ms) and (now - os.path.getmtime(seg.path)) * 1000 > local_ms
            if not (too_big or too_old) or seg.end_offset > floor:
                break
            cut = seg.end_offset
            total -= seg.size_bytes
        removed = self.log.delete_segments_below(cut) if cut else []
        for path in removed:
            log.info("segment_deleted", path=path, reason="retention")
        metrics.SEGMENTS.set(len(self.log.segments))
        return removed

    # -- reads ------------------------------------------------------------------------------------
    def _queue_file(self, topic: str, queue_id: int):  # type: ignore[no-untyped-def]
        if not topic.startswith(system_records.SYSTEM_PREFIX) and self.metadata.topic(topic) is None:
            raise not_found(f"unknown topic {topic!r}")
        qf = self.consume_queues.queue(topic, queue_id)
        if qf is None:
            if topic in system_records.SYSTEM_TOPICS or self.metadata.topic(topic) is not None:
                raise invalid(f"queue {queue_id} out of range for topic {topic!r}")
            raise not_found(f"unknown topic {topic!r}")
        return qf

    def queue_bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        """(min readable queue offset, next queue offset) below the confirm offset."""
        qf = self._queue_file(topic, queue_id)
        log_min = self.readable_min_offset()
        i = qf.first_at_commit(log_min) if log_min else 0
        low = qf.entry(i).base_queue_offset if i < qf.entries else qf.next_queue_offset
        return low, qf.next_queue_offset

    def pull(self, topic: str, queue_id: int, offset: int, max_messages: int, max_bytes: int, max_wait_ms: int) -> PullResult:
        if offset < 0:
            raise invalid(f"offset {offset} is negative")
        if max_messages <= 0:
            raise invalid("max_messages must be positive")
        qf = self._queue_file(topic, queue_id)
        if offset >= qf.next_queue_offset and max_wait_ms > 0:
            deadline = time.monotonic() + max_wait_ms / 1000.0
            with self._cond:
                self._cond.wait_for(
                    lambda: qf.next_queue_offset > offset or self.closing or self._stop.is_set(),
                    max(0.0, deadline - time.monotonic()),
                )
        low, high = self.queue_bounds(topic, queue_id)
        if offset > high:
            raise BrokerError("OUT_OF_RANGE", f"offset {offset} is beyond the end of {topic}/{queue_id} ({high})")
        if offset < low:
            raise BrokerError("OUT_OF_RANGE", f"offset {offset} of {topic}/{queue_id} was removed by retention; earliest is {low}")
        if offset == high:
            return PullResult([], 0, 0, offset, low, high)
        index = qf.locate(offset)
        entries: list[Entry] = []
        wanted = offset + max_messages
        byte_total = 0
        while index < qf.entries:
            chunk = qf.entries_from(index, PULL_ENTRIES_PER_READ)
            if not chunk:
                break
            for e in chunk:
                if entries and byte_total + e.batch_bytes > max_bytes:
                    break
                entries.append(e)
                byte_total += e.batch_bytes
                if e.base_queue_offset + e.record_count >= wanted or byte_total >= max_bytes:
                    break
            else:
                index += len(chunk)
                continue
            break
        batches = self._read_batches(entries)
        skip = offset - entries[0].base_queue_offset
        available = entries[-1].base_queue_offset + entries[-1].record_count - offset
        count = min(max_messages, available)
        metrics.PULL_MESSAGES.inc(count)
        metrics.PULL_BYTES.inc(byte_total)
        return PullResult(batches, skip, count, offset + count, low, high)

    def _read_batches(self, entries: list[Entry]) -> list[bytes]:
        """Read the entries' batches: each run of adjacent batches is one pread and one blob."""
        out: list[bytes] = []
        i = 0
        while i < len(entries):
            start = entries[i].commit_offset
            end = start + entries[i].batch_bytes
            j = i + 1
            while j < len(entries) and entries[j].commit_offset == end:
                end += entries[j].batch_bytes
                j += 1
            data = self._read_log(start, end - start)
            if len(data) != end - start:
                raise BrokerError("OUT_OF_RANGE", f"log range {start}..{end} is no longer stored locally")
            out.append(data)
            i = j
        return out

    def readable_min_offset(self) -> int:
        """Lowest commit offset a read can reach: the local log start, or lower through tiered storage."""
        local = self.log.min_offset
        if self.cold_reader is None or local == 0:
            return local
        return min(local, self.cold_reader.min_offset())

    def _read_log(self, start: int, length: int) -> bytes:
        """Log bytes [start, start + length); the part below the local log start comes from the cold reader."""
        for _ in range(2):  # retention may delete a segment between the check and the read: look again
            local_min = self.log.min_offset
            if start >= local_min or self.cold_reader is None:
                data = self.log.read(start, length)
            else:
                cold_len = min(length, local_min - start)
                data = self.cold_reader.read(start, cold_len)
                if len(data) == cold_len < length:
                    data += self.log.read(local_min, length - cold_len)
            if len(data) == length or self.cold_reader is None:
                return data
        return data

    def offset_for_time(self, topic: str, queue_id: int, timestamp_ms: int) -> int:
        qf = self._queue_file(topic, queue_id)
        i = qf.first_at_time(timestamp_ms)
        if i >= qf.entries:
            return qf.next_queue_offset
        low, _ = self.queue_bounds(topic, queue_id)
        return max(low, qf.entry(i).base_queue_offset)

    def wait_view_applied(self, view: View, offset: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: view.applied_offset >= offset or self._stop.is_set(), timeout_s)

    def appended_queue_end(self, topic: str, queue_id: int) -> int:
        """Next queue offset the append side will assign (counts appended, unconfirmed batches)."""
        with self._append_lock:
            return self._tail_queue_next.get((topic, queue_id), 0)

    def queue_exists(self, topic: str, queue_id: int) -> bool:
        """Whether a queue takes appends now (the append side's view of topics)."""
        info = self.metadata.topic(topic)
        return topic in self._tail_topics and info is not None and 0 <= queue_id < info["queues"]

    def is_scheduled_record(self, offset: int) -> bool:
        """Whether ``offset`` is the start of a scheduled record in ``__timer`` (still stored)."""
        qf = self.consume_queues.queue(system_records.TIMER_TOPIC, 0)
        if qf is None or offset < self.log.min_offset:
            return False
        i = qf.first_at_commit(offset + 1) - 1
        if i < 0 or i >= qf.entries:
            return False
        e = qf.entry(i)
        data = self.log.read(e.commit_offset, e.batch_bytes)
        header = bf.decode_header(data, 0)
        if timer_records.is_event_batch(memoryview(data), header):
            return False
        return any(e.commit_offset + pos == offset for pos, _, _, _ in bf.iter_records(memoryview(data), header))

    def wait_applied(self, offset: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.metadata.applied_offset >= offset or self._stop.is_set(), timeout_s)

    # -- metadata operations ----------------------------------------------------------------------
    def _write_offsets(self, entries: list[tuple[str, str, int, int]]) -> None:
        end = self.append_system([(system_records.OFFSETS_COMMIT, {"offsets": [list(e) for e in entries]})])
        if not self.wait_applied(end, self.config["limits.send_timeout_ms"] / 1000.0):
            raise BrokerError("DEADLINE_EXCEEDED", "consumer offsets written but not applied in time")

    def status(self) -> dict[str, object]:
        segs = self.log.segments
        st: dict[str, object] = {
            "role": self.role,
            "epoch": self.epoch,
            "min_offset": self.log.min_offset,
            "max_offset": self.log.max_offset,
            "flushed_offset": self.flushed_offset,
            "confirm_offset": self.confirm_offset,
            "applied_offset": self.applied_offset,
            "replicas": [],
            "tiered_uploaded_offset": 0,
            "timer_pending": sum(self.metadata.timer_pending().values()),
            "timer_pending_by_topic": self.metadata.timer_pending(),
            "timer_wheel": {"pending": self.timer_view.wheel.pending, "loaded_from": self.timer_view.loaded_from,
                            "index_bytes": self.timer_view.index.memory_bytes()},
            "segments": len(segs),
            "log_bytes": sum(s.size_bytes for s in segs),
            "free_disk_bytes": self.free_bytes(),
            "fenced": self.fenced_reason,
            "views": {v.name: v.applied_offset for v in self.views},
            "retention_floor": self.retention_floor(),
            "recovery": self.recovery_report,
            "master": self.master_address,
            "epochs": self.epochs.snapshot(),
            "node_id": self.identity.node_id,
            "cluster_id": self.identity.cluster_id,
        }
        for provide in self.status_providers:
            provide(st)
        return st

    def quarantine_dir(self) -> str:
        path = os.path.join(self.data_dir, "quarantine")
        os.makedirs(path, exist_ok=True)
        return path



def _fatal_on_error(target: Callable[[], None], name: str) -> Callable[[], None]:
    """A dead flusher or dispatcher would stall every ack silently: exit, and let recovery run."""

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            log.critical("thread_failed", thread=name, error=f"{type(exc).__name__}: {exc}")
            os._exit(1)

    return run


class BatchIterator:
    """Yield (header, batch memoryview) for whole batches in [start, end), reading in big chunks."""

    def __init__(self, log_: CommitLog, start: int, end: int) -> None:
        self.log = log_
        self.start = start
        self.end = end

    def __iter__(self):  # type: ignore[no-untyped-def]
        pos = self.start
        while pos < self.end:
            data = self.log.read(pos, min(self.end - pos, READ_CHUNK_BYTES))
            mv = memoryview(data)
            i = 0
            while i + bf.HEADER_BYTES <= len(data):
                size = bf.peek_batch_bytes(mv, i)
                if size < bf.HEADER_BYTES:
                    break
                if i + size > len(data):
                    if i == 0:  # a batch larger than the chunk: read exactly it
                        data = self.log.read(pos, size)
                        mv = memoryview(data)
                        continue
                    break
                header = bf.decode_header(mv, i, path=self.log.directory)
                invariant(header.base_offset == pos + i, f"batch at {pos + i} claims offset {header.base_offset}")
                yield header, mv[i : i + size]
                i += size
            invariant(i > 0, f"no whole batch readable at offset {pos}")
            pos += i
