"""The in-sync set in etcd: shrunk before the master confirms without a member, grown after pinning."""

from __future__ import annotations

import time

import structlog

from replication.coordination import records as rec
from replication.coordination.state import CoordinatorBase

log = structlog.get_logger("replication.coordinator")



class InSyncKeeper(CoordinatorBase):
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
            with self.state_lock:
                self.members = wanted
            for m in out_of_sync:
                self.insync.unpin(m)
            log.info("insync_changed", members=list(wanted), removed=sorted(out_of_sync), added=sorted(caught_up))
        else:
            for m in caught_up:
                self.insync.unpin(m)
