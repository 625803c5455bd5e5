"""What the store's parts share: the state of its role and the parts they reach (store.py builds
them; ``Store`` is its parts together)."""

from __future__ import annotations

from collections.abc import Callable

from broker.config import Config
from broker.ports import Placement, RoleController, RoleListener, StatusProvider, TxnPeers
from broker.storage.epochs import EpochHistory
from broker.storage.identity import Identity
from broker.store.appender import Appender
from broker.store.decisions import Decisions
from broker.store.disk import DiskSpace
from broker.store.dispatcher import Dispatcher
from broker.store.incidents import Incidents
from broker.store.permit import WritePermit
from broker.store.reads import Reads
from broker.store.retention import Retention
from broker.store.viewset import ViewSet
from broker.store.watermarks import Watermarks


class StoreState:
    config: Config
    data_dir: str
    identity: Identity
    views: ViewSet
    epochs: EpochHistory
    role: str
    master_address: str  # the master a slave follows (its replication address)
    redirect_address: str  # the master's *client* address, as its Welcome or etcd says: where writers go
    master_silent: Callable[[], bool]
    fenced_reason: str
    permit: WritePermit
    closing: bool
    metadata_fence: int
    disk: DiskSpace
    incidents: Incidents
    watermarks: Watermarks
    appender: Appender
    dispatcher: Dispatcher
    retention: Retention
    reads: Reads
    decisions: Decisions
    role_controller: RoleController | None
    placement: Placement | None
    txn_peers: TxnPeers | None
    _role_listeners: list[RoleListener]
    _status_providers: list[StatusProvider]
