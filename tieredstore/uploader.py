"""The uploader: runs on the master only and uploads confirmed log ranges as objects (DESIGN §6).

Loop: find the break point from the object store (``resume``) → whenever at least
``object_bytes`` are confirmed past it, or ``upload_interval_ms`` passed, read whole batches
[B, E) from the local log with E <= confirm offset, verify them, check the invariant
``E <= confirm offset`` once more right before the put, put one object (conditional create),
then append a ``tiered.uploaded`` record so the slave learns the progress. B = E.

Resume: list the objects; walk back from the newest while an object disagrees with our log
(bytes beyond our log end, a CRC that differs from our bytes, or an epoch our history does not
have at its end): such an object was written by a master whose history lost (an unclean
failover); it is moved to ``quarantine/`` (copied, then deleted), never silently overwritten.
The break point is the end of the newest object that agrees. An object uploaded but not yet
recorded (the master died in between) is recorded now.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import crc32c
import structlog

from broker import clock
from broker.config import Config
from broker.errors import BrokerError
from broker.invariant import CorruptionError, InvariantError, invariant
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.logformat.scan import batch_boundary
from broker.storage.failpoints import failpoint
from broker.store import Store
from broker.threads import NamedThread, name_pool_thread
from tieredstore import metrics
from tieredstore.backend import Backend, BackendError, ObjectExists
from tieredstore.index import ObjectIndex
from tieredstore.objects import QUARANTINE_PREFIX, Described, TieredObject, describe, run_end, runs, whole_batches
from tieredstore.retention import plan_deletions

log = structlog.get_logger("tieredstore.uploader")
IDLE_WAIT_S = 0.05
ERROR_BACKOFF_S_MAX = 5.0
RESUME_APPLY_WAIT_S = 5.0


class Uploader:
    def __init__(self, store: Store, backend: Backend, index: ObjectIndex, config: Config) -> None:
        self.store = store
        self.backend = backend
        self.index = index
        self.object_bytes = config["tieredstore.object_bytes"]
        self.interval_s = config["tieredstore.upload_interval_ms"] / 1000.0
        self.retention_ms = config["tieredstore.retention_ms"]
        self.retention_every_s = config["retention.check_interval_ms"] / 1000.0
        self.uploaded_offset = 0  # every byte below it is in the object store (as this node knows)
        self.break_point: int | None = None  # None: resume from the object store first
        self.last_error = ""
        self.gaps: list[tuple[int, int]] = []
        self._last_upload_s = time.monotonic()
        self._last_retention_s = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bufs = [bytearray(0), bytearray(0)]  # read buffers: one being put, one being prefetched
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tier-prefetch", initializer=name_pool_thread)
        self._next: tuple[int, Future[tuple[memoryview, Described] | None]] | None = None

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self.break_point = None
        self._thread = NamedThread(target=self._run, name="tiered-uploader", daemon=True)
        self._thread.start()
        log.info("uploader_started")

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(60)
        self._thread = None

    def close(self) -> None:
        self.stop()
        self._pool.shutdown(wait=True)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _active(self) -> bool:
        return not self._stop.is_set() and self.store.role == "master" and not self.store.fenced_reason

    def _run(self) -> None:
        backoff_s = 0.1
        while self._active():
            try:
                if self.break_point is None:
                    self.break_point = self.resume()
                uploaded = self.upload_once()
                self._maybe_retention()
                backoff_s = 0.1
                self.last_error = ""
                self.store.incidents.clear("tiered_uploader")
                if not uploaded:
                    self._stop.wait(IDLE_WAIT_S)
            except InvariantError as exc:  # a bug: never upload past it; say so loudly and stop
                self.last_error = f"stopped: {exc}"
                log.critical("tiered_uploader_invariant", error=str(exc))
                self.store.incidents.record("tiered_uploader", self.last_error)
                return
            except (BackendError, CorruptionError, BrokerError, OSError) as exc:
                op = exc.op if isinstance(exc, BackendError) else type(exc).__name__
                metrics.BACKEND_ERRORS.labels(op).inc()
                self.last_error = str(exc)
                log.warning("tiered_upload_failed", error=str(exc), retry_in_s=backoff_s)
                self.store.incidents.record("tiered_uploader", self.last_error)
                self.break_point = None  # look at the object store again before the next put
                self._stop.wait(backoff_s)
                backoff_s = min(ERROR_BACKOFF_S_MAX, backoff_s * 2)
        log.info("uploader_stopped", uploaded_offset=self.uploaded_offset)

    # -- the break point ------------------------------------------------------------------------
    def resume(self) -> int:
        """Find the break point from the object store itself; record progress the log lacks."""
        store = self.store
        # progress records already in our log must be applied before we compare with them (a new
        # master confirms its whole log at once; this waits for its views, boundedly)
        store.wait_metadata_applied(store.log.max_offset, RESUME_APPLY_WAIT_S)
        clean_tmp = getattr(self.backend, "clean_tmp", None)
        if clean_tmp is not None:
            clean_tmp()
        ensure_bucket = getattr(self.backend, "ensure_bucket", None)
        if ensure_bucket is not None:
            ensure_bucket()
        objs = self.index.refresh()
        while objs:
            why = self._disagrees(objs[-1])
            if not why:
                break
            self._quarantine(objs.pop(), why)
        if objs:
            last = objs[-1]
            point = last.end
            self.gaps = [(run_end(a), b[0].start) for a, b in itertools.pairwise(runs(objs))]
            if self.gaps:
                log.warning("tiered_gaps", gaps=self.gaps[:10])
        else:
            last = None
            point = max(store.log.min_offset, store.views.metadata.tiered_uploaded_offset)
        self.uploaded_offset = point
        metrics.UPLOADED_OFFSET.set(point)
        if last is not None and point > store.views.metadata.tiered_uploaded_offset:
            self._record(last, resumed=True)
        log.info("uploader_resumed", break_point=point, objects=len(objs), recorded=store.views.metadata.tiered_uploaded_offset)
        return point

    def _disagrees(self, obj: TieredObject) -> str:
        """Why ``obj`` is not part of our history ("" when it is, as far as we can tell)."""
        store = self.store
        if obj.end > store.log.max_offset:
            return f"it ends at {obj.end}, beyond our log end {store.log.max_offset}"
        if obj.start >= store.log.min_offset:
            data = store.log.read(obj.start, obj.size_bytes)
            if len(data) == obj.size_bytes and crc32c.crc32c(data) == obj.crc:
                return ""
            return "its bytes differ from our log"
        ours = _epoch_at(store.epochs.snapshot(), obj.end - 1)
        if ours is not None and ours != obj.epoch:
            return f"its last batch has epoch {obj.epoch}, our history has epoch {ours} there"
        return ""

    def _quarantine(self, obj: TieredObject, why: str) -> None:
        data = self.backend.get(obj.key)
        head = self.backend.head(obj.key)
        with contextlib.suppress(ObjectExists):
            self.backend.put(QUARANTINE_PREFIX + obj.key, data, head.metadata if head else {})
        self.backend.delete(obj.key)
        self.index.remove(obj)
        log.warning("tiered_object_quarantined", key=obj.key, reason=why, moved_to=QUARANTINE_PREFIX + obj.key)

    # -- uploads --------------------------------------------------------------------------------
    def upload_once(self) -> bool:
        """Upload the next object when one is due; True when one was uploaded."""
        store = self.store
        point = self.break_point
        assert point is not None
        confirm = store.watermarks.confirm_offset
        metrics.UPLOAD_LAG.set(max(0, confirm - self.uploaded_offset))
        pending = confirm - point
        if pending <= 0:
            return False
        if pending < self.object_bytes and time.monotonic() - self._last_upload_s < self.interval_s:
            return False
        if point < store.log.min_offset:
            raise BrokerError("DATA_LOSS", f"the break point {point} is below the local log start {store.log.min_offset}: "
                              "that range is neither uploaded nor stored here")
        prepared = self._take_prefetched(point)
        if prepared is None:
            prepared = self._prepare(point, min(pending, self.object_bytes), 0)
            if prepared is None:
                return False
            body, described = prepared
            if point + body.nbytes >= confirm and _single_progress_record(body):
                # never upload just the record of our last upload at the end of the log: that would
                # feed itself forever (when more follows that did not fit, as a batch longer than
                # an object, the record goes alone)
                return False
        body, described = prepared
        obj = described.obj
        # the invariant, checked right before the put: only confirmed bytes, only as the master
        invariant(obj.end <= store.watermarks.confirm_offset,
                  f"tiered upload [{obj.start}, {obj.end}) passes the confirm offset {store.watermarks.confirm_offset}")
        invariant(store.role == "master" and not store.fenced_reason, "a tiered upload on a node that is not the master")
        self._check_no_newer(obj)
        self._prefetch(obj.end, 1 if body.obj is self._bufs[0] else 0)  # read the next object during the put
        failpoint("tiered_before_put")
        t0 = time.perf_counter()
        try:
            self.backend.put(obj.key, body, described.metadata(store.identity.node_id))
        except ObjectExists:
            self._same_object(obj)  # our own earlier put (a lost answer) or another master's identical one
        metrics.PUT_SECONDS.observe(time.perf_counter() - t0)
        failpoint("tiered_after_put")
        self.index.add(obj)
        self.break_point = self.uploaded_offset = obj.end
        self._last_upload_s = time.monotonic()
        metrics.UPLOADED_BYTES.inc(obj.size_bytes)
        metrics.UPLOADED_OBJECTS.inc()
        metrics.UPLOADED_OFFSET.set(obj.end)
        metrics.UPLOAD_LAG.set(max(0, store.watermarks.confirm_offset - obj.end))
        self._record(obj)
        failpoint("tiered_after_record")
        return True

    def _prepare(self, start: int, length: int, which: int) -> tuple[memoryview, Described] | None:
        """Read whole batches [start, <= start + length) into buffer ``which`` and verify them."""
        data = self._read(start, length, which)
        n = whole_batches(data, start, self.object_bytes)
        if n == 0:  # a batch longer than an object: it goes alone, whole, once it is all confirmed
            whole = batch_boundary(data, start, self.object_bytes)
            if len(data) < whole <= self.store.watermarks.confirm_offset - start:
                data = self._read(start, whole, which)
                n = whole_batches(data, start, self.object_bytes)
        if n == 0:
            return None
        body = data[:n]
        return body, describe(body, start)  # CRCs and offsets of every batch: nothing corrupt goes out

    def _prefetch(self, start: int, which: int) -> None:
        """While a put runs, read and verify the next object when a whole one is already confirmed."""
        if self.store.watermarks.confirm_offset - start < self.object_bytes:
            return
        self._next = (start, self._pool.submit(self._prepare, start, self.object_bytes, which))

    def _take_prefetched(self, point: int) -> tuple[memoryview, Described] | None:
        """The prefetched object starting at ``point``; a stale one is waited for (it writes a buffer) and dropped."""
        if self._next is None:
            return None
        start, future = self._next
        self._next = None
        try:
            prepared = future.result()
        except (CorruptionError, OSError):
            return None  # prepared again, in this thread, where the error is handled
        return prepared if start == point else None

    def _read(self, start: int, length: int, which: int) -> memoryview:
        """Log bytes [start, start + length) into reused buffer ``which`` (of two: one is being put
        while the other is filled; a fresh 64 MiB bytes object per object costs more in page faults
        than the copy itself)."""
        if len(self._bufs[which]) < length:
            self._bufs[which] = bytearray(length)
        buf = memoryview(self._bufs[which])
        pos = 0
        for seg in self.store.log.segments:
            at = start + pos
            if seg.end_offset <= at:
                continue
            if seg.start_offset > at or pos >= length:
                break
            want = min(length - pos, seg.end_offset - at)
            got = seg.readinto(buf[pos : pos + want], at - seg.start_offset)
            pos += got
            if got < want:
                break
        return buf[:pos]

    def _check_no_newer(self, obj: TieredObject) -> None:
        """Another master may have uploaded past our break point (a partition): never overlap it."""
        newer = [i for i in self.backend.list("log/", start_after=f"log/{obj.start:020d}") if i.key != obj.key]
        if newer:
            raise BackendError("list", f"objects at or after our break point {obj.start} exist already "
                               f"({newer[0].key}): resuming from the object store")

    def _same_object(self, obj: TieredObject) -> None:
        head = self.backend.head(obj.key)
        if head is None or head.size_bytes != obj.size_bytes or head.metadata.get("tm-crc32c") != f"{obj.crc:08x}":
            raise BackendError("put", f"{obj.key} exists with other contents")
        log.info("tiered_object_already_there", key=obj.key)

    def _record(self, obj: TieredObject, *, resumed: bool = False) -> None:
        fields: dict[str, Any] = {"start": obj.start, "end": obj.end, "epoch": obj.epoch, "crc32c": f"{obj.crc:08x}",
                                  "key": obj.key}
        if resumed:
            fields["resumed"] = True
        try:
            self.store.writes.write_system([(system_records.TIERED_UPLOADED, fields)], ack="leader")
        except BrokerError as exc:  # fenced, closing, disk full: the object store still holds the truth
            log.warning("tiered_record_failed", error=exc.message, end=obj.end)

    # -- retention ----------------------------------------------------------------------------------
    def _maybe_retention(self) -> None:
        now = time.monotonic()
        if not self.retention_ms or now - self._last_retention_s < self.retention_every_s:
            return
        self._last_retention_s = now
        self.enforce_retention()

    def enforce_retention(self) -> list[TieredObject]:
        doomed = plan_deletions(self.index.refresh(), clock.wall_s(), self.retention_ms, self.store.retention.read_floor())
        for obj in doomed:
            self.index.remove(obj)  # first: reads below it are refused before its bytes go
            self.backend.delete(obj.key)
            metrics.DELETED_OBJECTS.inc()
            log.info("tiered_object_deleted", key=obj.key, reason="tieredstore.retention_ms")
        return doomed


def _epoch_at(entries: list[tuple[int, int]], offset: int) -> int | None:
    """The epoch whose master wrote ``offset`` according to an epoch history."""
    found = None
    for epoch, start in entries:
        if start <= offset:
            found = epoch
    return found


def _single_progress_record(data: memoryview) -> bool:
    """True when ``data`` is one batch holding only ``tiered.uploaded`` records.

    Each upload appends one such batch. Uploading it alone would append the next one, forever;
    so a lone record at the end of what is confirmed waits for other data (followed by a batch
    too long to join it in one object, it goes alone). Several of them (a catch-up upload ran
    ahead of its records) are uploaded: that leaves one, and the loop stops there.
    """
    header = bf.decode_header(data, 0, check_crc=False)
    if header.batch_bytes != len(data) or header.topic != system_records.METADATA_TOPIC:
        return False
    key = system_records.TIERED_UPLOADED.encode()
    return all(bytes(k) == key for _, k, _, _ in bf.iter_records(data, header))
