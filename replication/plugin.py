"""Entry point ``tidemark.plugins: replication``: wires replication into a daemon.

The daemon calls ``attach(daemon)`` after recovery and before serving; ``broker`` never imports
this package (DESIGN §9).
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
import structlog

from broker.config import ConfigError
from broker.daemon.plugins import PluginHost
from broker.security import auth, tls
from broker.threads import name_pool_thread
from proto import tidemark_pb2_grpc as pb_grpc
from replication.confirm import InSyncSet
from replication.coordination import records as rec
from replication.coordination.cluster_map import ClusterMap
from replication.coordination.coordinator import Coordinator
from replication.master import MasterSide
from replication.master_loop import LoopReplication
from replication.roles import RoleController
from replication.shards import ShardPlacement
from replication.txn_peers import ShardPeers

log = structlog.get_logger("replication")


def attach(daemon: PluginHost) -> None:
    store, config = daemon.store, daemon.config
    insync = InSyncSet(config, lambda: store.role, lambda: store.log.max_offset)
    store.register_confirm_rule(insync)
    master_side = MasterSide(store, config, insync)
    listen = config["replication.listen"]
    if listen:
        creds = tls.replication_server_credentials(config)  # mutual TLS: unknown slaves fail the handshake
        # with mutual TLS the handshake is the credential; without it, a token with the replication role
        authz = auth.Authorizer(daemon.tokens, config["auth.require_for_reads"], peer_certified=creds is not None)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="repl", initializer=name_pool_thread),
                             options=[("grpc.max_send_message_length", 1 << 30)], interceptors=[auth.AuthInterceptor(authz)])
        pb_grpc.add_ReplicationServicer_to_server(master_side, server)
        tls.listen_on(server, "replication.listen", listen, creds)
        server.start()
        daemon.on_stop.append(lambda: server.stop(1).wait())
    else:
        # the stream runs on the loop that appends (master_loop.py); a snapshot in a thread
        daemon.add_blocking_servicer(pb_grpc.add_ReplicationServicer_to_server, LoopReplication(master_side),
                                     {"Snapshot": False})
    if config["auth.token_file"] and not config["auth.tokens_file"] and not config["replication.tls_cert_file"]:
        log.warning("replication_credential_missing",
                    note="auth.token_file's token has every role but replication: a slave needs a token with the "
                         "replication role (auth.tokens_file) or mutual TLS on replication.listen to follow this node")
    controller = RoleController(store, config, insync, config["node.listen"])
    store.register_role_controller(controller)
    daemon.on_start.append(controller.start)
    daemon.on_stop.insert(0, controller.stop)
    if config["coordinator.endpoints"]:
        coordinator = Coordinator(store, config, insync, controller, replication_address(config))
        controller.coordinator = coordinator
        if config["coordinator.shard"]:  # a cluster of shards: topics placed through etcd (docs/shards.md)
            coordinator.cluster = ClusterMap(rec.prefix(config["coordinator.cluster"]))
            if config["auth.tokens_file"] and not auth.call_metadata(config):
                raise ConfigError("auth.tokens_file: a cluster of shards needs a token with the replication role "
                                  "there (its nodes call each other for transactions over shards)")
            peers = ShardPeers(config, coordinator.cluster)
            placement = ShardPlacement(store, config["coordinator.shard"], coordinator.cluster, coordinator.run_on_loop,
                                       coordinator.submit_on_loop, peers, coordinator.held_leader_revision,
                                       config["cluster.moves_max_in_flight"])
            store.register_placement(placement)
            store.register_txn_peers(peers)
            daemon.on_stop.append(peers.close)
            daemon.on_start.append(placement.start)
            daemon.on_stop.insert(0, placement.stop)
        daemon.on_start.append(coordinator.start)
        daemon.on_stop.insert(0, coordinator.stop)


def replication_address(config: Any) -> str:
    """Where slaves reach this node's replication service, as told to others through etcd: the
    replication port (or the client port) on the advertised host when it listens on a wildcard."""
    if config["replication.advertise"]:
        return str(config["replication.advertise"])
    listen = config["replication.listen"] or config["node.listen"]
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = (config["coordinator.advertise"] or config["node.listen"]).rpartition(":")[0]
    return f"{host}:{port}"
