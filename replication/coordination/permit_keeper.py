"""The write permit: granted from the lease, the failsafe while etcd is unreachable, self-fencing."""

from __future__ import annotations

import asyncio
import time

import structlog

from replication.coordination.state import CoordinatorBase

log = structlog.get_logger("replication.coordinator")

PERMIT_TICK_S = 0.05
FAILSAFE_ACK_S = 0.5  # the failsafe holds while the in-sync slave acknowledged hearing a message sent within this long


class PermitKeeper(CoordinatorBase):
    def _grant(self, renewed_at: float) -> None:
        until = renewed_at + self.ttl_s - self.margin_s
        if until > time.monotonic():
            self.failsafe = False
            self.store.permit.grant(until)

    def _lost_key(self, why: str) -> None:
        if self.holding is None:
            return
        log.warning("leadership_lost", reason=why, epoch=self.holding.epoch)
        with self.state_lock:
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
        with self.state_lock:
            self.holding = None
        permit.withdraw("this master could not renew its etcd lease and no in-sync slave is acknowledging")
        return True
