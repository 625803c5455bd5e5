"""The master's side: one ``Replication.Stream`` per slave, and snapshot bundles.

A stream: Hello (the slave's epochs and log end) → Welcome (the divergence point) → raw batches
from there, each message with our confirm offset, heartbeats when idle (``shipping.py``); the
slave's acks come back on the same stream. What the acks mean for the confirm offset is decided in
``confirm.py``. Here are the handshake and the ack handling, and the blocking stream the separate
``replication.listen`` server runs (a thread ships, a reader thread takes the acks); on the client
port the same stream runs as coroutines (``master_loop.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import structlog

from broker import metrics
from broker.config import Config
from broker.security.auth import current_caller
from broker.storage.epochs import divergence_point
from broker.store import Store
from broker.threads import NamedThread
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from replication.bundle import stream_bundle
from replication.confirm import InSyncSet, Replica
from replication.protocol import PROTOCOL_VERSION, Refused, epochs_from_pb, epochs_to_pb
from replication.shipping import Shipper

log = structlog.get_logger("replication.master")


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
        """The blocking stream (the ``replication.listen`` server): a thread ships, another reads acks."""
        try:
            replica, start, welcome = self.handshake(next(request_iterator, None), context.peer())
        except Refused as r:
            context.abort(r.code, r.details)
            raise  # not reached: abort raises
        reader = NamedThread(target=self._read_acks, args=(request_iterator, replica), name="replica-acks", daemon=True)
        reader.start()
        try:
            yield welcome
            shipper = Shipper(self.store, self.config, self.insync, replica, start)
            while context.is_active() and shipper.streaming():
                msg = shipper.next_message()
                if msg is None:
                    shipper.wait()
                else:
                    yield msg
            if replica.evicted:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replication protocol violation: {replica.evicted}")
        except Refused as r:
            context.abort(r.code, r.details)
        finally:
            self.ended(replica)

    def handshake(self, first: pb.SlaveMessage | None, peer: str) -> tuple[Replica, int, pb.MasterMessage]:
        """Check the slave's Hello; return its replica entry, the offset shipping starts from and the
        Welcome to send. ``Refused`` ends the stream with its status."""
        if first is None or first.WhichOneof("kind") != "hello":
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a replication stream starts with a Hello")
        hello = first.hello
        store = self.store
        ident = store.identity
        if hello.protocol_version != PROTOCOL_VERSION:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"replication protocol {hello.protocol_version} not supported (this node speaks {PROTOCOL_VERSION})")
        if hello.cluster_id and hello.cluster_id != ident.cluster_id:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"cluster mismatch: this master belongs to {ident.cluster_id}, the slave to {hello.cluster_id}")
        if store.role != "master" or store.fenced_reason:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"this node is not a master (role {store.role})")
        theirs = epochs_from_pb(list(hello.epochs))
        ours = store.epochs.snapshot()
        if theirs and theirs[-1][0] > store.epoch:
            if not current_caller().authenticated:  # DESIGN §10: an epoch is believed only from an authenticated peer
                _violation(hello.node_id, peer, f"claims epoch {theirs[-1][0]} > ours {store.epoch} without a "
                           "replication credential")
                raise Refused(grpc.StatusCode.PERMISSION_DENIED, "an epoch is believed only from an authenticated peer "
                              "(a token with the replication role, or mutual TLS on replication.listen)")
            store.fence(f"slave {hello.node_id} knows epoch {theirs[-1][0]} > ours {store.epoch}")
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "a higher epoch exists: this master fenced itself")
        log_end = store.log.max_offset
        start = divergence_point(ours, log_end, theirs, hello.log_end) if hello.log_end else store.log.min_offset
        if start < store.log.min_offset:
            raise Refused(grpc.StatusCode.OUT_OF_RANGE,
                          f"the slave needs the log from {start} but it starts at {store.log.min_offset}: bootstrap needed")
        replica = self.insync.connected(hello.node_id, hello.address, acked_offset=min(start, hello.log_end))
        replica.sent_end = start  # what the replica may hold: acks beyond it are a protocol violation
        log.info("replica_connected", node=hello.node_id, address=hello.address, start=start, slave_end=hello.log_end)
        welcome = pb.MasterMessage(welcome=pb.Welcome(cluster_id=ident.cluster_id, node_id=ident.node_id,
                                                      epochs=epochs_to_pb(ours), truncate_to=start,
                                                      log_start=store.log.min_offset,
                                                      client_address=self.config["coordinator.advertise"]
                                                      or self.config["node.listen"]))
        return replica, start, welcome

    def on_ack(self, msg: pb.SlaveMessage, replica: Replica) -> bool:
        """One message from the slave after its Hello; False when it broke the protocol (the stream ends)."""
        if msg.WhichOneof("kind") != "ack":
            return True
        if msg.ack.flushed_offset > replica.sent_end:
            why = f"acknowledged offset {msg.ack.flushed_offset} beyond the {replica.sent_end} it was sent"
            _violation(replica.node_id, replica.address, why)
            self.insync.evict(replica, why)
            return False
        self.insync.acked(replica, msg.ack.flushed_offset, msg.ack.coordinator_unreachable_ms, msg.ack.heard_sent_at_us / 1e6)
        self.store.watermarks.advance_confirm()
        return True

    def reader_ended(self, replica: Replica) -> None:
        """The slave's side of the stream ended (or broke the protocol): shipping stops too."""
        replica.connected = False
        self.store.watermarks.advance_confirm()

    def ended(self, replica: Replica) -> None:
        self.insync.disconnected(replica)
        self.store.watermarks.advance_confirm()
        log.info("replica_disconnected", node=replica.node_id, acked=replica.acked_offset)

    def _read_acks(self, request_iterator: Iterator[pb.SlaveMessage], replica: Replica) -> None:
        try:
            for msg in request_iterator:
                if not self.on_ack(msg, replica):
                    break
        except grpc.RpcError:
            pass
        finally:
            self.reader_ended(replica)
