"""The coordinator: this node's lease, the election, the write permit and the in-sync set in etcd.

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
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog

from broker import metrics
from broker.config import Config
from broker.errors import BrokerError
from broker.store import Store
from broker.threads import NamedThread, name_pool_thread
from replication.confirm import InSyncSet
from replication.coordination import records as rec
from replication.coordination.etcd import Etcd, Unreachable, View
from replication.roles import RoleController

log = structlog.get_logger("replication.coordinator")

PERMIT_TICK_S = 0.05
FAILSAFE_ACK_S = 0.5  # the failsafe holds while the in-sync slave acknowledged hearing a message sent within this long
REGISTER_EVERY_S = 1.0
SWITCHOVER_WAIT_S = 10.0
SWITCHOVER_CATCH_UP_S = 5.0  # the master waits this long for the target to hold its whole log


class Coordinator:
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
        # state, written by the loop thread; read by status and the permit
        self.lease_id = 0
        self.renewed_at = 0.0  # monotonic: when the last successful keep-alive (or grant) was sent
        self.last_ok = 0.0  # monotonic: the last etcd answer
        self.started_at = time.monotonic()
        self.holding: rec.Leader | None = None  # our leader record, while the key is ours
        self.leader_revision = 0
        self.view: View | None = None
        self.leader: rec.Leader | None = None
        self.members: tuple[str, ...] = ()
        self.failsafe = False
        self.error = ""
        self.unclean_once = False
        self._last_register = 0.0
        self._handing_over_since = 0.0
        self.switchover_failure: tuple[float, str] = (0.0, "")  # (monotonic time, why) of the last one ended
        self._lost_at = 0.0  # monotonic: when this master lost the leader key
        self._taking_office = False  # the key is ours and become_master runs: role and holding disagree
        self._waiting = ""  # why we do not campaign (logged when it changes)
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = NamedThread(target=self._run, name="coordinator", daemon=True)
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
        try:
            await self.etcd.connect()
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
            if self.holding is not None:  # stop acknowledging before the lease (and the key) goes
                self._lost_key("the coordinator loop ended")
            await self._resign_on_stop()
            self.lease_id = 0
            await self.etcd.close()

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
        max_epoch = max([store.epoch, *(e for e, _ in store.epochs.snapshot())])
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

    def _eligible(self, view: View) -> str:
        """Why this node may not campaign now ('' when it may)."""
        store = self.store
        if view.switchover.version:  # the master handed over (and stopped streaming) to its target
            target = rec.decode_switchover(view.switchover.value).target
            if target != self.node_id and target in view.nodes:  # a target whose lease ended is gone
                return f"a switchover to {target} is under way"
            # the target: the resigning master put it in the in-sync set; membership still decides
        elif self._hears_live_master():
            return "it still hears a live master"
        if self.members:
            if self.node_id in self.members:
                return ""
            if not (self.config["coordinator.unclean_election"] or self.unclean_once):
                return f"not in the in-sync set {list(self.members)} (coordinator.unclean_election is off)"
            alive = [m for m in self.members if m in view.nodes]
            if alive:
                return f"in-sync members {alive} are alive"
            return "" if time.monotonic() - self.started_at >= self.ttl_s else "waiting a lease's time for members"
        # a new cluster: the node with the most data goes first, once everyone had time to register
        if time.monotonic() - self.started_at < self.ttl_s:
            return "a new cluster: waiting a lease's time for the other nodes to register"
        mine = (max([store.epoch, *(e for e, _ in store.epochs.snapshot())]), store.log.max_offset)
        for node_id, entry in view.nodes.items():
            if node_id == self.node_id:
                continue
            with contextlib.suppress(rec.RecordError):
                other = rec.decode_node(entry.value)
                if (other.max_epoch, other.log_end, self.node_id) > (mine[0], mine[1], node_id):
                    return f"a new cluster: {node_id} holds more data"
        return ""

    async def _maybe_campaign(self, view: View) -> None:
        store = self.store
        epoch_in_etcd = int(view.epoch.value or b"0") if view.epoch.version else 0
        if (store.role == "master" and store.epoch == epoch_in_etcd and not view.switchover.version
                and self.node_id in (self.members or (self.node_id,))):
            await self._campaign(view, store.epoch, retake=True)  # our own epoch: nobody was elected meanwhile
            return
        if store.role == "master":  # a newer epoch exists, or we left the in-sync set: not ours to retake
            await self._step(self.roles.step_down, f"etcd's epoch {epoch_in_etcd} is not ours ({store.epoch})")
        why = self._eligible(view)
        if why:
            if why != self._waiting:
                log.info("not_campaigning", reason=why)
            self._waiting = why
            return
        self._waiting = ""
        epoch = max([epoch_in_etcd, store.epoch, *(e for e, _ in store.epochs.snapshot())]) + 1
        await self._campaign(view, epoch, retake=False)

    async def _campaign(self, view: View, epoch: int, *, retake: bool) -> None:
        leader = rec.Leader(self.node_id, epoch, self.client_address, self.replication_address)
        sent = self.renewed_at
        if not retake:
            await self._step(self.roles.stop_following)  # our log must not move under the new epoch
        insync = None if retake else rec.InSync(epoch, (self.node_id,))
        revision = await self.etcd.campaign(view, leader, self.lease_id, insync)
        if not revision:
            log.info("campaign_lost", epoch=epoch)
            return
        self.leader_revision = revision
        if not retake:
            self.members = (self.node_id,)
            await self._take_office(leader)
        else:
            self.insync.set_pins({m for m in self.members if m != self.node_id})
            self.holding = self.leader = leader
        self.unclean_once = False
        self.store.set_redirect("")
        self._grant(sent)
        log.info("elected" if not retake else "leader_key_retaken", epoch=epoch, log_end=self.store.log.max_offset,
                 insync=list(self.members))

    # -- as the master -------------------------------------------------------------------------------
    async def _take_office(self, leader: rec.Leader) -> None:
        """The key is ours at a new epoch: become master here, then hold it. Between the role change
        (in a worker thread) and ``holding`` the permit loop would see a master without the key, and
        one whose key was lost long ago: it stepped the new master down at once (an election lost
        and won again half a second later, a failover 0.5 s longer). It decides nothing meanwhile."""
        self.insync.set_pins({m for m in self.members if m != self.node_id})
        self._taking_office = True
        try:
            await self._step(self.roles.become_master, leader.epoch)
            metrics.FAILOVERS.inc()
            self.holding = self.leader = leader
        finally:
            self._taking_office = False

    async def _lead(self, view: View, leader: rec.Leader) -> None:
        store = self.store
        known = max([store.epoch, *(e for e, _ in store.epochs.snapshot())])
        if self.holding is None and store.role == "slave" and leader.epoch > known:
            log.info("campaign_answer_lost", epoch=leader.epoch, note="the key is ours: finishing the election")
            self.leader_revision = view.leader.create_revision
            await self._take_office(leader)
            self._grant(self.renewed_at)
            return
        if self.holding is None or store.role != "master" or store.epoch != leader.epoch:
            # our key from before a restart of the loop state, at an epoch we no longer lead: let it go
            log.warning("releasing_stale_key", epoch=leader.epoch, our_epoch=store.epoch, role=store.role)
            await self.etcd.resign(view.leader.create_revision)
            self._lost_key("stale leader key released")
            return
        self.leader_revision = view.leader.create_revision
        if view.switchover.version and await self._hand_over(view):
            return
        self._grant(self.renewed_at)
        await self._maintain_insync()

    async def _hand_over(self, view: View) -> bool:
        """A switchover to another node: stop acknowledging, wait until the target holds our whole
        log, then give the key up with the target in the in-sync set. True while it goes on."""
        try:
            request = rec.decode_switchover(view.switchover.value)
        except rec.RecordError:
            request = rec.Switchover("", -1)
        store = self.store
        if request.target == self.node_id or request.epoch != store.epoch or request.target not in view.nodes:
            why = "stale, to ourselves, or to a node that is not registered in etcd"
            log.warning("switchover_refused", target=request.target, epoch=request.epoch, reason=why)
            self.switchover_failure = (time.monotonic(), f"refused: {why}")
            await self.etcd.cancel_switchover(view.switchover.version)
            self._handing_over_since = 0.0
            return False
        # a target that does not follow us yet (None: it may be stepping down from a switchover that
        # just ended) gets the same catch-up window as one that follows but lags
        target = self.insync.replicas.get(request.target)
        if target is not None and not target.connected:
            target = None
        now = time.monotonic()
        if not self._handing_over_since:
            self._handing_over_since = now
            log.info("handing_over", target=request.target, log_end=store.log.max_offset)
        node = view.nodes.get(request.target)
        with contextlib.suppress(rec.RecordError):
            store.set_redirect(rec.decode_node(node.value).client if node else "")
        store.permit.withdraw(f"handing the mastership over to {request.target}")
        if target is not None and target.acked_offset >= store.log.max_offset:
            members = tuple(sorted({*self.members, request.target, self.node_id}))  # we hold it all too
            if await self.etcd.resign(self.leader_revision, rec.InSync(store.epoch, members)):
                self._handing_over_since = 0.0
                self.holding = None
                await self._step(self.roles.step_down, f"handed over to {request.target}")
                log.info("handed_over", target=request.target, log_end=store.log.max_offset)
            return True
        if now - self._handing_over_since > SWITCHOVER_CATCH_UP_S:
            log.warning("switchover_abandoned", target=request.target, acked=target.acked_offset if target else -1,
                        log_end=store.log.max_offset)
            self.switchover_failure = (now, f"abandoned: {request.target} did not follow and hold our whole log "
                                            f"within {SWITCHOVER_CATCH_UP_S:.0f} s")
            await self.etcd.cancel_switchover(view.switchover.version)
            self._handing_over_since = 0.0
            return False
        return True

    async def _maintain_insync(self) -> None:
        """Shrink the recorded set (then unpin) for a member that stopped keeping up; grow it (pin
        first) for a slave that caught up."""
        members = set(self.members) | {self.node_id}
        # the pins follow what etcd says (an earlier change whose answer was lost is settled here)
        self.insync.set_pins(members - {self.node_id})
        now = time.monotonic()
        replicas = {r.node_id: r for r in self.insync.replicas.values()}
        out_of_sync = set()
        for m in members - {self.node_id}:
            r = replicas.get(m)
            if r is None or not r.in_sync or (not r.connected and now - r.last_ack_at > self.ttl_s / 2):
                out_of_sync.add(m)
        wm = self.store.watermarks
        caught_up = {r.node_id for r in replicas.values()
                     if r.node_id not in members and r.connected and r.in_sync and not r.evicted
                     and r.acked_offset >= wm.confirm_offset}
        for m in caught_up:
            self.insync.pin(m)  # from now on nothing is confirmed past what it acknowledged ...
        # ... and it holds everything confirmed before: only then may etcd let it be elected. The
        # confirm offset is computed under the watermark lock: recomputing it here waits out any
        # computation that started before the pin
        if caught_up:
            wm.advance_confirm()
        lagging = {m for m in caught_up if replicas[m].acked_offset < wm.confirm_offset}
        for m in lagging:
            self.insync.unpin(m)
        caught_up -= lagging
        if not out_of_sync and not caught_up:
            return
        wanted = tuple(sorted((members - out_of_sync) | caught_up))
        if await self.etcd.set_insync(self.leader_revision, rec.InSync(self.store.epoch, wanted)):
            self.members = wanted
            for m in out_of_sync:
                self.insync.unpin(m)
            log.info("insync_changed", members=list(wanted), removed=sorted(out_of_sync), added=sorted(caught_up))
        else:
            for m in caught_up:
                self.insync.unpin(m)

    def _grant(self, renewed_at: float) -> None:
        until = renewed_at + self.ttl_s - self.margin_s
        if until > time.monotonic():
            self.failsafe = False
            self.store.permit.grant(until)

    def _lost_key(self, why: str) -> None:
        if self.holding is None:
            return
        log.warning("leadership_lost", reason=why, epoch=self.holding.epoch)
        self.holding = None
        self._lost_at = time.monotonic()
        self._handing_over_since = 0.0
        self.store.permit.withdraw(f"this node lost the leader key ({why})")

    async def _permit_loop(self) -> None:
        while True:
            await asyncio.sleep(PERMIT_TICK_S)
            if self._check_permit():
                await self._step(self.roles.step_down, "lease lapsed")

    def _check_permit(self) -> bool:
        """Grant (failsafe) or withdraw the permit; True when this master must step down."""
        store, permit = self.store, self.store.permit
        if self._taking_office:
            return False
        if self.holding is None:
            if store.role == "master":
                permit.withdraw(permit.reason or "this node does not hold the leader key")
                # not re-taken within a lease's time (etcd unreachable): stop streaming, so that the
                # slave, which still hears us, may campaign
                return time.monotonic() - self._lost_at > self.ttl_s
            return False
        now = time.monotonic()
        normal_until = self.renewed_at + self.ttl_s - self.margin_s
        if now < normal_until - 2 * PERMIT_TICK_S:
            return False  # the etcd loop grants it; nothing to do (the failsafe takes over just before it ends)
        if self._handing_over_since:  # a hand-over withdrew the permit: it stays withdrawn
            return False
        # the failsafe holds while an in-sync slave acknowledges. Whether that slave reaches etcd or
        # not, it does not campaign while it hears us; if it stops hearing us it stops acknowledging,
        # and every ack mode waits for it: what we acknowledge is on the node that could be elected.
        # (Requiring the slave to have lost etcd too made a master that reconnected to a restarted
        # etcd more slowly than its slave step down for nothing.)
        # the slave heard us at or after ``heard`` (our stamp, echoed) and campaigns only after a
        # quarter lease of silence from then on: the failsafe ends before that
        heard = max((r.heard_sent_at for r in self.insync.replicas.values()
                     if r.node_id in self.insync.pinned and r.connected and not r.evicted), default=0.0)
        window_s = min(FAILSAFE_ACK_S, self.ttl_s / 4 - PERMIT_TICK_S)
        if now - heard < window_s:
            if not self.failsafe:
                log.warning("failsafe", note="etcd unreachable: acknowledging only what the in-sync slave holds")
            self.failsafe = True
            permit.grant(max(normal_until, heard + window_s), strict=True)
            return False
        if self.failsafe or permit.valid() or not permit.reason:
            log.warning("self_fenced", reason="lease not renewed and no in-sync slave acknowledging")
        self.failsafe = False
        self.holding = None
        permit.withdraw("this master could not renew its etcd lease and no in-sync slave is acknowledging")
        return True

    # -- switchover (tidemark promote / demote under a coordinator) ---------------------------------
    def promote_here(self, unclean: bool) -> int:
        """Ask the master to hand over to this node; returns the new epoch once we are master."""
        if self.store.role == "master" and self.holding is not None:
            raise BrokerError("FAILED_PRECONDITION", "already the master")
        if self.leader is None and self.members and self.node_id not in self.members and not unclean:
            raise BrokerError("FAILED_PRECONDITION", f"this node is not in the in-sync set {list(self.members)} "
                              "recorded in etcd: electing it could lose acknowledged writes; use --unclean to force")
        self.unclean_once = unclean
        try:
            self._call(self._request_switchover(self.node_id))
            deadline = time.monotonic() + SWITCHOVER_WAIT_S
            while time.monotonic() < deadline:
                if self.store.role == "master" and self.holding is not None:
                    self.roles.wait_views_caught_up()  # in the caller's thread, not the etcd round
                    return self.store.epoch
                time.sleep(0.05)
            raise BrokerError("DEADLINE_EXCEEDED", f"not elected within {SWITCHOVER_WAIT_S:.0f} s: {self.error or 'unknown'}")
        finally:
            self.unclean_once = False  # the permission to lose data lasts for this one call

    def demote_here(self, master: str) -> None:
        """Hand the mastership over to the node at ``master`` (its client or replication address)."""
        view = self.view
        target = ""
        for node_id, entry in (view.nodes.items() if view else []):
            with contextlib.suppress(rec.RecordError):
                n = rec.decode_node(entry.value)
                if master in (n.client, n.replication) and node_id != self.node_id:
                    target = node_id
        if not target:
            raise BrokerError("NOT_FOUND", f"no registered node at {master}: etcd knows "
                              f"{sorted(view.nodes) if view else []}")
        if self.holding is None:
            raise BrokerError("FAILED_PRECONDITION", "this node is not the master")
        asked_at = time.monotonic()
        self._call(self._request_switchover(target))
        deadline = asked_at + SWITCHOVER_WAIT_S
        while time.monotonic() < deadline:
            if self.store.role == "slave" and self.leader is not None and self.leader.node_id == target:
                return
            failed_at, why = self.switchover_failure
            if failed_at >= asked_at:
                raise BrokerError("FAILED_PRECONDITION", f"the switchover to {target} was {why}")
            time.sleep(0.05)
        raise BrokerError("DEADLINE_EXCEEDED", f"the switchover to {target} did not finish within "
                          f"{SWITCHOVER_WAIT_S:.0f} s: {self.error or 'unknown'}")

    def _call(self, coro: Any) -> Any:
        loop = self._loop
        if loop is None:
            coro.close()
            raise BrokerError("UNAVAILABLE", "the coordinator has not connected to etcd yet")
        try:
            return asyncio.run_coroutine_threadsafe(coro, loop).result(SWITCHOVER_WAIT_S)
        except Unreachable as exc:
            raise BrokerError("UNAVAILABLE", f"etcd: {exc}") from None

    async def _request_switchover(self, target: str) -> None:
        view = await self.etcd.view()
        epoch = int(view.epoch.value or b"0") if view.epoch.version else 0
        if not await self.etcd.request_switchover(rec.Switchover(target, epoch), self.lease_id):
            raise BrokerError("FAILED_PRECONDITION", "another switchover is under way")
        log.info("switchover_requested", target=target, epoch=epoch)

    # -- status ----------------------------------------------------------------------------------
    def _status(self, st: dict[str, object]) -> None:
        permit = self.store.permit
        remaining = permit.remaining_ms() if self.holding is not None else 0.0
        st["coordinator"] = {
            "connected": self.unreachable_ms() == 0 and bool(self.last_ok),
            "node_id": self.node_id,
            "leader": self.leader.node_id if self.leader else "",
            "leader_client": self.leader.client if self.leader else "",
            "epoch": self.leader.epoch if self.leader else 0,
            "lease_remaining_ms": round(remaining) if remaining != float("inf") else None,
            "insync": list(self.members),
            "failsafe": self.failsafe,
            "error": self.error,
        }

