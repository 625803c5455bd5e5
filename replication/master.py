"""The master's side: one ``Replication.Stream`` per slave, and snapshot bundles.

A stream: Hello (the slave's epochs and log end) → Welcome (the divergence point) → raw batches
from there, each message with our confirm offset, heartbeats when idle; a reader thread takes the
slave's acks. What the acks mean for the confirm offset is decided in ``confirm.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import structlog

from broker import metrics
from broker.config import Config
from broker.security.auth import current_caller
from broker.storage.epochs import divergence_point
from broker.store import Store
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from replication.bundle import stream_bundle
from replication.confirm import InSyncSet, Replica
from replication.protocol import HEARTBEAT_S, PROTOCOL_VERSION, epochs_from_pb, epochs_to_pb, read_whole_batches

log = structlog.get_logger("replication.master")


def _us(monotonic_s: float) -> int:
    """A ``sent_at_us`` stamp: our monotonic clock, which the slave echoes in its ack."""
    return int(monotonic_s * 1_000_000)


def _violation(node: str, peer: str, what: str) -> None:
    """A replica claimed something it cannot know: logged and counted; the caller ends its stream."""
    metrics.REPLICATION_VIOLATIONS.inc()
    log.error("replication_protocol_violation", node=node, peer=peer, claim=what)


class MasterSide(pb_grpc.ReplicationServicer):
    def __init__(self, store: Store, config: Config, insync: InSyncSet) -> None:
        self.store = store
        self.config = config
        self.insync = insync
        store.register_status_provider(self.add_status)

    def add_status(self, st: dict[str, object]) -> None:
        replicas = self.insync.describe()
        if self.store.role == "master":
            st["replicas"] = replicas
        metrics.set_bounded(metrics.REPLICA_LAG, {(str(r["node_id"]),): float(r["lag_bytes"]) for r in replicas})  # type: ignore[arg-type]

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
            if not current_caller().authenticated:  # DESIGN §10: an epoch is believed only from an authenticated peer
                _violation(hello.node_id, context.peer(), f"claims epoch {theirs[-1][0]} > ours {store.epoch} without a "
                           "replication credential")
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "an epoch is believed only from an authenticated peer "
                              "(a token with the replication role, or mutual TLS on replication.listen)")
            store.fence(f"slave {hello.node_id} knows epoch {theirs[-1][0]} > ours {store.epoch}")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a higher epoch exists: this master fenced itself")
        log_end = store.log.max_offset
        start = divergence_point(ours, log_end, theirs, hello.log_end) if hello.log_end else store.log.min_offset
        if start < store.log.min_offset:
            context.abort(grpc.StatusCode.OUT_OF_RANGE,
                          f"the slave needs the log from {start} but it starts at {store.log.min_offset}: bootstrap needed")
        replica = self.insync.connected(hello.node_id, hello.address, acked_offset=min(start, hello.log_end))
        replica.sent_end = start  # what the replica may hold: acks beyond it are a protocol violation
        log.info("replica_connected", node=hello.node_id, address=hello.address, start=start, slave_end=hello.log_end)
        reader = threading.Thread(target=self._read_acks, args=(request_iterator, replica), daemon=True)
        reader.start()
        yield pb.MasterMessage(welcome=pb.Welcome(cluster_id=ident.cluster_id, node_id=ident.node_id,
                                                  epochs=epochs_to_pb(ours), truncate_to=start,
                                                  log_start=store.log.min_offset,
                                                  client_address=self.config["coordinator.advertise"]
                                                  or self.config["node.listen"]))
        try:
            yield from self._ship(replica, start, context)
            if replica.evicted:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replication protocol violation: {replica.evicted}")
        finally:
            self.insync.disconnected(replica)
            store.watermarks.advance_confirm()
            log.info("replica_disconnected", node=replica.node_id, acked=replica.acked_offset)

    def _ship(self, replica: Replica, pos: int, context: grpc.ServicerContext) -> Iterator[pb.MasterMessage]:
        store = self.store
        chunk = self.config["replication.chunk_bytes"]
        window = self.config["replication.window_bytes"]
        last_sent = 0.0
        last_confirm = -1
        while (context.is_active() and replica.connected and store.role == "master" and not store.closing
               and not store.fenced_reason):
            end = store.log.max_offset
            if pos < end and pos - replica.acked_offset < window:
                data = read_whole_batches(store, pos, chunk)
                pos += len(data)
                replica.sent_end = pos  # before the send: the ack may come back before we resume
                now = time.monotonic()
                if pos >= end:
                    self.insync.sent_to_end(replica, pos)
                last_sent, last_confirm = now, store.watermarks.confirm_offset
                yield pb.MasterMessage(data=pb.Data(start_offset=pos - len(data), batches=data, confirm_offset=last_confirm,
                                                    epoch=store.epoch, master_end=end, sent_at_us=_us(now)))
                continue
            now = time.monotonic()
            if store.watermarks.confirm_offset != last_confirm or now - last_sent >= HEARTBEAT_S:
                if pos >= end:
                    self.insync.sent_to_end(replica, pos)
                last_sent, last_confirm = now, store.watermarks.confirm_offset
                yield pb.MasterMessage(data=pb.Data(start_offset=pos, confirm_offset=last_confirm, epoch=store.epoch,
                                                    master_end=end, sent_at_us=_us(now)))
            store.appender.wait_appended(pos if pos < end else end, 0.01 if pos - replica.acked_offset >= window else HEARTBEAT_S / 2)

    def _read_acks(self, request_iterator: Iterator[pb.SlaveMessage], replica: Replica) -> None:
        try:
            for msg in request_iterator:
                if msg.WhichOneof("kind") != "ack":
                    continue
                if msg.ack.flushed_offset > replica.sent_end:
                    why = f"acknowledged offset {msg.ack.flushed_offset} beyond the {replica.sent_end} it was sent"
                    _violation(replica.node_id, replica.address, why)
                    self.insync.evict(replica, why)
                    break
                self.insync.acked(replica, msg.ack.flushed_offset, msg.ack.coordinator_unreachable_ms,
                                  msg.ack.heard_sent_at_us / 1e6)
                self.store.watermarks.advance_confirm()
        except grpc.RpcError:
            pass
        finally:
            replica.connected = False
            self.store.watermarks.advance_confirm()
