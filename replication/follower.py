"""The slave's side: follow a master's log (DESIGN §4).

Loop: connect → Hello (our epochs, log end) → Welcome (divergence point) → truncate our
unconfirmed tail there → for each Data: verify and append the bytes and take the master's confirm
offset (views apply up to it); the flushed offset is acknowledged by another thread once the
group-commit flusher synced it (replication/slave_acks.py), so appends and fsyncs overlap. Reconnect with
exponential backoff; a cluster mismatch or a needed re-bootstrap stops following and says why
in ``status()``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import structlog

from broker.config import Config
from broker.errors import BrokerError
from broker.invariant import CorruptionError
from broker.ports import Truncation
from broker.store import Store
from broker.threads import NamedThread
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from replication.bootstrap import restart_for_bootstrap
from replication.channel import call_metadata, open_channel
from replication.confirm import InSyncSet
from replication.protocol import PROTOCOL_VERSION, epochs_from_pb, epochs_to_pb
from replication.send_clock import SendClock
from replication.slave_acks import FlushAcks

log = structlog.get_logger("replication.follower")
_STOP = object()
DISK_FULL_RETRY_S = 0.5


def _put_stop(acks: queue.Queue[object]) -> None:
    """End the request stream. A full queue means the consumer is not waiting on it (it leaves at
    the next item it takes from a cancelled call), so the marker may be dropped then."""
    with contextlib.suppress(queue.Full):
        acks.put_nowait(_STOP)


class Follower:
    def __init__(self, store: Store, config: Config, master: str, own_address: str, insync: InSyncSet) -> None:
        self.store = store
        self.config = config
        self.master = master
        self.own_address = own_address
        self.insync = insync
        self.master_end = 0
        self.last_heard = 0.0
        # when the master sent (on our clock: send_clock.py) the newest message whose log end we have
        # since fsynced and acknowledged: the master counts a replica in sync from such acks, so this
        # is what ages our knowledge (a slave whose fsyncs stall keeps hearing heartbeats but no
        # longer acknowledges; one resumed after a pause reads old messages that arrive "now")
        self.acked_heard_at = 0.0
        self.in_sync_when_heard = False
        self.connected = False
        self.error = ""
        self.coordinator_unreachable_ms: Callable[[], int] = lambda: 0  # set by the coordinator, when there is one
        self._stop = threading.Event()
        # the stream in flight. Other threads end it only by cancelling it (thread-safe in gRPC);
        # the follower thread alone closes its channel, once gRPC's request-consumer thread can no
        # longer send on the call: closing a channel under that thread crashed the process
        self._call_lock = threading.Lock()
        self._call: grpc.Future | None = None
        self._thread = NamedThread(target=self._run, name="follower", daemon=True)

    # -- life cycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self.insync.follow(self.store.views.applied_max())  # what we know was confirmed
        self._thread.start()

    def stop(self) -> None:
        with self._call_lock:
            self._stop.set()
            if self._call is not None:
                self._call.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(10)

    def known_in_sync(self) -> bool:
        """Safe to promote: in sync when we last heard from the master, and that knowledge still holds.

        In sync = our log reaches the master's confirm offset and we were within the lag limits.
        With ``min_insync_replicas = 1`` the master may drop us and confirm alone once
        ``max_lag_ms`` passed without an acknowledgement from us, so the knowledge expires then,
        counted from the last message we acknowledged as flushed; with 2 it cannot.
        """
        if not self.acked_heard_at or not self.in_sync_when_heard:
            return False
        if self.config["replication.min_insync_replicas"] >= 2:
            return True
        return (time.monotonic() - self.acked_heard_at) * 1000 <= self.config["replication.max_lag_ms"]

    def add_status(self, st: dict[str, object]) -> None:
        if self.store.role != "slave":
            return
        st["replication"] = {
            "master": self.master, "connected": self.connected, "master_confirm_offset": self.insync.master_confirm,
            "master_end": self.master_end, "lag_bytes": max(0, self.master_end - self.store.log.max_offset),
            "in_sync": self.known_in_sync(), "error": self.error,
        }

    # -- the loop ----------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff_s = 0.05
        cap_s = self.config["replication.reconnect_backoff_ms_max"] / 1000.0
        while not self._stop.is_set():
            try:
                self._follow_once()
                backoff_s = 0.05
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                self.error = f"{code.name}: {exc.details()}"  # type: ignore[attr-defined]
                if code == grpc.StatusCode.OUT_OF_RANGE:  # the master no longer has our position
                    restart_for_bootstrap(self.store.data_dir, self.error)
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    if "protocol violation" in (exc.details() or ""):  # type: ignore[attr-defined]
                        self.in_sync_when_heard = False  # the master no longer counts us: never promote cleanly on it
                    log.warning("master_refused", master=self.master, error=self.error)
                elif not self._stop.is_set():
                    log.info("master_unreachable", master=self.master, error=self.error)
            except BrokerError as exc:
                self.error = str(exc)
                log.error("follow_failed", master=self.master, error=self.error)
            except Diverged as exc:  # below what our views applied: an unclean node re-bootstraps
                self.error = str(exc)
                log.error("follow_failed", master=self.master, error=self.error)
                restart_for_bootstrap(self.store.data_dir, self.error)
            except (CorruptionError, FollowError) as exc:
                self.error = str(exc)
                log.error("follow_failed", master=self.master, error=self.error)
            except Exception as exc:  # a bug or an OS error: never let the follower die silently
                self.error = f"{type(exc).__name__}: {exc}"
                log.exception("follow_failed", master=self.master, error=self.error)
            finally:
                self.connected = False
            if self.error and not self._stop.is_set():
                self.store.incidents.record("follower", self.error)
            if self._stop.wait(backoff_s):
                break
            backoff_s = min(cap_s, backoff_s * 2)

    def _follow_once(self) -> None:
        store = self.store
        send_clock = SendClock()  # one per stream: this stream's master may run on another clock
        acks: queue.Queue[object] = queue.Queue(maxsize=1024)
        ident = store.identity
        # the master counts our log end as acknowledged (flushed) from the Hello on: make it so first
        # (after a failed stream, bytes we appended may not be synced yet)
        store.watermarks.sync_log()
        hello = pb.Hello(protocol_version=PROTOCOL_VERSION, cluster_id=ident.cluster_id, node_id=ident.node_id,
                         epochs=epochs_to_pb(store.epochs.snapshot()), log_end=store.log.max_offset,
                         address=self.own_address)
        if store.log.max_offset == 0 and not store.epochs.entries:
            hello.cluster_id = ""  # an empty slave adopts the master's cluster

        def outgoing() -> Iterator[pb.SlaveMessage]:
            yield pb.SlaveMessage(hello=hello)
            while True:
                item = acks.get()
                if item is _STOP:
                    return
                yield item  # type: ignore[misc]

        channel = open_channel(self.config, self.master, [("grpc.max_receive_message_length", 1 << 30)])
        try:
            responses = pb_grpc.ReplicationStub(channel).Stream(outgoing(), metadata=call_metadata(self.config))
        except BaseException:
            channel.close()  # no call exists yet: nothing can send on it
            raise
        acker = FlushAcks(store.watermarks, acks, self.coordinator_unreachable_ms, lambda _: responses.cancel(),
                          self._acked)
        try:
            with self._call_lock:
                if self._stop.is_set():
                    return
                self._call = responses
            acker.start()
            for msg in responses:
                if self._stop.is_set():
                    break
                kind = msg.WhichOneof("kind")
                if kind == "welcome":
                    self._welcome(msg.welcome)
                    store.set_redirect(msg.welcome.client_address)  # writers go to its client port
                    self.connected = True
                    self.error = ""
                    self.store.incidents.clear("follower")
                elif kind == "data":
                    self._data(msg.data, acker, send_clock)
        except grpc.RpcError as exc:
            if acker.error and exc.code() == grpc.StatusCode.CANCELLED:  # type: ignore[attr-defined]
                raise FollowError(acker.error) from None  # acknowledging failed and cancelled the call: say why
            raise
        finally:
            with self._call_lock:
                self._call = None
            # closing is safe once the call is cancelled: gRPC's request-consumer thread then drops
            # whatever it takes next instead of sending it. Stopping the acker and the stop marker
            # (which wakes a consumer waiting on an empty queue) let both threads end
            responses.cancel()
            acker.stop()
            _put_stop(acks)
            channel.close()

    def _welcome(self, w: pb.Welcome) -> None:
        store = self.store
        if w.cluster_id != store.identity.cluster_id:
            if store.log.max_offset == 0 and not store.epochs.entries:
                store.adopt_cluster(w.cluster_id)
            else:
                self._stop.set()
                raise FollowError(f"master {self.master} belongs to cluster {w.cluster_id}, this node to "
                                  f"{store.identity.cluster_id}: refusing to follow it")
        theirs = epochs_from_pb(list(w.epochs))
        if theirs and theirs[-1][0] < store.epoch:
            raise FollowError(f"master {self.master} is at epoch {theirs[-1][0]}, behind ours {store.epoch}: not following a stale master")
        if w.truncate_to < store.log.max_offset and store.appender.truncate_to(w.truncate_to) is Truncation.BELOW_APPLIED:
            raise Diverged(f"divergence at {w.truncate_to} is below what this node applied or confirmed "
                           f"({max(store.views.applied_max(), store.watermarks.confirm_offset)}): it must re-bootstrap "
                           "(unclean)")
        store.epochs.replace([(e, o) for e, o in theirs if o <= store.log.max_offset])
        log.info("following", master=self.master, from_offset=store.log.max_offset, epoch=store.epoch)

    def _acked(self, heard_at: float) -> None:
        self.acked_heard_at = max(self.acked_heard_at, heard_at)

    def _data(self, d: pb.Data, acker: FlushAcks, send_clock: SendClock) -> None:
        store = self.store
        self.last_heard = time.monotonic()
        self.master_end = d.master_end
        if d.batches:
            if d.start_offset != store.log.max_offset:
                raise FollowError(f"master sent offset {d.start_offset}, our log ends at {store.log.max_offset}")
            self._append(d.batches)
            store.watermarks.want_flush()
        # every message is answered, heartbeats too: the master learns we are alive and whether we
        # reach etcd (its failsafe, DESIGN §11); once our log end at this message is flushed,
        # without holding this loop
        acker.want(store.log.max_offset, send_clock.sent_at(d.sent_at_us, self.last_heard), d.sent_at_us)
        if d.epoch > store.epoch and store.log.max_offset >= d.master_end:
            # caught up with a master that has written nothing in its epoch yet: it starts here. A
            # slave still behind learns the epoch from the first batch that carries it
            # (``append_replicated``), never at its own, lower log end.
            store.epochs.start(d.epoch, store.log.max_offset)
        if self.insync.master_confirmed(d.confirm_offset):
            store.watermarks.advance_confirm()
        log_end = store.log.max_offset
        self.in_sync_when_heard = (
            log_end >= self.insync.master_confirm and d.master_end - log_end <= self.config["replication.max_lag_bytes"]
        )

    def _append(self, batches: bytes) -> int:
        """Append a chunk; while the disk is full (or below ``storage.min_free_bytes``), hold it and
        keep the stream, say so in status, and go on when space returns."""
        store = self.store
        while True:
            try:
                store.check_free_space()
                end = store.appender.append_replicated(batches)
            except BrokerError as exc:
                if exc.code != "RESOURCE_EXHAUSTED":
                    raise
                self.error = f"disk full: {exc.message}"
                store.incidents.record("follower", self.error)
                if self._stop.wait(DISK_FULL_RETRY_S):
                    raise FollowError("stopped while the disk was full") from None
                continue
            if self.error.startswith("disk full"):
                self.error = ""
                store.incidents.clear("follower")
            return end


class FollowError(Exception):
    """Following this master cannot go on as things are; the message says why."""


class Diverged(Exception):
    """Our log diverged from the master's below what our views applied: re-bootstrap."""
