"""The store: one commit log, its views, and the parts between them (DESIGN §1-2), wired here.

- ``recovery``: numbered passes that run before the store is built (``Store.open``);
- ``watermarks``: flushed / confirm / applied offsets, the flusher thread, ack waits;
- ``appender``: validation, appends (client, system, replicated), truncation, the tail state;
- ``dispatcher``: the thread that applies the log to the views and checkpoints them;
- ``retention``: which old segments may go;
- ``reads``: pulls, queue bounds, seek by time, reads below the local start;
- ``firing``: the master's timer-firing thread.

Plugins meet the store only through the ``register_…`` calls (``broker/ports.py``).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

import structlog

from broker import clock, metrics
from broker.config import Config
from broker.errors import BrokerError
from broker.logformat import system_records
from broker.ports import (
    IncomingBatch,
    Placement,
    RoleController,
    RoleListener,
    StatusProvider,
    TxnPeers,
)
from broker.storage.commitlog import CommitLog
from broker.storage.epochs import EpochHistory
from broker.storage.identity import Identity
from broker.store import recovery
from broker.store.appender import Appender
from broker.store.decisions import Decisions
from broker.store.disk import DiskSpace
from broker.store.dispatcher import Dispatcher
from broker.store.firing import TimerService
from broker.store.forwarding import TimerForwarder
from broker.store.incidents import Incidents
from broker.store.mastership import Mastership
from broker.store.metadata_fence import MetadataFence
from broker.store.offset_buffer import OffsetBuffer
from broker.store.permit import WritePermit
from broker.store.reads import Reads
from broker.store.retention import Retention
from broker.store.store_ports import StorePorts
from broker.store.viewset import ViewSet
from broker.store.watermarks import Watermarks
from broker.store.writes import WriteStep
from broker.threads import NamedThread

log = structlog.get_logger("store")


class Store(StorePorts, Mastership, MetadataFence):
    @classmethod
    def open(cls, config: Config, data_dir: str | None = None) -> Store:
        """Recover the data directory (``broker/store/recovery.py``), then build the store on it."""
        data_dir = data_dir or config["node.data_dir"]
        t0 = time.monotonic()
        os.makedirs(data_dir, mode=0o700, exist_ok=True)
        is_new = recovery.is_new_data_dir(data_dir)  # before any component creates files
        identity = recovery.load_identity(config, data_dir, is_new=is_new)  # pass 1, before LMDB or the log create files
        log_ = CommitLog(os.path.join(data_dir, "log"), config["commitlog.segment_bytes"],
                         cache_window_bytes=config["commitlog.cache_window_bytes"])
        views = ViewSet.open(config, data_dir, log_.min_offset)
        epochs = EpochHistory(data_dir)
        role = "slave" if config["node.role"] == "auto" else config["node.role"]  # auto: a slave until elected
        recovered = recovery.recover(data_dir, is_new=is_new, role=role, log_=log_, views=views,
                                     epochs=epochs)
        metrics.RECOVERY_SECONDS.set(time.monotonic() - t0)
        return cls(config, data_dir, identity, log_, views, epochs, recovered)

    def __init__(self, config: Config, data_dir: str, identity: Identity, log_: CommitLog, views: ViewSet,
                 epochs: EpochHistory, recovered: recovery.Recovered) -> None:
        self.config = config
        self.data_dir = data_dir
        self.identity = identity
        self.log = log_
        self.views = views
        self.epochs = epochs
        self.recovery_report = recovered.report
        self.role = "slave" if config["node.role"] == "auto" else config["node.role"]  # auto: until elected
        self.master_address = config["node.master"]  # the master a slave follows (its replication address)
        self.redirect_address = ""  # the master's *client* address, as its Welcome says: where writers go
        # set by an automatic-failover coordinator: the master this slave follows has fallen silent
        # (it may be gone; an election may follow), so refusals name no master rather than a dead one
        self.master_silent: Callable[[], bool] = lambda: False
        self.fenced_reason = ""
        self.permit = WritePermit()  # the coordinator's lease, when there is one (DESIGN §11)
        self.closing = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._role_listeners: list[RoleListener] = []
        self._status_providers: list[StatusProvider] = []
        self.role_controller: RoleController | None = None
        self.placement: Placement | None = None  # a cluster of shards (registered by replication)
        self.txn_peers: TxnPeers | None = None  # other shards' masters, for transactions over shards
        self.metadata_fence = 0  # set by a node taking office: see ``wait_metadata_fence``
        self.disk = DiskSpace(data_dir)
        self.incidents = Incidents()
        self.watermarks = Watermarks(config, log_, self._stop, lambda: self.role, flushed_offset=recovered.flushed_offset,
                                     confirm_offset=recovered.confirm_offset, applied_offset=recovered.applied_offset)
        self.offsets = OffsetBuffer(config["offsets.flush_interval_ms"], config["offsets.buffer_entries_max"],
                                    self._write_offsets, self.incidents.report_to("offsets"), self._offsets_gate)
        self.dispatcher = Dispatcher(config, log_, views, self.watermarks)
        self.appender = Appender(config, log_, epochs, views, recovered.tail, self.watermarks, self.disk,
                                 self.check_writable, self.offsets.drop_topic, views_lock=self.dispatcher.lock)
        self.writes = WriteStep(config, self.appender, self.watermarks, self.permit, self.lost_mastership,
                                self.check_still_master_after_append)
        self.retention = Retention(config, log_, views, self.dispatcher.checkpoint_floor)
        self.reads = Reads(log_, views, self.watermarks, lambda: self.closing)
        self.decisions = Decisions(self.appender, views, self.watermarks, self.dispatcher)
        self.timers = TimerService(config, views.timers, log_, self.appender, self.writes, self.dispatcher,
                                   self.reads, lambda: self.role, self.check_writable, self.incidents.report_to("timers"))
        self.timers.forwarder = TimerForwarder(self._append_forwarded, self.timers.forwarded,
                                               lambda: self.placement, lambda: self.txn_peers)
        self._role_listeners.append(self.timers.on_role)
        self._role_listeners.append(self.offsets.on_role)

    def _append_forwarded(self, batches: list[IncomingBatch]) -> None:
        self.writes.write(batches, "flush", internal=True, what="forwarded timers' events")

    # -- ports (broker/ports.py) -----------------------------------------------------------------











    # -- life cycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self.views.metadata.changes_log.enabled = True  # on every node, as its dispatcher applies them
        threads: list[tuple[Callable[[], None], str]] = [
            (self.watermarks.flush_loop, "flusher"),
            (lambda: self.dispatcher.loop([self.retention.maybe_enforce]), "dispatcher"),
        ]
        for target, name in threads:
            t = NamedThread(target=_fatal_on_error(target, name), name=name, daemon=True)
            t.start()
            self._threads.append(t)
        self.offsets.start()
        if self.role == "master":
            self.timers.start()

    def stop(self) -> None:
        """Graceful stop: flush offsets, fsync, apply and checkpoint every view, mark clean."""
        self.timers.stop()
        with contextlib.suppress(BrokerError):
            self.offsets.flush()
        self.offsets.stop()
        with self.appender.lock:
            self.watermarks.sync_log()
            self._stop_threads()
            self.dispatcher.apply_until(self.watermarks.confirm_offset)
            self.dispatcher.checkpoint_views()
            recovery.write_clean_marker(self.data_dir, self.log.max_offset)
        self.views.close()
        self.log.close()

    def crash_close(self) -> None:
        """Close files without a clean marker (tests of recovery inside one process)."""
        self.timers.stop()
        self._stop_threads()
        self.views.close()
        self.log.close()

    def _stop_threads(self) -> None:
        self._stop.set()
        self.watermarks.wake_all()
        for t in self._threads:
            t.join()

    def begin_close(self) -> None:
        """Stop taking writes and wake long-polls before the gRPC server drains its calls."""
        self.closing = True
        self.watermarks.wake_all()

    # -- role and fencing -------------------------------------------------------------------------









    # -- metadata ---------------------------------------------------------------------------------





    def _write_offsets(self, entries: list[tuple[str, str, int, int]]) -> None:
        self.writes.write_system([(system_records.OFFSETS_COMMIT, {"offsets": [list(e) for e in entries]})],
                                 applied=self.views.metadata)

    def _offsets_gate(self, groups: set[str]) -> None:
        if self.placement is not None:
            self.placement.check_groups_open(groups)

    def flush_offsets(self, timeout_s: float) -> None:
        """Write every buffered consumer offset now; return once the metadata view applied them (a
        group slot leaving this shard takes them along)."""
        self.offsets.commit([], wait_s=timeout_s)

    # -- status -----------------------------------------------------------------------------------
    def status(self) -> dict[str, object]:
        segs = self.log.segments
        wm = self.watermarks
        metadata, timers = self.views.metadata, self.views.timers
        st: dict[str, object] = {
            "role": self.role,
            "epoch": self.epoch,
            "min_offset": self.log.min_offset,
            "max_offset": self.log.max_offset,
            "flushed_offset": wm.flushed_offset,
            "confirm_offset": wm.confirm_offset,
            "applied_offset": wm.applied_offset,
            "replicas": [],
            "tiered_uploaded_offset": 0,
            "timer_pending": sum(metadata.timer_pending().values()),
            "timer_pending_by_topic": metadata.timer_pending(),
            "timer_wheel": {"pending": timers.wheel.pending, "loaded_from": timers.loaded_from,
                            "index_bytes": timers.index.memory_bytes()},
            "segments": len(segs),
            "log_bytes": sum(s.size_bytes for s in segs),
            "free_disk_bytes": self.disk.free_bytes(),
            "fenced": self.fenced_reason,
            "views": {v.name: v.applied_offset for v in self.views.all},
            "retention_floor": self.retention.local_floor(),
            "recovery": self.recovery_report,
            "errors": self.incidents.snapshot(),
            "master": self.master_address,
            "epochs": self.epochs.snapshot(),
            "node_id": self.identity.node_id,
            "cluster_id": self.identity.cluster_id,
            "transactions": self._transactions_status(),
        }
        for provide in self._status_providers:
            provide(st)
        return st

    def _transactions_status(self) -> dict[str, int]:
        summary = self.views.txns.summary()
        oldest = summary.pop("oldest_begun_ms")
        return {**summary, "oldest_open_ms": _oldest_ms(oldest)}


def _oldest_ms(begun_ms: int) -> int:
    return max(0, clock.wall_ms() - begun_ms) if begun_ms else 0


def _fatal_on_error(target: Callable[[], None], name: str) -> Callable[[], None]:
    """A dead flusher or dispatcher would stall every ack silently: exit, and let recovery run."""

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            log.critical("thread_failed", thread=name, error=f"{type(exc).__name__}: {exc}")
            os._exit(1)

    return run
