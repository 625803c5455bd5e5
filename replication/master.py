"""The master's side: one ``Replication.Stream`` per slave, and the in-sync set.

A replica is *in sync* while it is no more than ``replication.max_lag_bytes`` behind the log end
and has caught up with the log end within the last ``replication.max_lag_ms``. A disconnect does
not remove it at once: a slave promises to promote cleanly only within ``max_lag_ms`` of last
hearing from us, so we must not confirm alone before that time has passed.
The confirm offset is min(flushed, acked offset of every in-sync replica): with none in sync the
master confirms alone (DESIGN §2).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import structlog

from broker import metrics
from broker.config import Config
from broker.storage.epochs import divergence_point
from broker.store import Store
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from replication.bundle import stream_bundle
from replication.protocol import HEARTBEAT_S, PROTOCOL_VERSION, epochs_from_pb, epochs_to_pb, read_whole_batches

log = structlog.get_logger("replication.master")


@dataclass
class Replica:
    node_id: str
    address: str
    acked_offset: int = 0
    connected: bool = True
    caught_up_at: float = field(default_factory=time.monotonic)
    in_sync: bool = False
    # (log end reached by a send, when it was sent): acking past it means caught up at that time
    sent_to_end: collections.deque[tuple[int, float]] = field(default_factory=collections.deque)


class MasterSide(pb_grpc.ReplicationServicer):
    def __init__(self, store: Store, config: Config) -> None:
        self.store = store
        self.config = config
        self.replicas: dict[str, Replica] = {}
        self._lock = threading.Lock()
        store.insync_source = self.insync_count  # the confirm source is set per role by the RoleController
        store.replica_acked = self.acked_count
        store.status_providers.append(self.add_status)

    # -- the in-sync set and the confirm offset -----------------------------------------------------
    def _refresh(self, r: Replica, now: float) -> bool:
        lag_bytes = self.store.log.max_offset - r.acked_offset
        in_sync = (
            lag_bytes <= self.config["replication.max_lag_bytes"]
            and (now - r.caught_up_at) * 1000 <= self.config["replication.max_lag_ms"]
        )
        changed = in_sync != r.in_sync
        if changed:
            r.in_sync = in_sync
            log.info("replica_in_sync" if in_sync else "replica_out_of_sync", node=r.node_id, acked=r.acked_offset,
                     lag_bytes=lag_bytes)
        return changed

    def confirm(self, flushed: int) -> int:
        now = time.monotonic()
        with self._lock:
            for r in self.replicas.values():
                self._refresh(r, now)
            acked = [r.acked_offset for r in self.replicas.values() if r.in_sync]
        return min([flushed, *acked])

    def insync_count(self) -> int:
        now = time.monotonic()
        with self._lock:
            for r in self.replicas.values():
                self._refresh(r, now)
            return sum(1 for r in self.replicas.values() if r.in_sync)

    def acked_count(self, offset: int) -> int:
        with self._lock:
            return sum(1 for r in self.replicas.values() if r.acked_offset >= offset)

    def add_status(self, st: dict[str, object]) -> None:
        self.insync_count()  # re-evaluate the lag rules now
        with self._lock:
            replicas = [
                {"node_id": r.node_id, "address": r.address, "acked_offset": r.acked_offset, "in_sync": r.in_sync,
                 "connected": r.connected, "lag_bytes": max(0, self.store.log.max_offset - r.acked_offset)}
                for r in self.replicas.values()
            ]
        if self.store.role == "master":
            st["replicas"] = replicas
        for r in replicas:
            metrics.REPLICA_LAG.labels(str(r["node_id"])).set(int(r["lag_bytes"]))  # type: ignore[call-overload]

    def Snapshot(self, request: pb.SnapshotRequest, context: grpc.ServicerContext) -> Iterator[pb.SnapshotChunk]:
        yield from stream_bundle(self.store, request, context)

    # -- the stream ---------------------------------------------------------------------------------
    def Stream(self, request_iterator: Iterator[pb.SlaveMessage], context: grpc.ServicerContext) -> Iterator[pb.MasterMessage]:
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "hello":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a replication stream starts with a Hello")
        assert first is not None
        hello = first.hello
        store = self.store
        ident = store.identity
        if hello.protocol_version != PROTOCOL_VERSION:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"replication protocol {hello.protocol_version} not supported (this node speaks {PROTOCOL_VERSION})")
        if hello.cluster_id and hello.cluster_id != ident.cluster_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"cluster mismatch: this master belongs to {ident.cluster_id}, the slave to {hello.cluster_id}")
        if store.role != "master" or store.fenced_reason:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this node is not a master (role {store.role})")
        theirs = epochs_from_pb(list(hello.epochs))
        ours = store.epochs.snapshot()
        if theirs and theirs[-1][0] > store.epoch:
            store.fence(f"slave {hello.node_id} knows epoch {theirs[-1][0]} > ours {store.epoch}")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a higher epoch exists: this master fenced itself")
        log_end = store.log.max_offset
        start = divergence_point(ours, log_end, theirs, hello.log_end) if hello.log_end else store.log.min_offset
        if start < store.log.min_offset:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"the slave needs the log from {start} but it starts at {store.log.min_offset}: bootstrap needed")
        with self._lock:
            replica = Replica(hello.node_id, hello.address, acked_offset=min(start, hello.log_end))
            self.replicas[hello.node_id] = replica
        log.info("replica_connected", node=hello.node_id, address=hello.address, start=start, slave_end=hello.log_end)
        reader = threading.Thread(target=self._read_acks, args=(request_iterator, replica), daemon=True)
        reader.start()
        yield pb.MasterMessage(welcome=pb.Welcome(cluster_id=ident.cluster_id, node_id=ident.node_id,
                                                  epochs=epochs_to_pb(ours), truncate_to=start,
                                                  log_start=store.log.min_offset))
        try:
            yield from self._ship(replica, start, context)
        finally:
            with self._lock:
                replica.connected = False
                self._refresh(replica, time.monotonic())
            store.advance_confirm()
            log.info("replica_disconnected", node=replica.node_id, acked=replica.acked_offset)

    def _ship(self, replica: Replica, pos: int, context: grpc.ServicerContext) -> Iterator[pb.MasterMessage]:
        store = self.store
        chunk = self.config["replication.chunk_bytes"]
        window = self.config["replication.window_bytes"]
        last_sent = 0.0
        last_confirm = -1
        while context.is_active() and replica.connected and store.role == "master" and not store.closing:
            end = store.log.max_offset
            if pos < end and pos - replica.acked_offset < window:
                data = read_whole_batches(store, pos, chunk)
                pos += len(data)
                now = time.monotonic()
                if pos >= end:
                    with self._lock:
                        replica.sent_to_end.append((pos, now))
                last_sent, last_confirm = now, store.confirm_offset
                yield pb.MasterMessage(data=pb.Data(start_offset=pos - len(data), batches=data, confirm_offset=last_confirm,
                                                    epoch=store.epoch, master_end=end))
                continue
            now = time.monotonic()
            if store.confirm_offset != last_confirm or now - last_sent >= HEARTBEAT_S:
                if pos >= end:
                    with self._lock:
                        replica.sent_to_end.append((pos, now))
                last_sent, last_confirm = now, store.confirm_offset
                yield pb.MasterMessage(data=pb.Data(start_offset=pos, confirm_offset=last_confirm, epoch=store.epoch,
                                                    master_end=end))
            store.wait_appended(pos if pos < end else end, 0.01 if pos - replica.acked_offset >= window else HEARTBEAT_S / 2)

    def _read_acks(self, request_iterator: Iterator[pb.SlaveMessage], replica: Replica) -> None:
        try:
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "ack":
                    continue
                acked = msg.ack.flushed_offset
                with self._lock:
                    replica.acked_offset = max(replica.acked_offset, acked)
                    while replica.sent_to_end and replica.sent_to_end[0][0] <= acked:
                        replica.caught_up_at = replica.sent_to_end.popleft()[1]
                    self._refresh(replica, time.monotonic())
                self.store.advance_confirm()
        except grpc.RpcError:
            pass
        finally:
            with self._lock:
                replica.connected = False
            self.store.advance_confirm()
