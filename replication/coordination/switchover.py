"""Switchovers: promote and demote under a coordinator, and the master's hand-over."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog

from broker.errors import BrokerError
from replication.coordination import records as rec
from replication.coordination.etcd import Unreachable, View
from replication.coordination.state import CoordinatorBase

log = structlog.get_logger("replication.coordinator")

SWITCHOVER_WAIT_S = 10.0
SWITCHOVER_CATCH_UP_S = 5.0  # the master waits this long for the target to hold its whole log


class Switchover(CoordinatorBase):
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
                with self.state_lock:
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

    def promote_here(self, unclean: bool) -> int:
        """Ask the master to hand over to this node; returns the new epoch once we are master."""
        with self.state_lock:  # the checks and the permission see one state of the loop's
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
            with self.state_lock:
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
