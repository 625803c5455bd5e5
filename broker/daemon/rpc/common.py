"""What every area of the gRPC ``Broker`` service shares: the call context (the store and the
daemon's parts), the mapping of failures to status codes, and the one-at-a-time pool for work that
loops over a request's messages in Python."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

import grpc
import structlog

from broker.daemon import plain
from broker.daemon.failures import refuse, unexpected
from broker.daemon.group_admin import GroupAdmin
from broker.daemon.heartbeats import Heartbeats
from broker.daemon.longpoll import LongPolls
from broker.daemon.send_wire import SendRequestView
from broker.errors import MESSAGE_MAX, BrokerError, shown
from broker.groups.pops import PopService
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.security.auth import current_caller
from broker.storage import instance
from broker.store import Store
from broker.txn.checks import CheckStreams
from broker.txn.coordinator import OverShards, TxnDelivery
from broker.txn.service import TxnService
from broker.txn.sweeper import TxnSweeper
from proto import tidemark_pb2 as pb

log = structlog.get_logger("service")
T = TypeVar("T")
SendRequest = pb.SendRequest | SendRequestView  # the fast path's batches are views (send_wire.py)
ACK_NAMES: dict[int, str] = {pb.ACK_UNSPECIFIED: "replica", pb.ACK_REPLICA: "replica", pb.ACK_LEADER: "leader", pb.ACK_FLUSH: "flush"}

def handle(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """``fn()``, or the call refused with the status of what it raised (``refuse``: the handler
    answers None, which grpc does not send)."""
    try:
        return fn()
    except Exception as exc:
        _refuse_for(context, exc)
    return None  # type: ignore[return-value]


async def handle_async(context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[T]]) -> T:
    """``handle`` for coroutine handlers (long-polls, parked heartbeats)."""
    try:
        return await fn()
    except Exception as exc:
        _refuse_for(context, exc)
    return None  # type: ignore[return-value]


def _refuse_for(context: Any, exc: Exception) -> None:
    """The status ``exc`` stands for. Nothing keeps ``exc`` once the handler's ``except`` ends: its
    traceback holds the handler's frame, and with it the request."""
    failure = exc if isinstance(exc, BrokerError) else unexpected(exc)
    refuse(context, getattr(grpc.StatusCode, failure.code), failure.message[:MESSAGE_MAX], failure.metadata)


# A send is checked (records CRC, the framing and contents walks: a few ns a record in C; ~2.5 us in
# Python when the C module is not built; plain messages encoded at a few us each) and appended on
# the event loop when it is small enough not to hold the loop for long; a bigger one in a pool thread.
SEND_ON_LOOP_RECORDS_MAX = 16_384 if bf.NATIVE_FRAMING else 1_024
MESSAGES_ON_LOOP_MAX = 500  # plain messages encoded, or messages decoded, on the loop (~3 us each)
HEAVY_JOBS = 1  # pool jobs that loop over a request's messages in Python, at once (``_heavy``)
SEND_ON_LOOP_BYTES_MAX = 8 << 20
# How long a call waits, on a node that just took office, for its metadata view to apply what was
# confirmed then (``Store.wait_metadata_fence``): a coroutine (no thread held), and a call run in
# the server's thread pool, whose threads every other call needs; UNAVAILABLE after it (retried).
METADATA_FENCE_WAIT_S = 5.0
METADATA_FENCE_WAIT_IN_POOL_S = 0.5
# Calls that never wait for it: what an operator uses while a failover settles.
FENCE_EXEMPT = frozenset({"Status", "Promote", "Demote", "GetRoutes"})
# How long a pull at the end of its queue waits for the queue view to apply what is confirmed
# (read-your-writes: ``_read_your_writes``); it reads what is applied after it.
READ_YOUR_WRITES_WAIT_S = 2.0


def check_system_read(topic: str) -> None:
    """``__`` topics hold users' delayed messages (``__timer``) and every topic and group name
    (``__metadata``): reading them, their offsets or their description needs the system role."""
    if topic.startswith(system_records.SYSTEM_PREFIX) and not current_caller().may("system"):
        raise BrokerError("PERMISSION_DENIED", f"reading the system topic {shown(topic)} needs a token with the "
                          "system role")


class Context:
    """The daemon's parts the service's areas use."""

    def __init__(self, store: Store, longpolls: LongPolls, read_pool: Executor, heartbeats: Heartbeats,
                 ends_pool: Executor | None = None) -> None:
        self.store = store
        self.config = store.config
        self.longpolls = longpolls
        self.read_pool = read_pool  # pull reads and large sends; admin calls run in the server's own pool
        self.ends_pool = ends_pool or read_pool  # acks of pop leases (each waits for its record)
        self.heartbeats = heartbeats
        self.groups = GroupAdmin(store, heartbeats.membership)
        self.pops = PopService(store)
        self.groups.pops = self.pops
        self.txns = TxnService(store)
        self.checks = CheckStreams()
        self.txn_sweeper = TxnSweeper(store, self.txns, self.checks)
        self.over_shards = OverShards(store, self.txns)
        self.txn_delivery = TxnDelivery(store, self.over_shards)
        self.instance = instance.InstanceFile(self.config["node.data_dir"])  # for PullLocal
        self.heavy_slots: asyncio.Semaphore | None = None  # made on the loop at first use


class Rpcs:
    """One area of the service: its RPCs as methods named after them (wire.add_broker_service)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.store = ctx.store
        self.config = ctx.config
        self.longpolls = ctx.longpolls
        self.read_pool = ctx.read_pool
        self.heartbeats = ctx.heartbeats
        self.groups = ctx.groups
        self.pops = ctx.pops
        self.instance = ctx.instance

    async def _heavy(self, on_loop: bool, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: work that is a Python loop per message of one request (encoding plain
        messages, decoding a pull or a pop, building their answers). Small, right here; large, in a
        pool thread, one such job at a time (``HEAVY_JOBS``): the interpreter runs one thread at a
        time, and four decoders at once made every other call wait for it in turn (health checks
        1.8 s behind four decoded pulls of 100,000). Those waiting hold no thread."""
        if on_loop:
            return fn(*args)
        if self.ctx.heavy_slots is None:
            self.ctx.heavy_slots = asyncio.Semaphore(HEAVY_JOBS)
        async with self.ctx.heavy_slots:
            return await asyncio.get_running_loop().run_in_executor(self.read_pool, _yielding, fn, *args)


def _yielding(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a pool thread whose encodes and decodes give the interpreter lock away."""
    with plain.yielding():
        return fn(*args)
