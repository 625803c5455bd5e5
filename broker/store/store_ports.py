"""The ports plugins register through (broker/ports.py), and what they may set."""

from __future__ import annotations

import structlog

from broker.ports import (
    ColdReader,
    ConfirmRule,
    Placement,
    QueueListener,
    RetentionFloor,
    RoleController,
    RoleListener,
    StatusProvider,
    TxnPeers,
)
from broker.storage import identity as identity_mod
from broker.store.state import StoreState

log = structlog.get_logger("store")


class StorePorts(StoreState):
    def register_confirm_rule(self, rule: ConfirmRule) -> None:
        self.watermarks.register_rule(rule)

    def register_role_controller(self, controller: RoleController) -> None:
        self.role_controller = controller

    def register_placement(self, placement: Placement) -> None:
        self.placement = placement

    def register_txn_peers(self, peers: TxnPeers) -> None:
        self.txn_peers = peers

    def register_role_listener(self, listener: RoleListener) -> None:
        self._role_listeners.append(listener)

    def register_status_provider(self, provider: StatusProvider) -> None:
        self._status_providers.append(provider)

    def register_cold_reader(self, reader: ColdReader) -> None:
        self.reads.register_cold_reader(reader)

    def register_retention_floor(self, floor: RetentionFloor) -> None:
        self.retention.register_floor(floor)

    def register_queue_listener(self, listener: QueueListener) -> None:
        """Told, after each dispatch round, which (topic, queue)s became readable further."""
        self.dispatcher.queue_listeners.append(listener)

    def adopt_cluster(self, cluster_id: str) -> None:
        """An empty slave takes its master's cluster id (``identity`` rewritten on disk)."""
        self.identity = identity_mod.adopt_cluster(self.data_dir, cluster_id)
