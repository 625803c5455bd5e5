"""The coordinator: this node's lease, the election, the write permit and the in-sync set in etcd.

This module holds the lease and the loop; each concern is a module of its own, composed here:
``election`` (who campaigns, taking office), ``permit_keeper`` (the write permit, the failsafe),
``insync_keeper`` (the in-sync set in etcd), ``switchover`` (promote and demote, hand-over), and
``state`` (what they share, under one lock).

One thread runs an asyncio loop with two tasks:

- **etcd** (every ``tick``): renew the lease (one keep-alive round trip), read every key in one
  transaction, then decide. A node that sees another leader follows it; a node that sees none
  campaigns if it may (below); the master shrinks or grows the in-sync set in etcd.
- **permit** (every 50 ms, on the master): the write permit runs until ``renewed_at + ttl -
  margin``, where ``renewed_at`` is when the last successful keep-alive was *sent*: etcd cannot
  expire the lease before ``renewed_at + ttl``, so the master stops acknowledging first (the
  margin is a fifth of the TTL, for clock-rate drift and the time a check takes). Past that, with
  etcd unreachable, the **failsafe**: while a slave of the recorded in-sync set keeps acknowledging
  (within ``FAILSAFE_ACK_S``), writes go on with every ack mode waiting for that slave, so whatever
  is acknowledged is on the only node that could be elected. Otherwise the master steps down. An
  ack is dated by when we *sent* the newest message the slave had heard (it echoes our stamp), never by
  when it arrived: after a pause (SIGSTOP, a stalled VM) the acks that waited in the socket
  buffer arrive at once and would look fresh while the slave, which stopped hearing us long ago,
  may have been elected meanwhile.

Who may campaign (the leader key is absent):
- not a slave that still hears a live master (a master cut off from etcd but not from us);
- a member of the recorded in-sync set (the set is written only by the master, and only shrunk
  *before* the master confirms without the member: ``confirm.py``'s pins) -- or anyone with
  ``unclean_election``, after members had a lease's time to step up;
- a brand-new cluster has no set yet: the registered node with the most data (highest epoch,
  then longest log, then lowest node id) goes first, once every node had a TTL to register.

The campaign is one transaction: the leader key must be absent and the epoch, the in-sync set and
any switchover unchanged since the view we decided on; it writes the leader key (bound to our
lease), the new epoch and an in-sync set of just us. Epochs come from etcd, so two masters never
share one. A master whose lease lapsed re-takes the key at its own epoch if nobody took a newer one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import structlog

from broker.config import Config
from broker.errors import BrokerError
from broker.store import Store
from broker.threads import NamedThread, name_pool_thread
from replication.confirm import InSyncSet
from replication.coordination import records as rec
from replication.coordination.cluster_map import ClusterMap
from replication.coordination.election import Election
from replication.coordination.etcd import Etcd, Unreachable, View
from replication.coordination.insync_keeper import InSyncKeeper
from replication.coordination.permit_keeper import PermitKeeper
from replication.coordination.switchover import Switchover
from replication.roles import RoleController

log = structlog.get_logger("replication.coordinator")

REGISTER_EVERY_S = 1.0
T = TypeVar("T")


class Coordinator(Election, PermitKeeper, InSyncKeeper, Switchover):
    def __init__(self, store: Store, config: Config, insync: InSyncSet, roles: RoleController,
                 replication_address: str) -> None:
        self.store = store
        self.config = config
        self.insync = insync
        self.roles = roles
        self.node_id = store.identity.node_id
        self.client_address = config["coordinator.advertise"] or config["node.listen"]
        self.replication_address = replication_address
        self.ttl_s = config["coordinator.lease_ttl_ms"] / 1000.0
        self.margin_s = self.ttl_s / 5
        self.tick_s = min(0.1, self.ttl_s / 20)  # a view and a keep-alive 10 times a second: ~200 B each
        self.etcd = Etcd(config)  # a fresh client for every run of the loop (see _main)
        # state, written by the loop thread; read by status, the permit and promote / demote
        self.lease_id = 0
        self.renewed_at = 0.0  # monotonic: when the last successful keep-alive (or grant) was sent
        self.last_ok = 0.0  # monotonic: the last etcd answer
        self.started_at = time.monotonic()
        self.error = ""
        self._last_register = 0.0
        self._init_state()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = NamedThread(target=self._run, name="coordinator", daemon=True)
        self.cluster: ClusterMap | None = None  # a cluster of shards: the watched placement (plugin.py)
        store.register_status_provider(self._status)
        # a slave whose master fell silent for as long as makes it campaign names no master to writers
        store.register_master_silence(lambda: not self._hears_live_master())

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Graceful: a master stops acknowledging, then gives the key up at once (revoking the lease),
        so the slave is elected without waiting for the TTL."""
        if self.holding is not None:
            self.store.permit.withdraw("this node is shutting down")
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        backoff_s = 0.1
        while not self._stop.is_set():
            try:
                asyncio.run(self._main())
            except Exception as exc:  # never silently: logged, counted, shown, and started again
                log.exception("thread_failed", thread="coordinator", error=str(exc), retry_in_s=backoff_s)
                self.store.incidents.record("coordinator", f"thread failed: {type(exc).__name__}: {exc}")
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, self.ttl_s)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="coord-step", initializer=name_pool_thread))
        self._steps = asyncio.Lock()
        self.etcd = Etcd(self.config)
        permit = asyncio.ensure_future(self._permit_loop())
        watch: asyncio.Future[None] | None = None
        try:
            await self.etcd.connect()
            if self.cluster is not None:
                watch = asyncio.ensure_future(self.cluster.follow(self.etcd))
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    await self._round()
                    self.error = self._waiting
                    self.store.incidents.clear("coordinator")
                except Unreachable as exc:
                    self._unreachable(str(exc))
                except BrokerError as exc:  # a role step refused (a full disk, ...): next round again
                    self.error = exc.message
                    self.store.incidents.record("coordinator", exc.message)
                except (rec.RecordError, ValueError) as exc:  # a value in etcd we do not understand: never trusted
                    self.error = f"a value under {self.etcd.prefix} is not understood: {exc}"[:300]
                    self.store.incidents.record("coordinator", self.error)
                await asyncio.sleep(max(0.0, self.tick_s - (time.monotonic() - t0)))
        finally:
            permit.cancel()
            if watch is not None:
                watch.cancel()
            if self.holding is not None:  # stop acknowledging before the lease (and the key) goes
                self._lost_key("the coordinator loop ended")
            await self._resign_on_stop()
            self.lease_id = 0
            await self.etcd.close()

    def held_leader_revision(self) -> int:
        """Our leader key's create revision while we hold it, else 0 (a write fenced by it, from
        another thread: a move's seal, ``replication/shards.py``)."""
        with self.state_lock:
            return self.leader_revision if self.holding is not None else 0

    def submit_on_loop(self, fn: Callable[[Etcd], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        """``fn(etcd)`` started on this loop from another thread, not waited for; UNAVAILABLE when
        this node has no loop (no etcd client) yet. The future fails with ``Unreachable`` when etcd
        does not answer within the client's timeout."""
        loop = self._loop
        if loop is None or loop.is_closed():
            raise BrokerError("UNAVAILABLE", "this node is not connected to etcd yet")

        async def call() -> T:
            return await fn(self.etcd)

        return asyncio.run_coroutine_threadsafe(call(), loop)

    def run_on_loop(self, fn: Callable[[Etcd], Coroutine[Any, Any, T]], timeout_s: float) -> T:
        """``fn(etcd)`` on this loop with its etcd client, from another thread (the shard placement's
        writes); UNAVAILABLE when etcd does not answer within ``timeout_s``."""
        future = self.submit_on_loop(fn)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise BrokerError("UNAVAILABLE", f"etcd did not answer within {timeout_s:g} s") from None
        except concurrent.futures.CancelledError:  # the loop stopped (or restarted) under the call
            raise BrokerError("UNAVAILABLE", "the etcd call was cancelled (the coordinator's loop restarted)") from None
        except Unreachable as exc:
            raise BrokerError("UNAVAILABLE", f"etcd: {exc}") from None

    async def _resign_on_stop(self) -> None:
        if self.lease_id:
            with contextlib.suppress(Exception):
                await self.etcd.revoke(self.lease_id)  # the leader and node keys go with it

    def _unreachable(self, why: str) -> None:
        if self.error != why:
            log.warning("coordinator_unreachable", error=why)
        self.error = why
        self.store.incidents.record("coordinator", f"etcd unreachable: {why}")

    def unreachable_ms(self) -> int:
        """How long etcd has not answered this node (0 while it does); slaves report it in acks."""
        if not self.last_ok:
            return int((time.monotonic() - self.started_at) * 1000)
        since = time.monotonic() - self.last_ok
        return 0 if since <= max(3 * self.tick_s, self.ttl_s / 4) else int(since * 1000)

    # -- one round --------------------------------------------------------------------------------
    async def _round(self) -> None:
        self._waiting = ""
        await self.etcd.authenticate()
        sent = time.monotonic()
        if not self.lease_id or not await self.etcd.renew(self.lease_id):
            if self.lease_id:
                log.warning("lease_lost", lease=self.lease_id)
                self._lost_key("etcd expired this node's lease")
            self.lease_id = await self.etcd.grant(max(1, round(self.ttl_s)))
            self._last_register = 0.0
        self.renewed_at = sent
        view = await self.etcd.view()
        self.last_ok = time.monotonic()
        self.view = view
        await self._register(view)
        with self.state_lock:
            self.members = rec.decode_insync(view.insync.value).members if view.insync.version else ()
            self.leader = rec.decode_leader(view.leader.value) if view.leader.version else None
        leader = self.leader
        if leader is None:
            if self.holding is not None:
                self._lost_key("the leader key is gone")
            await self._maybe_campaign(view)
        elif leader.node_id == self.node_id and view.leader.lease == self.lease_id:
            await self._lead(view, leader)
        elif leader.node_id == self.node_id:  # a previous incarnation of this node: its lease is dead
            log.info("revoking_stale_lease", lease=view.leader.lease)
            await self.etcd.revoke(view.leader.lease)
        else:
            if self.holding is not None:
                self._lost_key(f"{leader.node_id} holds the leader key")
            await self._follow(leader)

    async def _step(self, step: Callable[..., None], *args: Any) -> None:
        """A role step (they block: a follower stop joins its thread) off the loop, one at a time."""
        async with self._steps:
            await asyncio.to_thread(step, *args)

    async def _register(self, view: View) -> None:
        now = time.monotonic()
        mine = view.nodes.get(self.node_id)
        if mine is not None and mine.lease == self.lease_id and now - self._last_register < REGISTER_EVERY_S:
            return
        store = self.store
        max_epoch = store.epochs.highest()
        await self.etcd.register(rec.Node(self.node_id, self.client_address, self.replication_address, max_epoch,
                                          store.log.max_offset), self.lease_id)
        self._last_register = now

    # -- as a slave --------------------------------------------------------------------------------
    async def _follow(self, leader: rec.Leader) -> None:
        store = self.store
        if not self.roles.following(leader.replication):
            log.info("following", leader=leader.node_id, epoch=leader.epoch, address=leader.replication)
            await self._step(self.roles.follow, leader.replication)
        store.set_redirect(leader.client)

    def _hears_live_master(self) -> bool:
        """Streaming from a master that spoke within a quarter lease."""
        return self.roles.following_live_master(self.ttl_s * 1000 / 4)




    # -- as the master -------------------------------------------------------------------------------








    # -- switchover (tidemark promote / demote under a coordinator) ---------------------------------




    # -- status ----------------------------------------------------------------------------------
    def _status(self, st: dict[str, object]) -> None:
        permit = self.store.permit
        with self.state_lock:
            holding, leader, members = self.holding, self.leader, self.members
        remaining = permit.remaining_ms() if holding is not None else 0.0
        st["coordinator"] = {
            "connected": self.unreachable_ms() == 0 and bool(self.last_ok),
            "node_id": self.node_id,
            "cluster": self.config["coordinator.cluster"],
            "shard": self.config["coordinator.shard"],
            "leader": leader.node_id if leader else "",
            "leader_client": leader.client if leader else "",
            "epoch": leader.epoch if leader else 0,
            "lease_remaining_ms": round(remaining) if remaining != float("inf") else None,
            "insync": list(members),
            "failsafe": self.failsafe,
            "error": self.error,
        }
