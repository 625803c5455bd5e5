"""Who may campaign, the campaign, taking office, and holding the key (see coordinator.py's docstring)."""

from __future__ import annotations

import contextlib
import time

import structlog

from broker import metrics
from replication.coordination import records as rec
from replication.coordination.etcd import Unreachable, View
from replication.coordination.shard_keys import campaign_gate
from replication.coordination.state import CoordinatorBase

log = structlog.get_logger("replication.coordinator")



class Election(CoordinatorBase):
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
        mine = (store.epochs.highest(), store.log.max_offset)
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
        gate = await campaign_gate(self.etcd, view, store.epochs.highest())
        if gate:
            if gate != self._waiting:
                log.warning("not_campaigning", reason=gate)
            self._waiting = gate
            return
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
        epoch = max(epoch_in_etcd, store.epochs.highest()) + 1
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
            with self.state_lock:
                self.members = (self.node_id,)
            await self._take_office(leader)
        else:
            self.insync.set_pins({m for m in self.members if m != self.node_id})
            with self.state_lock:
                self.holding = self.leader = leader
        with self.state_lock:
            self.unclean_once = False
        self.store.set_redirect("")
        self._grant(sent)
        with contextlib.suppress(Unreachable):  # else the next round's _lead publishes it
            await self._publish_topology(view, leader)
        log.info("elected" if not retake else "leader_key_retaken", epoch=epoch, log_end=self.store.log.max_offset,
                 insync=list(self.members))

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
            with self.state_lock:
                self.holding = self.leader = leader
        finally:
            self._taking_office = False

    async def _lead(self, view: View, leader: rec.Leader) -> None:
        store = self.store
        known = store.epochs.highest()
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
        await self._publish_topology(view, leader)

    async def _publish_topology(self, view: View, leader: rec.Leader) -> None:
        """A shard's master keeps ``topology/<shard>`` (where the shard serves) current: written
        when elected (a new lease) and when its nodes' addresses change; gone with its lease."""
        if not self.config["coordinator.shard"]:
            return
        nodes = {leader.client}
        for entry in view.nodes.values():
            try:
                nodes.add(rec.decode_node(entry.value).client)
            except rec.RecordError:
                continue
        record = rec.encode(rec.Topology(self.node_id, leader.epoch, leader.client, tuple(sorted(nodes))))
        if self._topology_published != (self.lease_id, record):
            await self.etcd.publish_topology(rec.decode_topology(record), self.lease_id)
            self._topology_published = (self.lease_id, record)
