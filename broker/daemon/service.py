"""The gRPC ``Broker`` service: request checks, mapping to the store, status codes.

It runs on an asyncio gRPC server (``grpc.aio``): ``Pull`` is a coroutine (a long-poll holds no
thread), and so are ``Send``, ``Pop``, ``Heartbeat`` and the topic creates and deletes (they append
on the loop and their waits park a future, not a thread); every other method is a plain function
run in the server's thread pool. Each area is a class of its own (``broker/daemon/rpc/``: data,
topics, groups, pops, transactions); this one composes them and answers for every RPC by name.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from broker.daemon.heartbeats import Heartbeats
from broker.daemon.longpoll import LongPolls
from broker.daemon.rpc.common import FENCE_EXEMPT, METADATA_FENCE_WAIT_IN_POOL_S, METADATA_FENCE_WAIT_S, Context
from broker.daemon.rpc.data import DataRpcs
from broker.daemon.rpc.groups import GroupRpcs
from broker.daemon.rpc.pops import PopRpcs
from broker.daemon.rpc.topics import TopicRpcs
from broker.daemon.rpc.transactions import TransactionRpcs
from broker.store import Store

__all__ = ["FENCE_EXEMPT", "BrokerService"]


class BrokerService:
    def __init__(self, store: Store, longpolls: LongPolls, read_pool: Executor, heartbeats: Heartbeats,
                 ends_pool: Executor | None = None) -> None:
        self.ctx = Context(store, longpolls, read_pool, heartbeats, ends_pool)
        self.store = store
        self.data = DataRpcs(self.ctx)
        self.topics = TopicRpcs(self.ctx)
        self.groups = GroupRpcs(self.ctx)
        self.pop_rpcs = PopRpcs(self.ctx)
        self.transactions = TransactionRpcs(self.ctx)
        self._areas = (self.data, self.topics, self.groups, self.pop_rpcs, self.transactions)

    def start(self) -> None:
        """The service's own threads (transaction timeouts); they stop with the store."""
        self.ctx.txn_sweeper.start()
        self.ctx.txn_delivery.start()

    def stop(self) -> None:
        self.ctx.txn_sweeper.stop()
        self.ctx.txn_delivery.stop()

    @property
    def pops(self) -> Any:
        return self.ctx.pops

    @property
    def instance(self) -> Any:
        return self.ctx.instance

    def rpc(self, name: str) -> Callable[..., Any]:
        """The handler of the RPC ``name`` (wire.add_broker_service registers each one)."""
        for area in self._areas:
            handler = getattr(area, name, None)
            if handler is not None:
                return handler  # type: ignore[no-any-return]
        raise LookupError(f"no handler for Broker/{name}")

    # -- a new master's metadata fence (wire.add_broker_service runs these before every call) -----
    def wait_fence(self) -> None:
        self.store.wait_metadata_fence(METADATA_FENCE_WAIT_IN_POOL_S)

    async def wait_fence_async(self) -> None:
        await self.store.wait_metadata_fence_async(METADATA_FENCE_WAIT_S)
