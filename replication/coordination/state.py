"""What the coordinator's parts share (``coordinator.py`` composes them): the node's leadership
state in etcd as the coordinator last saw it, written by its loop and read by status, the permit
and the gRPC threads of promote and demote, under ``state_lock``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

from broker.config import Config
from broker.store import Store
from replication.confirm import InSyncSet
from replication.coordination import records as rec
from replication.coordination.etcd import Etcd, View
from replication.roles import RoleController


class CoordinatorBase:
    store: Store
    config: Config
    insync: InSyncSet
    roles: RoleController
    etcd: Etcd
    node_id: str
    client_address: str
    replication_address: str
    ttl_s: float
    margin_s: float
    started_at: float
    lease_id: int
    renewed_at: float  # monotonic: when the last successful keep-alive (or grant) was sent
    error: str
    _loop: asyncio.AbstractEventLoop | None

    def _init_state(self) -> None:
        self.state_lock = threading.RLock()  # holding, leader, members, unclean_once, ... across threads
        self.holding: rec.Leader | None = None  # our leader record, while the key is ours
        self.leader_revision = 0
        self.view: View | None = None
        self.leader: rec.Leader | None = None
        self.members: tuple[str, ...] = ()
        self.failsafe = False
        self.unclean_once = False  # a promote --unclean in progress may be elected outside the set
        self._handing_over_since = 0.0
        self.switchover_failure: tuple[float, str] = (0.0, "")  # (monotonic time, why) of the last one ended
        self._lost_at = 0.0  # monotonic: when this master lost the leader key
        self._taking_office = False  # the key is ours and become_master runs: role and holding disagree
        self._waiting = ""  # why we do not campaign (logged when it changes)
        self._topology_published: tuple[int, bytes] = (0, b"")  # (lease, record) of our shard's topology key

    # -- implemented by the parts (each in its module), called across them ----------------------------
    async def _step(self, step: Callable[..., None], *args: Any) -> None:  # coordinator
        raise NotImplementedError

    def _hears_live_master(self) -> bool:  # coordinator
        raise NotImplementedError

    def _grant(self, renewed_at: float) -> None:  # permit_keeper
        raise NotImplementedError

    def _lost_key(self, why: str) -> None:  # permit_keeper
        raise NotImplementedError

    async def _hand_over(self, view: View) -> bool:  # switchover
        raise NotImplementedError

    async def _maintain_insync(self) -> None:  # insync_keeper
        raise NotImplementedError
