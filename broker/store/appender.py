"""The write side: validate batches, append them, and keep the tail state the next append needs.

Write path: validate (outside the lock: CRCs, record framing, topic and queue, delayed records) →
under the append lock check the producer sequences against the *tail* state, fill the headers
and write every batch of the request with one writev → the caller waits for its ack mode
(``Watermarks.wait_ack``). The tail state (next queue offsets, topics, producer sequences, the
last store time) includes batches that are appended but not yet confirmed, which the views have
not applied; recovery rebuilds it from the views plus the log above them (``TailState.rebuild``).

A slave appends the master's batches byte for byte (``append_replicated``) and cuts its
unconfirmed tail at a divergence point (``truncate_to``, a typed ``Truncation``).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c
import structlog

from broker import clock
from broker.config import Config
from broker.errors import MOVING, BrokerError, invalid, not_found, shown
from broker.invariant import invariant
from broker.logformat import batch as bf
from broker.logformat import system_records, txn_records
from broker.logformat import timer_props as timer_records
from broker.logformat.scan import Mode, scan, scan_bytes
from broker.ports import BatchReceipt, IncomingBatch, Truncation
from broker.storage.commitlog import CommitLog
from broker.storage.epochs import EpochHistory
from broker.storage.failpoints import failpoint
from broker.storage.quarantine import keep_log_range
from broker.storage.segment import FsyncFailed
from broker.store.disk import DiskSpace
from broker.store.viewset import ViewSet
from broker.store.waiters import OffsetWaiters
from broker.store.watermarks import Watermarks
from broker.views import ConsumeQueueView, ProducerStateView
from broker.views.producer_state import ProducerTable
from broker.views.transactions import TxnView

log = structlog.get_logger("store")
TopicChanges = list[tuple[str, dict[str, Any]]]


@dataclass
class TailState:
    """What the next append needs to know, including appended batches no view has applied yet."""

    queue_next: dict[tuple[str, int], int] = field(default_factory=dict)
    topics: set[str] = field(default_factory=set)
    sealed: dict[tuple[str, int], int] = field(default_factory=dict)  # queues a move sealed here -> their end
    producers: ProducerTable = field(default_factory=ProducerTable)
    last_store_time_ms: int = 0
    txn_open: dict[int, str] = field(default_factory=dict)  # open transactions: producer id -> transactional id
    txn_by_tid: dict[str, int] = field(default_factory=dict)  # the same, by transactional id (one open per id)
    # transactional id -> (producer id, epoch, begin id) of its latest begin, as the view's ``latest``:
    # the epoch counts its begins; a retried beginning call with that begin id joins that transaction
    txn_latest: OrderedDict[str, tuple[int, int, int]] = field(default_factory=OrderedDict)
    txn_messages: dict[int, int] = field(default_factory=dict)  # open transaction -> messages of its batches
    txn_counted: set[int] = field(default_factory=set)  # open transactions whose commit carries a count
    # over shards (docs/shards.md): open participant transactions -> the shard that decides them;
    # the prepared ones among them; open transactions with participants -> them (on the coordinator)
    txn_coordinated: dict[int, str] = field(default_factory=dict)
    txn_prepared: set[int] = field(default_factory=set)
    txn_parties: dict[int, list[txn_records.Party]] = field(default_factory=dict)
    txn_end: int = 0  # where the last ``__txn`` batch above what the transactions view applied ends

    @classmethod
    def rebuild(cls, log_: CommitLog, queues: ConsumeQueueView, producers: ProducerStateView, txns: TxnView,
                end: int | None = None) -> TailState:
        """From the views, plus every batch above what they applied up to ``end`` (the log's end).
        The views must hold still meanwhile: at start, or under the dispatcher's lock."""
        tail = cls()
        tail.queue_next, topics, tail.last_store_time_ms, tail.sealed = queues.tail_state()  # store times never go back
        tail.producers = producers.producers.copy()
        tail.topics = {t for t in topics if not t.startswith(system_records.SYSTEM_PREFIX)}
        open_now = txns.open_transactions()
        tail.txn_open = {t.pid: t.tid for t in open_now}
        tail.txn_by_tid = {tid: pid for pid, tid in tail.txn_open.items()}
        tail.txn_messages = {t.pid: t.messages for t in open_now}
        tail.txn_counted = {t.pid for t in open_now if t.counted}
        tail.txn_coordinated = {t.pid: t.coordinator for t in open_now if t.coordinator}
        tail.txn_prepared = {t.pid for t in open_now if t.prepared}
        tail.txn_parties = {t.pid: list(t.parties) for t in open_now if t.parties}
        tail.txn_latest = OrderedDict(txns.latest)
        start = min(queues.applied_offset, producers.applied_offset, txns.applied_offset)
        for header, batch in scan(log_.read, start, log_.max_offset if end is None else end, mode=Mode.STRICT,
                                  path=log_.directory):
            tail.apply(header, batch, queues=header.base_offset >= queues.applied_offset,
                       producers=header.base_offset >= producers.applied_offset,
                       txns=header.base_offset >= txns.applied_offset)
        return tail

    def apply(self, header: bf.BatchHeader, batch: memoryview, *, queues: bool = True, producers: bool = True,
              txns: bool = True) -> None:
        """Advance past one batch that is already in the log."""
        if txns and header.topic == txn_records.TXN_TOPIC:
            for rec in txn_records.records(header, batch):
                self.apply_txn(rec)
            self.txn_end = header.base_offset + header.batch_bytes
        elif txns and header.flags & bf.FLAG_TRANSACTIONAL:
            self.count_txn_messages(header.producer_id, header.record_count)
        changes = [system_records.decode(k, b) for _, k, _, b in bf.iter_records(batch, header)
                   if bytes(k) in system_records.TOPIC_CHANGE_KEYS] if header.topic == system_records.METADATA_TOPIC else []
        if queues:
            self.queue_next[(header.topic, header.queue_id)] = header.next_queue_offset
            if changes:
                self.apply_topic_changes(changes)
        if producers:
            self.producers.record(header)
            self.seed_producers(changes, header.base_offset)
        self.last_store_time_ms = max(self.last_store_time_ms, header.store_time_ms)

    def count_txn_messages(self, pid: int, count: int) -> None:
        if pid in self.txn_messages:  # a batch of a transaction not open is never visible: not counted
            self.txn_messages[pid] += count

    def apply_txn(self, rec: txn_records.Record) -> None:
        if isinstance(rec, txn_records.Begin):
            self.txn_open[rec.pid] = rec.tid
            self.txn_by_tid[rec.tid] = rec.pid
            self.txn_messages[rec.pid] = 0
            if rec.counted:
                self.txn_counted.add(rec.pid)
            if rec.coordinator:
                self.txn_coordinated[rec.pid] = rec.coordinator
            self.txn_latest[rec.tid] = (rec.pid, rec.epoch, rec.begin_id)
            self.txn_latest.move_to_end(rec.tid)
            if len(self.txn_latest) > txn_records.TIDS_MAX:  # oldest first; an open one's is kept (as the view's)
                for tid in [t for t in self.txn_latest if t not in self.txn_by_tid]:
                    if len(self.txn_latest) <= txn_records.TIDS_MAX:
                        break
                    del self.txn_latest[tid]
        elif isinstance(rec, txn_records.End):
            self.txn_messages.pop(rec.pid, None)
            self.txn_counted.discard(rec.pid)
            self.txn_coordinated.pop(rec.pid, None)
            self.txn_prepared.discard(rec.pid)
            self.txn_parties.pop(rec.pid, None)
            if self.txn_open.pop(rec.pid, None) is not None and self.txn_by_tid.get(rec.tid) == rec.pid:
                del self.txn_by_tid[rec.tid]
        elif isinstance(rec, txn_records.Participant):
            if rec.pid in self.txn_open:
                self.txn_parties.setdefault(rec.pid, []).append(rec.party)
        elif isinstance(rec, txn_records.Prepare) and rec.pid in self.txn_open:
            self.txn_prepared.add(rec.pid)

    def seed_producers(self, changes: TopicChanges, at: int) -> None:
        """A queue that moved here starts with its producers' last batches from its previous shard
        (``at``: the offset of the batch that started it)."""
        for change, fields in changes:
            if change == system_records.QUEUE_START:
                self.producers.seed(str(fields["topic"]), int(fields["queue"]), fields.get("producers", []), at)

    def apply_topic_changes(self, changes: TopicChanges) -> list[str]:
        """Created or deleted topics restart their queue offsets at 0; a sealed queue takes no write
        until a start lifts the seal and moves its next offset on. Return the deleted topics."""
        deleted: list[str] = []
        for change, fields in changes:
            name = str(fields["topic"])
            if change in (system_records.QUEUE_SEAL, system_records.QUEUE_START):
                key = (name, int(fields["queue"]))
                if change == system_records.QUEUE_SEAL:
                    self.sealed[key] = int(fields["end"])
                else:
                    self.sealed.pop(key, None)
                    self.queue_next[key] = max(self.queue_next.get(key, 0), int(fields["start"]))
                continue
            # a name that is not a topic now has no queue offsets: its delete forgot them
            if change == system_records.TOPIC_DELETE or name in self.topics:
                for q in range(system_records.QUEUES_MAX):  # not a scan of every queue: 100,000 of them cost ms
                    self.queue_next.pop((name, q), None)
                    self.sealed.pop((name, q), None)
            if change == system_records.TOPIC_CREATE:
                self.topics.add(name)
            elif change == system_records.TOPIC_DELETE:
                self.topics.discard(name)
                deleted.append(name)
        return deleted


# __txn records (key, body) decided under the append lock from the tail and where their batch lands
TxnBuild = Callable[[TailState, int], list[tuple[bytes, bytes]]]
TxnRecords = list[txn_records.Record]


@dataclass
class TxnAppend:
    """What ``Appender.append_in_txn`` did."""

    pid: int  # the transaction's producer id
    begun: TxnRecords  # its begin's records ([]: not begun here, or joined by a retry)
    receipts: list[BatchReceipt]
    ended: TxnRecords  # its end's records
    wait_offset: int  # where the appended records end
    not_open: bool = False  # the transaction had ended: nothing appended


class Appender:
    def __init__(self, config: Config, log_: CommitLog, epochs: EpochHistory, views: ViewSet, tail: TailState,
                 watermarks: Watermarks, disk: DiskSpace, check_writable: Callable[[], None],
                 on_topic_deleted: Callable[[str], None], views_lock: threading.Lock | None = None) -> None:
        """``views_lock``: held while the dispatcher applies the views (a truncation rebuilds the
        tail from them under it)."""
        self.config = config
        self.log = log_
        self.epochs = epochs
        self.metadata = views.metadata
        self.views = views
        self.tail = tail
        self.watermarks = watermarks
        self.disk = disk
        self.check_writable = check_writable
        self.on_topic_deleted = on_topic_deleted
        self.lock = threading.Lock()  # one append (or truncation) at a time
        self.views_lock = views_lock or threading.Lock()
        self._appended = OffsetWaiters()  # released after every append (replication senders wait here)
        self._stop = watermarks.stop

    # -- validation -----------------------------------------------------------------------------
    def validate(self, batch: IncomingBatch, *, internal: bool = False) -> None:
        """Check a batch before the append lock."""
        if batch.timer_target is not None:
            self._validate_delayed(batch)
        else:
            self._validate_plain(batch, internal=internal)

    def _validate_plain(self, batch: IncomingBatch, *, internal: bool = False, leading_reserved: int = 0) -> None:
        """Topic, queue, count, CRC, records and sequence of a batch. A client's records must decode
        for every reader (``check_records``: UTF-8 keys and properties, no ``__`` names past the
        first ``leading_reserved``); the node's own writers are checked for framing only."""
        if batch.topic.startswith(system_records.SYSTEM_PREFIX):
            if not internal:
                raise invalid(f"topic {shown(batch.topic)} is a reserved system topic")
            queues = 1
        else:
            info = self.metadata.topic(batch.topic)
            if info is None:
                raise not_found(f"unknown topic {shown(batch.topic)}")
            queues = info["queues"]
            if not internal and batch.topic.endswith(system_records.DLQ_SUFFIX):
                raise invalid(f"topic {shown(batch.topic)} is the dead-letter topic of pop group "
                              f"{shown(batch.topic[:-len(system_records.DLQ_SUFFIX)])}: it takes only that group's "
                              "dead letters")
        if not 0 <= batch.queue_id < queues:
            raise invalid(f"queue {batch.queue_id} out of range: topic {shown(batch.topic)} has {queues} queues")
        if batch.record_count <= 0:
            raise invalid("a batch must hold at least one record")
        if crc32c.crc32c(batch.records) != batch.body_crc:
            raise invalid(f"batch for {batch.topic}/{batch.queue_id}: records checksum mismatch")
        try:
            if internal:
                bf.check_framing(batch.records, batch.record_count)
            else:
                bf.check_records(batch.records, batch.record_count, leading_reserved)
        except ValueError as exc:
            raise invalid(f"batch for {batch.topic}/{batch.queue_id}: {exc}") from None
        if batch.base_sequence < bf.NO_SEQUENCE or batch.base_sequence > 0x7FFFFFFF:
            raise invalid(f"base_sequence {batch.base_sequence} out of range")

    def _validate_delayed(self, batch: IncomingBatch) -> None:
        """A delayed batch: valid for its target queue, then every record a scheduled record."""
        topic, queue_id = batch.timer_target or ("", 0)
        if batch.topic != system_records.TIMER_TOPIC or batch.queue_id != 0:
            raise invalid("a delayed batch is stored in __timer queue 0")
        self._validate_plain(IncomingBatch(topic, queue_id, batch.records, batch.record_count, batch.body_crc,
                                           batch.producer_id, batch.base_sequence),
                             leading_reserved=timer_records.SCHEDULED_LEADING_PROPS)
        try:
            timer_records.check_scheduled_batch(batch.records, batch.record_count, topic, queue_id, clock.wall_ms(),
                                                self.config["timer.max_delay_ms"])
        except timer_records.TimerRecordError as exc:
            raise invalid(f"delayed batch for {topic}/{queue_id}: {exc}") from None

    # -- appends ----------------------------------------------------------------------------------
    def append(self, batches: list[IncomingBatch], *, internal: bool = False,
               topic_changes: TopicChanges | None = None, not_before_ms: int = 0) -> tuple[list[BatchReceipt], int]:
        """Validate and append; return receipts and the end offset the caller must wait for.

        ``topic_changes``: topic creations/deletions this (metadata) append carries; checked and
        applied to the tail's topic set under the append lock.
        ``not_before_ms``: the lowest store time the batches may carry. Timer deliveries pass their
        latest due time: the firing thread read the clock when it found them due, and a clock
        stepped back since (NTP) must not stamp them earlier than that.
        """
        self.check_writable()
        for b in batches:
            self.validate(b, internal=internal)
        with self.lock:
            receipts, wait_offset = self._append_locked(batches, topic_changes, not_before_ms)
        if wait_offset:
            self._notify_appended()
        return receipts, wait_offset

    def append_in_txn(self, batches: list[IncomingBatch], *, begin: TxnBuild | None = None,
                      rejoin: Callable[[TailState], int | None] | None = None,
                      end: Callable[[int], TxnBuild] | None = None) -> TxnAppend:
        """A transaction's send with its begin, its end, or both, in one hold of the append lock:
        ``begin``'s ``__txn`` records first (as ``append_txn``: a transaction begun by its first
        send; the batches then take its producer id), the batches, then ``end(pid)``'s (a send that
        commits: decided after the batches, so a count covers them). ``rejoin(tail)``: the
        transaction a retried beginning call's first attempt began, if it did: joined instead of
        begun. A transaction that is no longer open when a committing or rejoining call reaches
        the lock appends nothing (``not_open``: the caller answers how it ended). A send refused
        for its topics appends nothing; one refused after a begin (a full disk) leaves the
        transaction open and empty, to its timeout; after a refused send no end is appended."""
        self.check_writable()
        for b in batches:
            self.validate(b)
        with self.lock:
            self.check_writable()
            tail = self.tail
            joined = rejoin(tail) if begin is not None and rejoin is not None else None
            pid = joined if joined is not None else (0 if begin is not None else batches[0].producer_id)
            if pid and (joined is not None or end is not None) and pid not in tail.txn_open:
                return TxnAppend(pid, [], [], [], 0, not_open=True)
            self._check_topics(batches)
            begun: TxnRecords = []
            ended: TxnRecords = []
            try:
                if begin is not None and joined is None:
                    begun, _ = self._append_txn_locked(begin, checked=True)
                    pid = begun[-1].pid
                if begin is not None:
                    for b in batches:
                        b.producer_id = pid
                        b.flags |= bf.FLAG_TRANSACTIONAL
                # checked once above for the whole call: the end is not refused after its batches
                receipts, wait_offset = self._append_locked(batches, None, 0, checked=True)
                if end is not None:
                    ended, end_offset = self._append_txn_locked(end(pid), checked=True)
                    wait_offset = max(wait_offset, end_offset)
            finally:
                self._notify_appended()
        return TxnAppend(pid, begun, receipts, ended, wait_offset)

    def _check_topics(self, batches: list[IncomingBatch]) -> None:
        """Under the append lock: each batch's topic exists (the append side's own view of topics:
        deletes may not be applied yet), and a transaction's batch joins an open transaction."""
        tail = self.tail
        for b in batches:
            name = b.timer_target[0] if b.timer_target else b.topic
            if not name.startswith(system_records.SYSTEM_PREFIX) and name not in tail.topics:
                raise not_found(f"unknown topic {shown(name)}")
            if tail.sealed:
                self._check_unsealed(name, b.timer_target[1] if b.timer_target else b.queue_id)
            if b.flags & bf.FLAG_TRANSACTIONAL:
                self.check_txn_open(b.producer_id)

    def _check_unsealed(self, topic: str, queue: int) -> None:
        end = self.tail.sealed.get((topic, queue))
        if end is not None:
            raise BrokerError("UNAVAILABLE", f"queue {queue} of topic {shown(topic)} is sealed at offset {end} on this "
                              "shard: it is moving to another shard (docs/shards.md); nothing of this send was stored, "
                              "retry (the routes name the new owner once the move is done)", metadata=MOVING)

    def seal_queue(self, topic: str, queue: int) -> tuple[int, int]:
        """Seal ``queue`` of ``topic`` here (a move, docs/shards.md): a ``queue.seal`` record whose end
        is the queue's next offset at this instant of the log's order, so every write accepted before
        it is inside the sealed segment and every write after it is refused. Already sealed: its
        record is not written again. Returns (the queue's end, the offset the log must be confirmed to
        for everything of the sealed segment to be)."""
        self.check_writable()
        with self.lock:
            self.check_writable()
            key = (topic, queue)
            if key in self.tail.sealed:
                return self.tail.sealed[key], self.log.max_offset
            item = (system_records.QUEUE_SEAL, {"topic": topic, "queue": queue, "end": self.tail.queue_next.get(key, 0)})
            records, _ = bf.encode_records([(body, k, b"") for k, body in [system_records.encode(*item)]])
            batch = IncomingBatch(system_records.METADATA_TOPIC, 0, records, 1, crc32c.crc32c(records))
            self.validate(batch, internal=True)
            _, end = self._append_locked([batch], [item], 0, checked=True)
            sealed_at = self.tail.sealed[key]
        self._notify_appended()
        return sealed_at, end

    def txn_owner(self, pid: int) -> str | None:
        """The transactional id of open transaction ``pid`` (None: not open). A read without the
        append lock: a producer id's transactional id never changes, and the append decides."""
        return self.tail.txn_open.get(pid)

    def check_txn_open(self, pid: int) -> None:
        """Transaction ``pid`` is open here (under the append lock: at this instant in the log's order)."""
        if pid not in self.tail.txn_open:
            raise BrokerError("FAILED_PRECONDITION", f"transaction {pid:#x} is not open: it ended (committed, "
                              "aborted, timed out, or fenced by a newer instance of its transactional id), or its "
                              "begin was lost with a failed master; nothing of this send was stored")
        if pid in self.tail.txn_prepared:
            raise BrokerError("FAILED_PRECONDITION", f"transaction {pid:#x} is prepared (a participant of a "
                              "transaction over shards whose commit began): it takes no more messages; nothing of "
                              "this send was stored")

    def _append_locked(self, batches: list[IncomingBatch], topic_changes: TopicChanges | None,
                       not_before_ms: int, *, checked: bool = False,
                       written: list[list[bytes | memoryview]] | None = None) -> tuple[list[BatchReceipt], int]:
        """``append`` under the append lock, the batches validated (``checked``: and the node found
        writable earlier in this hold of the lock, for a call of several appends). ``written``: gets
        each stored batch's pieces (header, records), for a caller that reads them back."""
        receipts: list[BatchReceipt] = []
        tail = self.tail
        if not checked:
            self.check_writable()
        self._check_topics(batches)
        self._check_topic_changes(topic_changes or [])
        offset = first = self.log.max_offset
        now = max(clock.wall_ms(), tail.last_store_time_ms, not_before_ms)
        chunks: list[list[bytes | memoryview]] = []
        queue_next: dict[tuple[str, int], int] = {}
        producers = tail.producers
        undo = producers.savepoint()  # sequences are recorded as we go, so a request sees its own batches
        wait_offset = 0
        counted: list[tuple[int, int]] = []  # transactions' batches: (producer id, messages)
        for b in batches:
            forwarded = bool(b.flags & bf.FLAG_FORWARDED)
            verdict = producers.check(b.producer_id, b.topic, b.queue_id, b.base_sequence, forwarded)
            if verdict.error:
                producers.rollback(undo)
                raise BrokerError("FAILED_PRECONDITION", verdict.error)
            if verdict.duplicate_of is not None:
                _, count, dup_offset, dup_qoff = verdict.duplicate_of
                receipts.append(BatchReceipt(dup_offset, dup_qoff, count, duplicate=True))
                wait_offset = max(wait_offset, dup_offset + 1)
                continue
            key = (b.topic, b.queue_id)
            qoff = queue_next.get(key, tail.queue_next.get(key, 0))
            topic_raw = b.topic.encode()
            size = bf.HEADER_BYTES + len(topic_raw) + len(b.records)
            head = bf.build_header(
                batch_bytes=size, record_count=b.record_count, base_offset=offset, base_queue_offset=qoff,
                store_time_ms=now, producer_id=b.producer_id, base_sequence=b.base_sequence,
                epoch=self.epochs.current, queue_id=b.queue_id, topic_raw=topic_raw, body_crc=b.body_crc,
                flags=b.flags,
            )
            chunks.append([head, b.records])
            if b.flags & bf.FLAG_TRANSACTIONAL:
                counted.append((b.producer_id, b.record_count))
            producers.record_batch(b.producer_id, b.topic, b.queue_id, b.base_sequence, b.record_count, offset, qoff,
                                   forwarded=forwarded)
            receipts.append(BatchReceipt(offset, qoff, b.record_count))
            queue_next[key] = qoff + b.record_count
            offset += size
        if chunks:
            end = self._write(chunks, undo)
            invariant(end == offset, f"log end {end} != expected {offset}")
            if written is not None:
                written += chunks
            for name in tail.apply_topic_changes(topic_changes or []):
                self.on_topic_deleted(name)
            tail.seed_producers(topic_changes or [], first)
            tail.queue_next.update(queue_next)
            tail.last_store_time_ms = now
            for pid, count in counted:
                tail.count_txn_messages(pid, count)
            wait_offset = max(wait_offset, end)
        return receipts, wait_offset

    def _write(self, chunks: list[list[bytes | memoryview]], undo: Any) -> int:
        start = self.log.max_offset
        try:
            return self.log.append(chunks)
        except (OSError, FsyncFailed) as exc:
            self.tail.producers.rollback(undo)
            full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            if not full or self.log.max_offset != start:
                # part of the request is in the log (or an fsync failed): the tail state no longer
                # matches it. Restart; recovery derives the tail from the log itself.
                log.critical("append_failed_partially", error=str(exc), start=start, now_at=self.log.max_offset)
                os._exit(1)
            self.disk.recheck()
            raise BrokerError("RESOURCE_EXHAUSTED", f"disk full: {exc}") from None

    def append_system(self, items: list[tuple[str, dict[str, object]]]) -> int:
        """Append metadata records (one batch) to ``__metadata``; return the batch end offset."""
        encoded = [system_records.encode(t, f) for t, f in items]
        records, _ = bf.encode_records([(body, key, b"") for key, body in encoded])
        batch = IncomingBatch(system_records.METADATA_TOPIC, 0, records, len(items), crc32c.crc32c(records))
        changes = [(t, f) for t, f in items if t in system_records.TOPIC_CHANGES]
        _, end = self.append([batch], internal=True, topic_changes=changes)
        return end

    def append_txn(self, build: TxnBuild) -> tuple[TxnRecords, int]:
        """Append ``__txn`` records (one batch) decided under the append lock: ``build(tail, offset)``
        returns them (key, body) from the transactions open now, the batch to land at ``offset``.
        Returns the records as the log now holds them (a begin's producer id known) and the batch end."""
        self.check_writable()
        with self.lock:
            self.check_writable()
            appended, end = self._append_txn_locked(build)
        if end:
            self._notify_appended()
        return appended, end

    def _append_txn_locked(self, build: TxnBuild, *, checked: bool = False) -> tuple[TxnRecords, int]:
        items = build(self.tail, self.log.max_offset)
        if not items:
            return [], 0
        records, _ = bf.encode_records([(body, key, b"") for key, body in items])
        batch = IncomingBatch(txn_records.TXN_TOPIC, 0, records, len(items), crc32c.crc32c(records))
        self.validate(batch, internal=True)
        written: list[list[bytes | memoryview]] = []
        self._append_locked([batch], None, 0, checked=checked, written=written)
        data = memoryview(b"".join(written[0]))  # the batch as the log now holds it, not read back
        header = bf.decode_header(data, 0)
        end = header.base_offset + header.batch_bytes
        appended = list(txn_records.records(header, data))
        for rec in appended:
            self.tail.apply_txn(rec)
        self.tail.txn_end = end
        return appended, end

    def _check_topic_changes(self, changes: TopicChanges) -> None:
        """Each change against the topics as the ones before it in the same batch leave them."""
        exists: dict[str, bool] = {}  # names this batch creates (True) or deletes (False)
        for change, fields in changes:
            name = str(fields["topic"])
            present = exists.get(name, name in self.tail.topics)
            if change in (system_records.QUEUE_SEAL, system_records.QUEUE_START):
                info = self.metadata.topic(name)
                if not present or info is None or not 0 <= int(fields["queue"]) < info["queues"]:
                    raise not_found(f"no queue {fields['queue']} of topic {shown(name)} to {change.split('.')[1]}")
                continue
            if change == system_records.TOPIC_CREATE and present:
                raise BrokerError("ALREADY_EXISTS", f"topic {shown(name)} already exists")
            if change == system_records.TOPIC_DELETE and not present:
                raise not_found(f"unknown topic {shown(name)}")
            exists[name] = change == system_records.TOPIC_CREATE

    # -- replicated writes (slave side) -------------------------------------------------------------
    def append_replicated(self, data: bytes) -> int:
        """Append raw batches shipped by the master, byte for byte; return the new log end.

        Every batch is verified (both CRCs, its offset) before anything is written: a bad chunk
        is refused whole (``CorruptionError``) and the stream restarts from our log end.
        """
        with self.lock:
            expected = self.log.max_offset
            batches = list(scan_bytes(data, expected, mode=Mode.STRICT, verify_body=True, path="replication stream"))
            if not batches:
                return expected
            failpoint("replication_before_append")
            self._write_replicated(data)
            invariant(self.log.max_offset == expected + len(data),
                      f"a replicated chunk of {len(data)} bytes at {expected} left the log ending at {self.log.max_offset}")
            for h, batch in batches:
                if h.epoch > self.epochs.current:
                    self.epochs.start(h.epoch, h.base_offset)
                self.tail.apply(h, batch)
            end = self.log.max_offset
        self._notify_appended()
        self.watermarks.want_flush()
        return end

    def _write_replicated(self, data: bytes) -> None:
        start = self.log.max_offset
        try:
            self.log.append([[data]])
        except (OSError, FsyncFailed) as exc:
            full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
            if not full or self.log.max_offset != start:  # as in ``_write``: only a clean refusal is survivable
                log.critical("replicated_append_failed", error=str(exc), start=start, now_at=self.log.max_offset)
                os._exit(1)
            self.disk.recheck()
            raise BrokerError("RESOURCE_EXHAUSTED", f"disk full: {exc}") from None

    def truncate_to(self, offset: int) -> Truncation:
        """Cut the unconfirmed tail at ``offset`` (a batch boundary) after a divergence (DESIGN §4)."""
        with self.lock:
            if offset >= self.log.max_offset:
                return Truncation.NOTHING
            # below what the views applied, or below what this node already confirmed (the dispatcher
            # may not have applied it yet): cutting there would take back confirmed records
            floor = max(self.views.applied_max(), self.watermarks.confirm_offset)
            if offset < floor:
                log.error("divergence_below_confirmed", offset=offset, confirmed=floor,
                          note="this node must re-bootstrap (unclean)")
                return Truncation.BELOW_APPLIED
            end = self.log.max_offset
            # the tail as it will be after the cut, first: from the views held still (the dispatcher may
            # be adding queue files), and the log up to the cut. If it cannot be built, nothing is cut
            # and the node re-bootstraps: a tail holding the cut batches' queue offsets and producer
            # sequences would answer a retried send as a duplicate of a batch that no longer exists
            try:
                with self.views_lock:
                    failpoint("truncate_before_tail")
                    tail = TailState.rebuild(self.log, self.views.queues, self.views.producers, self.views.txns, end=offset)
            except Exception as exc:
                log.error("truncation_tail_failed", offset=offset, error=f"{type(exc).__name__}: {exc}"[:300],
                          note="nothing cut; this node must re-bootstrap")
                return Truncation.BELOW_APPLIED
            # what is cut is kept first: after an unclean election it can hold acknowledged writes
            kept = keep_log_range(os.path.dirname(self.log.directory), self.log, offset, end, "diverged", ".log")
            failpoint("replication_before_truncate")
            self.log.truncate(offset)
            self.epochs.truncate(offset)
            self.watermarks.truncated(offset)
            self.tail = tail
            invariant(self.log.max_offset == offset, f"the log ends at {self.log.max_offset} after a cut at {offset}")
            log.warning("log_truncated", offset=offset, bytes=end - offset, kept_in=kept, reason="divergence from the master")
            return Truncation.CUT

    # -- the append side's view, for readers -------------------------------------------------------
    def txn_counted(self, pid: int) -> bool:
        """Whether open transaction ``pid``'s commit carries its count (read without the lock:
        a transaction that ends meanwhile has its send refused under it)."""
        return pid in self.tail.txn_counted

    def queue_end(self, topic: str, queue_id: int) -> int:
        """Next queue offset the append side will assign (counts appended, unconfirmed batches)."""
        with self.lock:
            return self.tail.queue_next.get((topic, queue_id), 0)

    def queue_end_hint(self, topic: str, queue_id: int) -> int:
        """``queue_end`` without the append lock (one dict read): for a coroutine on the event loop,
        which must not wait for an append in a pool thread; may be one append behind."""
        return self.tail.queue_next.get((topic, queue_id), 0)

    def queue_exists(self, topic: str, queue_id: int) -> bool:
        """Whether a queue takes appends now (the append side's view of topics)."""
        info = self.metadata.topic(topic)
        return topic in self.tail.topics and info is not None and 0 <= queue_id < info["queues"]

    def producers_of(self, topic: str, queue_id: int, most: int) -> list[list[int]]:
        """The last batch of the ``most`` latest producers of a queue (``ProducerTable.of_queue``)."""
        with self.lock:
            return self.tail.producers.of_queue(topic, queue_id, most)

    def sealed_queues(self) -> list[tuple[str, int]]:
        """The queues a move sealed here (a copy, read without the lock)."""
        return list(self.tail.sealed)

    def sealed_end(self, topic: str, queue_id: int) -> int | None:
        """Where a move sealed the queue here (None: not sealed); one dict read, no lock."""
        return self.tail.sealed.get((topic, queue_id))

    def queue_sealed(self, topic: str, queue_id: int) -> bool:
        """Whether a move sealed the queue here (one dict read, no lock: an append decides under it)."""
        return (topic, queue_id) in self.tail.sealed

    def wait_appended(self, offset: int, timeout_s: float) -> int:
        """Wait until the log grows past ``offset`` (or the timeout, or a stop); return the log end."""
        self._appended.wait(lambda: self.log.max_offset > offset or self._stop.is_set(), offset + 1, timeout_s)
        return self.log.max_offset

    async def wait_appended_async(self, offset: int, timeout_s: float) -> int:
        """``wait_appended`` for a coroutine on the server's event loop."""
        await self._appended.wait_async(lambda: self.log.max_offset > offset or self._stop.is_set(), offset + 1, timeout_s)
        return self.log.max_offset

    def _notify_appended(self) -> None:
        self._appended.wake(self.log.max_offset)

