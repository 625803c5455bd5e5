"""How a pair's keys stand beside the cluster's other pairs (docs/shards.md): the gate before a
campaign, and the upgrade in place of a one-pair cluster's keys into a shard's.

A one-pair node (``coordinator.shard = ""``) never campaigns in a cluster whose root holds the
``sharded`` marker: its keys at the root would be a second, unrelated election beside the shards'.
A shard's node never campaigns while a one-pair cluster's keys stand at the root; a node of that
pair (its log holds epochs, none above the root's epoch counter) restarted with a shard upgrades
them once the pair's master has stopped (the root's leader key is gone): the epoch counter and
the in-sync set move into the shard's keys in one transaction (``Etcd.upgrade_pair``), so epochs
keep growing and only the pair's in-sync nodes may be elected. A new shard's node (no epochs of
its own) waits until the pair was upgraded.
"""

from __future__ import annotations

import structlog

from replication.coordination import records as rec
from replication.coordination.etcd import Etcd, View

log = structlog.get_logger("replication.coordinator")


def sharded_by(view: View) -> str | None:
    """The root's ``sharded`` marker: None when absent, else the shard a one-pair cluster's keys
    were upgraded into ('' when none was)."""
    return rec.decode_sharded(view.sharded.value).upgraded_from_pair if view.sharded.version else None


async def campaign_gate(etcd: Etcd, view: View, highest_epoch: int) -> str:
    """Why the cluster's keys keep this node from campaigning now ('' when they do not). May
    upgrade a one-pair cluster's keys into this node's shard (then the next round campaigns)."""
    if not etcd.shard:
        marker = sharded_by(view)
        if marker is None:
            return ""
        into = f" (its one-pair keys moved into shard {marker!r})" if marker else ""
        return (f"cluster {etcd.root!r} is a cluster of shards{into}: a node with coordinator.shard = \"\" never "
                "campaigns in it; set coordinator.shard")
    if not view.pair_epoch.version:
        return ""
    pair_epoch = int(view.pair_epoch.value)
    if not 0 < highest_epoch <= pair_epoch:
        return (f"a one-pair cluster's keys stand at {etcd.root} (epoch {pair_epoch}): restart that pair's nodes "
                "with coordinator.shard first; a new shard waits until then")
    if view.pair_leader.version:
        return (f"a one-pair master still holds {etcd.root}leader: its keys move into shard {etcd.shard!r} once "
                "it has stopped (restart its nodes with coordinator.shard)")
    if not await etcd.upgrade_pair(view):
        return "the one-pair keys changed while upgrading them; again next round"
    log.warning("pair_upgraded_to_shard", shard=etcd.shard, epoch=pair_epoch, root=etcd.root)
    return f"upgraded the one-pair cluster's keys into shard {etcd.shard!r}; the election follows"
