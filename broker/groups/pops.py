"""Pop mode on the master (DESIGN §12): lease messages, end leases, move dead ones to the DLQ.

Every change is one ``__pop`` record per call (``broker/logformat/pop_records.py``), applied by
the pop view like any other view, so leases replicate, survive kill -9 and failover, and restart
is bounded by the view's checkpoint. The master decides under a per-group lock: it first waits
until the view has applied everything in the log (its own earlier records included), reads the
state, appends the record, and lets the next call in; the caller then waits until the record is
as durable as an ack=replica send and applied, and only then answers. So two calls of one group
never lease the same message, and an answered pop or ack is never undone by a failover.

A lease ends at its deadline; no record marks that: the next pop finds the message available
(the view keeps deadlines; see ``broker/views/pop_leases.py``) and leases it again with
``delivery_count + 1``, or, past ``groups.max_deliveries``, appends it to ``<group>.dlq`` in the
same request as the record that ends it. Acks name leases by receipt handle
(``broker/groups/receipts.py``); an ack whose lease already ended is refused per handle
(FAILED_PRECONDITION: the message is or will be delivered again).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np
import structlog

from broker import metrics
from broker.errors import BrokerError, invalid, not_found, shown
from broker.groups import receipts
from broker.logformat import batch as bf
from broker.logformat import pop_records as pr
from broker.logformat import system_records
from broker.ports import IncomingBatch
from broker.store import Store
from broker.views.pop_leases import ENDED, EXPIRED, NOT_LEASED, RETAGGED, PopQueue
from proto import tidemark_pb2 as pb

log = structlog.get_logger("groups.pop")
GROUP_LOCKS_MAX = 100_000
DLQ_SUFFIX = ".dlq"
ORIGIN_PROPS = ("dlq.topic", "dlq.queue", "dlq.offset", "dlq.deliveries")
FAILED_PRECONDITION = 9  # grpc.StatusCode.FAILED_PRECONDITION's value, per handle in Ack/Nack results
TWICE = 5  # beyond PopQueue.check's reasons: the same lease twice in one call
REASONS = {
    NOT_LEASED: "no lease: the message was acked, dead-lettered or never popped by this group",
    ENDED: "the lease ended: the message was acked",
    RETAGGED: "the lease ended: the message was nacked or delivered again (or the handle is not genuine)",
    EXPIRED: "the lease expired: the message will be delivered again",
    TWICE: "the same lease twice in one call",
}


@dataclass(slots=True)
class _Pick:
    """What one pop takes from one queue."""

    queue_id: int
    start: int | None  # the group's first pop of this queue: where its state starts
    offsets: np.ndarray  # to lease (sorted)
    counts: np.ndarray  # deliveries so far, per offset
    dead: np.ndarray
    gone: np.ndarray


def now_ms() -> int:
    return int(time.time() * 1000)


class PopService:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.config = store.config
        self.view = store.views.pops
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._rotation: dict[tuple[str, str], int] = {}

    @property
    def cluster(self) -> int:
        """The cluster handles belong to (read each time: a slave takes its master's cluster id)."""
        return receipts.cluster_hash(self.store.identity.cluster_id)

    # -- requests checks -------------------------------------------------------------------------
    def check_group(self, group: str) -> None:
        if not group or system_records.topic_name_error(group + DLQ_SUFFIX) is not None:
            raise invalid(f"invalid pop group name {shown(group)}: use 1-123 of [A-Za-z0-9._-], starting alphanumeric "
                          "(its dead letters go to the topic '<group>.dlq')")

    def topic_queues(self, topic: str) -> int:
        err = system_records.topic_name_error(topic)
        if err:
            raise invalid(err)
        info = self.store.views.metadata.topic(topic)
        if info is None:
            raise not_found(f"unknown topic {shown(topic)}")
        return int(info["queues"])

    def _check_duration(self, name: str, value_ms: int) -> int:
        top = self.config["groups.invisible_ms_max"]
        if not 0 < value_ms <= top:
            raise invalid(f"{name} {value_ms} ms out of range: 1..{top} (groups.invisible_ms_max)")
        return value_ms

    def _lock(self, group: str) -> threading.Lock:
        with self._locks_guard:
            lock = self._locks.get(group)
            if lock is None:
                if len(self._locks) >= GROUP_LOCKS_MAX:
                    self._locks = {g: lk for g, lk in self._locks.items() if lk.locked()}
                lock = self._locks[group] = threading.Lock()
            return lock

    def _settle(self) -> None:
        """Under the group lock: the view has applied every record in the log (ours included)."""
        self.store.check_writable()
        end = self.store.log.max_offset
        if not self.view.wait_applied(end, self.config["limits.send_timeout_ms"] / 1000.0):
            raise BrokerError("UNAVAILABLE", "pop state is not caught up with the log yet; retry")

    def _append(self, batches: list[IncomingBatch]) -> int:
        _, end = self.store.appender.append(batches, internal=True)
        return end

    def _durable(self, end: int) -> None:
        """As durable as an ack=replica send, then applied (the answer reflects the record)."""
        store = self.store
        timeout_ms = self.config["limits.send_timeout_ms"]
        store.watermarks.wait_ack(end, "replica", timeout_ms, give_up=store.lost_mastership)
        store.check_still_master_after_append()
        if not self.view.wait_applied(end, timeout_ms / 1000.0):
            raise BrokerError("DEADLINE_EXCEEDED", "the pop record is stored but not applied in time")

    # -- pop ---------------------------------------------------------------------------------------
    def pop(self, group: str, topic: str, max_messages: int, invisible_ms: int,
            start_earliest: bool) -> tuple[list[pb.PoppedMessage], int | None]:
        """Lease up to ``max_messages``; return them, or none and when the next lease ends (ms)."""
        self.check_group(group)
        queues = self.topic_queues(topic)
        self._check_duration("invisible_ms", invisible_ms)
        if max_messages <= 0:
            raise invalid("max_messages must be positive")
        max_messages = min(max_messages, self.config["groups.pop_messages_max"])
        with self._lock(group):
            self._settle()
            now = now_ms()
            picks, wake_ms = self._pick(group, topic, queues, max_messages, start_earliest, now)
            if not picks:
                return [], wake_ms
            tag = secrets.randbits(63) + 1
            until = now + invisible_ms
            epoch, cluster = self.store.epoch, self.cluster
            out: list[pb.PoppedMessage] = []
            dlq: list[tuple[bytes, bytes, bytes]] = []
            entries = []
            for p in picks:
                counts = dict(zip(p.offsets.tolist(), p.counts.tolist(), strict=True))
                prefix = receipts.lease_prefix(cluster, epoch, tag, p.queue_id)
                for msg in self._read(topic, p.queue_id, p.offsets):
                    msg.delivery_count = counts[msg.queue_offset] + 1
                    msg.receipt_handle = f"{prefix}.{msg.queue_offset:x}.{topic}"
                    out.append(msg)
                got = np.array(sorted(m.queue_offset for m in out if m.queue_id == p.queue_id), dtype=np.int64)
                gone = np.union1d(p.gone, np.setdiff1d(p.offsets, got))  # removed by retention meanwhile
                dead = np.setdiff1d(p.dead, gone)
                dlq += self._dead_letters(topic, p.queue_id, dead)
                entry: dict[str, object] = {"q": p.queue_id, "runs": pr.to_runs(got), "dead": pr.to_runs(dead),
                                            "gone": pr.to_runs(gone)}
                if p.start is not None:
                    entry["from"] = p.start
                entries.append(entry)
            batches = []
            if dlq:
                batches.append(self._dlq_batch(group, dlq))
            batches.append(_record_batch(pr.LEASE, {"g": group, "t": topic, "until": until, "tag": tag, "queues": entries}))
            end = self._append(batches)
        self._durable(end)
        redelivered = sum(1 for m in out if m.delivery_count > 1)
        if redelivered:
            metrics.POP_REDELIVERIES.inc(redelivered)
        if dlq:
            metrics.POP_DLQ.inc(len(dlq))
            log.info("pop_dead_letters", group=group, topic=topic, count=len(dlq))
        return out, None

    def _pick(self, group: str, topic: str, queues: int, max_messages: int, start_earliest: bool,
              now: int) -> tuple[list[_Pick], int | None]:
        max_deliveries = self.config["groups.max_deliveries"]
        window_max = self.config["groups.pop_window_max"]
        first = self._rotation.get((group, topic), 0)
        self._rotation[(group, topic)] = (first + 1) % queues
        if len(self._rotation) > GROUP_LOCKS_MAX:
            self._rotation.clear()
        picks: list[_Pick] = []
        left = max_messages
        wake: int | None = None
        with self.view.lock:
            for i in range(queues):
                q = (first + i) % queues
                low, high = self.store.reads.queue_bounds(topic, q)
                pq = self.view.queue(group, topic, q)
                start = None
                if pq is None:
                    start = low if start_earliest else high
                    pq = PopQueue(start)
                offs, counts = pq.available(now, left) if left > 0 else (np.empty(0, np.int64), np.empty(0, np.int64))
                gone = offs[offs < low]
                keep = offs >= low
                offs, counts = offs[keep], counts[keep]
                dead_mask = counts >= max_deliveries
                dead, offs, counts = offs[dead_mask], offs[~dead_mask], counts[~dead_mask]
                fresh_from = max(pq.cursor, low)
                n_fresh = max(0, min(left - len(offs), high - fresh_from, window_max - (fresh_from - pq.base)))
                if n_fresh:
                    offs = np.concatenate((offs, np.arange(fresh_from, fresh_from + n_fresh, dtype=np.int64)))
                    counts = np.concatenate((counts, np.zeros(n_fresh, dtype=np.int64)))
                if offs.size or dead.size or gone.size or start is not None:
                    picks.append(_Pick(q, start, offs, counts, dead, gone))
                    left -= int(offs.size)
                nxt = pq.next_visible_ms()
                if nxt is not None and nxt > now:
                    wake = nxt if wake is None else min(wake, nxt)
        return picks, wake

    def _read(self, topic: str, queue_id: int, offsets: np.ndarray) -> Iterator[pb.PoppedMessage]:
        """The records at ``offsets`` (sorted), read a run of adjacent offsets at a time."""
        pull_bytes = self.config["limits.pull_bytes_max"]
        for start, count in pr.to_runs(offsets):
            pos, end = start, start + count
            while pos < end:
                try:
                    r = self.store.reads.pull(topic, queue_id, pos, end - pos, pull_bytes, 0)
                except BrokerError as exc:
                    if exc.code != "OUT_OF_RANGE":
                        raise
                    break  # removed by retention: reported as gone
                if not r.count:
                    break
                taken = 0
                for header, batch in _batches(r.batches):
                    qoff = header.base_queue_offset
                    for rpos, _, _, _ in bf.iter_records(batch, header):
                        if pos <= qoff < end:
                            rec_end = rpos + 4 + bf.RECORD_HEAD.unpack_from(batch, rpos)[0]
                            yield pb.PoppedMessage(queue_id=queue_id, queue_offset=qoff, commit_offset=header.base_offset,
                                             store_time_ms=header.store_time_ms, record=bytes(batch[rpos:rec_end]))
                            taken += 1
                        qoff += 1
                pos = r.next_offset if taken else end

    def _dead_letters(self, topic: str, queue_id: int, dead: np.ndarray) -> list[tuple[bytes, bytes, bytes]]:
        """(body, key, props) of each dead message, its origin added to its properties."""
        if dead.size == 0:
            return []
        counts = self.config["groups.max_deliveries"]
        out = []
        for msg in self._read(topic, queue_id, dead):
            size, key_len, props_len = bf.RECORD_HEAD.unpack_from(msg.record, 0)
            k0 = bf.RECORD_HEAD_BYTES
            key = msg.record[k0 : k0 + key_len]
            props = bf.decode_props(msg.record[k0 + key_len : k0 + key_len + props_len]) if props_len else {}
            props.update(zip(ORIGIN_PROPS, (topic, str(queue_id), str(msg.queue_offset), str(counts)), strict=True))
            out.append((msg.record[k0 + key_len + props_len : 4 + size], key, bf.encode_props(props)))
        return out

    def _dlq_batch(self, group: str, items: list[tuple[bytes, bytes, bytes]]) -> IncomingBatch:
        name = group + DLQ_SUFFIX
        if self.store.views.metadata.topic(name) is None:
            self._create_dlq(name)
        records, _ = bf.encode_records(items)
        return IncomingBatch(name, 0, records, len(items), crc32c.crc32c(records))

    def _create_dlq(self, name: str) -> None:
        end = self.store.appender.append_system([(system_records.TOPIC_CREATE, {"topic": name, "queues": 1})])
        self._durable_metadata(end)
        log.info("dlq_topic_created", topic=name)

    def _durable_metadata(self, end: int) -> None:
        timeout_ms = self.config["limits.send_timeout_ms"]
        self.store.watermarks.wait_ack(end, "replica", timeout_ms, give_up=self.store.lost_mastership)
        if not self.store.wait_metadata_applied(end, timeout_ms / 1000.0):
            raise BrokerError("DEADLINE_EXCEEDED", "the DLQ topic is created but not applied in time")

    # -- ending leases -----------------------------------------------------------------------------
    def _resolve(self, group: str, handles: list[str]) -> list[receipts.Handle]:
        """Decode every handle; a malformed one, or one from another cluster or a future epoch,
        refuses the whole call (INVALID_ARGUMENT) before anything changes."""
        self.check_group(group)
        if not handles:
            raise invalid("no receipt handles")
        if len(handles) > self.config["groups.pop_messages_max"]:
            raise invalid(f"{len(handles)} receipt handles in one call; at most groups.pop_messages_max "
                          f"({self.config['groups.pop_messages_max']})")
        out = []
        cluster, epoch = self.cluster, self.store.epoch
        decoder = receipts.Decoder()
        for text in handles:
            try:
                h = decoder.decode(text)
            except ValueError as exc:
                raise invalid(f"receipt handle {shown(text)}: {exc}") from None
            if h.cluster != cluster:
                raise invalid(f"receipt handle {shown(text)} is from another cluster")
            if h.epoch > epoch:
                raise invalid(f"receipt handle {shown(text)} names epoch {h.epoch}, newer than this master's {epoch}")
            out.append(h)
        return out

    def _current(self, group: str, resolved: list[receipts.Handle], now: int) -> tuple[dict[tuple[str, int], np.ndarray],
                                                                                        list[tuple[int, str]]]:
        """Under the view lock: the offsets whose leases the handles still name, per (topic, queue),
        and (index, reason) for every other handle."""
        by_lease: dict[tuple[str, int, int], list[int]] = {}
        for i, h in enumerate(resolved):
            by_lease.setdefault((h.topic, h.queue_id, h.tag), []).append(i)
        ok: dict[tuple[str, int], list[np.ndarray]] = {}
        refused: list[tuple[int, str]] = []
        for (topic, q, tag), idxs in by_lease.items():
            offsets = np.fromiter((resolved[i].offset for i in idxs), dtype=np.int64, count=len(idxs))
            pq = self.view.queue(group, topic, q)
            reasons = pq.check(offsets, tag, now) if pq is not None else np.full(len(idxs), NOT_LEASED, np.int8)
            _, first = np.unique(offsets, return_index=True)
            repeated = np.ones(len(idxs), dtype=bool)
            repeated[first] = False
            reasons[(reasons == 0) & repeated] = TWICE
            refused += [(idxs[k], REASONS[int(reasons[k])]) for k in np.flatnonzero(reasons)]
            good = offsets[reasons == 0]
            if good.size:
                ok.setdefault((topic, q), []).append(good)
        return {k: np.unique(np.concatenate(v)) for k, v in ok.items()}, refused

    def _end(self, group: str, handles: list[str], kind: str, delay_ms: int = 0) -> list[tuple[str, int, str]]:
        """Ack (``pr.ACK``) or nack (``pr.NACK``) leases; return (handle, grpc code, reason) for each
        handle whose lease had ended already (the others are done)."""
        resolved = self._resolve(group, handles)
        with self._lock(group):
            self._settle()
            now = now_ms()
            with self.view.lock:
                ok, refused = self._current(group, resolved, now)
            if ok:
                items = [[t, q, pr.to_runs(offs)] for (t, q), offs in sorted(ok.items())]
                record: dict[str, object]
                if kind == pr.ACK:
                    record = {"g": group, "acks": items}
                else:
                    record = {"g": group, "nacks": items, "until": now + delay_ms}
                end = self._append([_record_batch(kind, record)])
        if ok:
            self._durable(end)
        return [(handles[i], FAILED_PRECONDITION, why) for i, why in refused]

    def ack(self, group: str, handles: list[str]) -> list[tuple[str, int, str]]:
        return self._end(group, handles, pr.ACK)

    def nack(self, group: str, handles: list[str], delay_ms: int) -> list[tuple[str, int, str]]:
        if delay_ms:
            self._check_duration("delay_ms", delay_ms)
        return self._end(group, handles, pr.NACK, delay_ms)

    def change_invisible(self, group: str, handle: str, invisible_ms: int) -> str:
        """Move one lease's deadline to now + ``invisible_ms``; return its new handle."""
        self._check_duration("invisible_ms", invisible_ms)
        (h,) = self._resolve(group, [handle])
        with self._lock(group):
            self._settle()
            now = now_ms()
            with self.view.lock:
                _, refused = self._current(group, [h], now)
            if refused:
                raise BrokerError("FAILED_PRECONDITION", refused[0][1])
            tag = secrets.randbits(63) + 1
            record = {"g": group, "t": h.topic, "q": h.queue_id, "o": h.offset, "until": now + invisible_ms, "tag": tag}
            end = self._append([_record_batch(pr.INVISIBLE, record)])
        self._durable(end)
        return receipts.encode(h._replace(epoch=self.store.epoch, tag=tag))

    # -- what describe shows (broker/daemon/group_admin.py PopState) --------------------------------
    def groups(self) -> set[str]:
        with self.view.lock:
            return set(self.view.groups)

    def describe(self, group: str) -> dict[str, Any]:
        with self.view.lock:
            g = self.view.groups.get(group)
            if g is None:
                return {"queues": {}, "dlq_messages": 0, "redeliveries": 0}
            queues = {}
            for (t, q), pq in g.queues.items():
                try:
                    _, high = self.store.reads.queue_bounds(t, q)
                except BrokerError:
                    high = pq.cursor
                in_flight = pq.in_flight()
                queues[(t, q)] = {"in_flight": in_flight, "pop_offset": pq.base,
                                  "lag": max(0, high - pq.cursor) + in_flight}
            return {"queues": queues, "dlq_messages": g.dlq, "redeliveries": g.redeliveries}

    def in_flight_total(self) -> int:
        return self.view.in_flight_total()


def _record_batch(kind: str, fields: dict[str, object]) -> IncomingBatch:
    key, body = system_records.encode(kind, fields)
    records, _ = bf.encode_records([(body, key, b"")])
    return IncomingBatch(pr.POP_TOPIC, 0, records, 1, crc32c.crc32c(records))


def _batches(runs: list[bytes]) -> Iterator[tuple[bf.BatchHeader, memoryview]]:
    """Each batch of runs of whole, adjacent batches (as reads return them)."""
    for run in runs:
        mv = memoryview(run)
        pos = 0
        while pos < len(mv):
            header = bf.decode_header(mv, pos, check_crc=False)
            yield header, mv[pos : pos + header.batch_bytes]
            pos += header.batch_bytes
