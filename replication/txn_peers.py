"""Calls from a transaction's coordinator shard to its participants' masters (``broker.ports.TxnPeers``;
docs/shards.md "Transactions across shards"), and a shard's due timers of a queue that moved to
that queue's shard ("Moving a queue"), and a moving group slot's committed offsets to its new
shard ("Moving a group slot").

Each shard's master is found in this node's copy of etcd's topology (``ClusterMap``), reached on
its client port with this node's own credential: the first token of ``auth.tokens_file`` with the
``replication`` role (``PrepareTransaction`` and ``DecideTransaction`` need it), and, when the
client port has TLS, the replication certificate and CA. One channel per address is kept (at
most ``CHANNELS_MAX``). A shard with no master, a call that fails or a master that refuses
(``FAILED_PRECONDITION`` from a node that stepped down) raise ``BrokerError``: the coordinator
retries.
"""

from __future__ import annotations

import threading
from typing import Any

import grpc

from broker.config import Config, ConfigError
from broker.errors import BrokerError, shown
from broker.logformat.txn_records import Party
from broker.security import auth, tls
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from replication.coordination.cluster_map import ClusterMap

CHANNELS_MAX = 256


class ShardPeers:
    def __init__(self, config: Config, cluster: ClusterMap) -> None:
        self.config = config
        self.cluster = cluster
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.BrokerStub]] = {}
        self._lock = threading.Lock()

    def prepare(self, tid: str, party: Party, timeout_s: float) -> str:
        request = pb.PrepareTransactionRequest(transactional_id=tid, producer_id=party.pid,
                                               messages_sent=party.messages, offsets=_offsets(party))
        response: pb.PrepareTransactionResponse = self._call(party.shard, "PrepareTransaction", request, timeout_s)
        return "" if response.prepared else (response.reason or "aborted")

    def decide(self, tid: str, party: Party, commit: bool, timeout_s: float) -> bool:
        request = pb.DecideTransactionRequest(transactional_id=tid, producer_id=party.pid, commit=commit,
                                              offsets=_offsets(party) if commit else [])
        response: pb.DecideTransactionResponse = self._call(party.shard, "DecideTransaction", request, timeout_s)
        return bool(response.outcome == pb.TRANSACTION_OUTCOME_COMMITTED)

    def forward_timers(self, shard: str, source_shard: str, topic: str, queue: int,
                       timers: list[tuple[int, bytes, bytes, bytes]], timeout_s: float) -> int:
        request = pb.ForwardTimersRequest(source_shard=source_shard, topic=topic, queue_id=queue, timers=[
            pb.ForwardedTimer(timer_offset=o, key=k, body=b, props=p) for o, k, b, p in timers])
        response: pb.ForwardTimersResponse = self._call(shard, "ForwardTimers", request, timeout_s)
        return int(response.stored)

    def import_offsets(self, shard: str, slot: int, source_shard: str,
                       offsets: list[tuple[str, str, int, int]], timeout_s: float) -> int:
        request = pb.ImportOffsetsRequest(slot=slot, source_shard=source_shard, offsets=[
            pb.CommittedOffset(group=g, topic=t, queue_id=q, offset=o) for g, t, q, o in offsets])
        response: pb.ImportOffsetsResponse = self._call(shard, "ImportOffsets", request, timeout_s)
        return int(response.stored)

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._stubs.values():
                channel.close()
            self._stubs.clear()

    def _call(self, shard: str, method: str, request: object, timeout_s: float) -> Any:
        master = self.cluster.master(shard)
        if master is None or not master.client:
            raise BrokerError("UNAVAILABLE", f"shard {shown(shard)} has no master now")
        stub = self._stub(master.client)
        try:
            metadata = auth.call_metadata(self.config)
        except (OSError, ValueError, ConfigError) as exc:  # the tokens file, rotated under us: the next call reads it again
            raise BrokerError("UNAVAILABLE", f"this node's replication token does not read: {exc}") from exc
        try:
            return getattr(stub, method)(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            code = exc.code().name if exc.code() is not None else "UNAVAILABLE"
            raise BrokerError(code, f"shard {shown(shard)}'s master {master.client}: {exc.details() or code}") from exc

    def _stub(self, address: str) -> pb_grpc.BrokerStub:
        with self._lock:
            known = self._stubs.get(address)
            if known is not None:
                return known[1]
            if len(self._stubs) >= CHANNELS_MAX:
                for channel, _ in self._stubs.values():
                    channel.close()
                self._stubs.clear()
            channel = self._channel(address)
            stub = pb_grpc.BrokerStub(channel)
            self._stubs[address] = (channel, stub)
            return stub

    def _channel(self, address: str) -> grpc.Channel:
        if not self.config["tls.cert_file"]:
            return grpc.insecure_channel(address)
        creds = tls.replication_channel_credentials(self.config) or grpc.ssl_channel_credentials()
        return grpc.secure_channel(address, creds)


def _offsets(party: Party) -> list[pb.CommittedOffset]:
    return [pb.CommittedOffset(group=g, topic=t, queue_id=q, offset=o) for g, t, q, o in party.offsets]
