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

from broker import metrics
from broker.config import Config
from broker.errors import BrokerError
from broker.logformat import system_records
from broker.ports import (
    ColdReader,
    ConfirmRule,
    QueueListener,
    RetentionFloor,
    RoleController,
    RoleListener,
    StatusProvider,
)
from broker.storage import identity as identity_mod
from broker.storage.commitlog import CommitLog
from broker.storage.epochs import EpochHistory
from broker.storage.identity import Identity
from broker.store import recovery
from broker.store.appender import Appender
from broker.store.disk import DiskSpace
from broker.store.dispatcher import Dispatcher
from broker.store.firing import TimerService
from broker.store.incidents import Incidents
from broker.store.offset_buffer import OffsetBuffer
from broker.store.permit import WritePermit
from broker.store.reads import Reads
from broker.store.retention import Retention
from broker.store.viewset import ViewSet
from broker.store.watermarks import OUTCOME_UNKNOWN, Watermarks
from broker.store.writes import WriteStep
from broker.threads import NamedThread

log = structlog.get_logger("store")


class Store:
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
        self.metadata_fence = 0  # set by a node taking office: see ``wait_metadata_fence``
        self.disk = DiskSpace(data_dir)
        self.incidents = Incidents()
        self.watermarks = Watermarks(config, log_, self._stop, lambda: self.role, flushed_offset=recovered.flushed_offset,
                                     confirm_offset=recovered.confirm_offset, applied_offset=recovered.applied_offset)
        self.offsets = OffsetBuffer(config["offsets.flush_interval_ms"], config["offsets.buffer_entries_max"],
                                    self._write_offsets, self.incidents.report_to("offsets"))
        self.dispatcher = Dispatcher(config, log_, views, self.watermarks)
        self.appender = Appender(config, log_, epochs, views, recovered.tail, self.watermarks, self.disk,
                                 self.check_writable, self.offsets.drop_topic, views_lock=self.dispatcher.lock)
        self.writes = WriteStep(config, self.appender, self.watermarks, self.permit, self.lost_mastership,
                                self.check_still_master_after_append)
        self.retention = Retention(config, log_, views, self.dispatcher.checkpoint_floor)
        self.reads = Reads(log_, views, self.watermarks, lambda: self.closing)
        self.timers = TimerService(config, views.timers, log_, self.appender, self.writes, self.dispatcher,
                                   self.reads, lambda: self.role, self.check_writable, self.incidents.report_to("timers"))
        self._role_listeners.append(self.timers.on_role)
        self._role_listeners.append(self.offsets.on_role)

    # -- ports (broker/ports.py) -----------------------------------------------------------------
    def register_confirm_rule(self, rule: ConfirmRule) -> None:
        self.watermarks.register_rule(rule)

    def register_role_controller(self, controller: RoleController) -> None:
        self.role_controller = controller

    def register_role_listener(self, listener: RoleListener) -> None:
        self._role_listeners.append(listener)

    def register_status_provider(self, provider: StatusProvider) -> None:
        self._status_providers.append(provider)

    def register_cold_reader(self, reader: ColdReader) -> None:
        self.reads.register_cold_reader(reader)

    def register_retention_floor(self, floor: RetentionFloor) -> None:
        self.retention.register_floor(floor)

    def register_master_silence(self, silent: Callable[[], bool]) -> None:
        """An automatic-failover coordinator's word that the master this slave follows has fallen
        silent (an election may follow): refusals then name no master rather than a dead one."""
        self.master_silent = silent

    def set_redirect(self, client_address: str) -> None:
        """Where writers go: the master's client address as its Welcome or etcd says ("" unknown)."""
        self.redirect_address = client_address

    def adopt_cluster(self, cluster_id: str) -> None:
        """An empty slave takes its master's cluster id (``identity`` rewritten on disk)."""
        self.identity = identity_mod.adopt_cluster(self.data_dir, cluster_id)

    def raise_metadata_fence(self, offset: int) -> None:
        """A node taking office: no call reads the views before they applied up to ``offset``."""
        self.metadata_fence = max(self.metadata_fence, offset)

    def register_queue_listener(self, listener: QueueListener) -> None:
        """Told, after each dispatch round, which (topic, queue)s became readable further."""
        self.dispatcher.queue_listeners.append(listener)

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
    @property
    def epoch(self) -> int:
        return self.epochs.current

    def set_role(self, role: str, master_address: str = "") -> None:
        """Change role and tell the listeners. Becoming master (a new epoch) lifts a fence."""
        with self.appender.lock:
            self.role = role
            self.master_address = master_address
            self.redirect_address = ""
            if role == "master":
                self.fenced_reason = ""
                self.metadata_fence = self.watermarks.confirm_offset  # before any call sees a master
            else:  # a slave's views follow its new master's confirm offset, which a truncation may put lower
                self.metadata_fence = 0
        log.info("role_changed", role=role, epoch=self.epoch, master=master_address)
        for listener in self._role_listeners:
            listener(role)
        self.incidents.retire_ended(f"the loop ended when the node became {role}")  # after the listeners stopped theirs

    def writers_address(self) -> str:
        """Where a refused writer should go: the master's client address once known, else the
        address this node follows (the same unless replication has a port of its own); '' while
        that master is silent under a coordinator (the writer retries here or elsewhere: sent to
        a stopped master, it would wait for a connection that never comes)."""
        if self.master_silent():
            return ""
        return self.redirect_address or self.master_address

    def fence(self, reason: str) -> None:
        """Stop taking writes until a new epoch starts here (a higher epoch exists elsewhere)."""
        if not self.fenced_reason:
            self.fenced_reason = reason
            log.warning("fenced", reason=reason)

    def check_writable(self) -> None:
        if self.closing:
            raise BrokerError("UNAVAILABLE", "the broker is shutting down; retry against it or another node")
        self.check_still_master()
        self.check_free_space()

    def check_still_master(self) -> None:
        """Checked again just before a write is acknowledged: a node that stopped being master (or
        lost its write permit) while the write waited acknowledges nothing; the client retries on the
        master with the same producer sequence (stored once either way)."""
        if self.fenced_reason:
            raise BrokerError("FAILED_PRECONDITION", f"this node is fenced: {self.fenced_reason}",
                              metadata=(("tidemark-master", self.redirect_address),) if self.redirect_address else ())
        if self.role != "master":
            writers = self.writers_address()
            where = (f"send writes to the master at {writers}" if writers else
                     "its master is silent or unknown (an election may be under way): retry")
            raise BrokerError("FAILED_PRECONDITION", f"this node is a slave; {where}",
                              metadata=(("tidemark-master", writers),))
        self.permit.check(self.redirect_address)

    def check_still_master_after_append(self) -> None:
        """Just before an appended write is acknowledged: if this node stopped being the master (or
        lost its permit) meanwhile, the write is not acknowledged -- and it may be stored, so the
        refusal is UNAVAILABLE (outcome unknown), not a redirect that says "not executed"."""
        if self.lost_mastership():
            raise BrokerError("UNAVAILABLE", "this node stopped being the master before acknowledging the write: "
                              "outcome unknown (a retried send is stored once)", metadata=OUTCOME_UNKNOWN)

    def lost_mastership(self) -> bool:
        """No longer the master, or no longer allowed to acknowledge (a write waiting for its ack
        stops waiting; ``check_still_master`` then says why)."""
        return bool(self.fenced_reason) or self.role != "master" or not self.permit.valid()

    def check_free_space(self) -> None:
        """RESOURCE_EXHAUSTED below ``storage.min_free_bytes`` (client writes and replicated appends alike)."""
        free = self.disk.free_bytes()
        if free < self.config["storage.min_free_bytes"]:
            raise BrokerError(
                "RESOURCE_EXHAUSTED",
                f"free disk space {free} bytes is below storage.min_free_bytes "
                f"({self.config['storage.min_free_bytes']}); writes resume when space returns",
            )

    # -- metadata ---------------------------------------------------------------------------------
    def wait_metadata_applied(self, offset: int, timeout_s: float) -> bool:
        """Wait until the metadata view applied everything below ``offset`` (a write is visible)."""
        return self.dispatcher.wait_applied(self.views.metadata, offset, timeout_s)

    def wait_metadata_fence(self, timeout_s: float) -> None:
        """A read of the metadata view (topics, committed offsets, groups) on a node that took
        office moments ago waits until the view applied what was confirmed then
        (``metadata_fence``): a slave's views apply only what its master confirmed to it, the
        rest once it is master, and a client's first call after a failover must not meet
        "unknown topic", or an older committed offset, for a write acknowledged before it.
        Free once passed. UNAVAILABLE (clients retry) if the view is still behind after
        ``timeout_s``."""
        fence = self.metadata_fence
        if fence:
            self._passed_fence(fence, self.wait_metadata_applied(fence, timeout_s))

    async def wait_metadata_fence_async(self, timeout_s: float) -> None:
        """``wait_metadata_fence`` for a coroutine on the server's event loop."""
        fence = self.metadata_fence
        if fence:
            self._passed_fence(fence, await self.wait_metadata_applied_async(fence, timeout_s))

    def _passed_fence(self, fence: int, applied: bool) -> None:
        if not applied:
            raise BrokerError("UNAVAILABLE", "this node took office moments ago and is still applying its log to "
                              f"its views (up to offset {fence}); retry")
        if self.metadata_fence == fence:
            self.metadata_fence = 0

    async def wait_metadata_applied_async(self, offset: int, timeout_s: float) -> bool:
        """``wait_metadata_applied`` for a coroutine on the server's event loop."""
        return await self.dispatcher.wait_applied_async(self.views.metadata, offset, timeout_s)

    def _write_offsets(self, entries: list[tuple[str, str, int, int]]) -> None:
        self.writes.write_system([(system_records.OFFSETS_COMMIT, {"offsets": [list(e) for e in entries]})],
                                 applied=self.views.metadata)

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
        }
        for provide in self._status_providers:
            provide(st)
        return st


def _fatal_on_error(target: Callable[[], None], name: str) -> Callable[[], None]:
    """A dead flusher or dispatcher would stall every ack silently: exit, and let recovery run."""

    def run() -> None:
        try:
            target()
        except BaseException as exc:
            log.critical("thread_failed", thread=name, error=f"{type(exc).__name__}: {exc}")
            os._exit(1)

    return run
