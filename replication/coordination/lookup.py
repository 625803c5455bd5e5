"""One-shot reads of etcd for code that runs before the daemon (a bootstrap looks up the master)."""

from __future__ import annotations

import asyncio

import structlog

from broker.config import Config
from broker.invariant import StartupRefused
from broker.storage.dirlock import DirLock
from replication import bootstrap
from replication.coordination import records as rec
from replication.coordination.etcd import Etcd, Unreachable
from replication.coordination.shard_keys import sharded_by

log = structlog.get_logger("replication.coordination")


def elected_master(config: Config) -> str:
    """The replication address of the master etcd names now ('' when none, or etcd does not answer)."""

    async def read() -> str:
        etcd = Etcd(config)
        try:
            await etcd.connect()
            await etcd.authenticate()
            view = await etcd.view()
        finally:
            await etcd.close()
        return rec.decode_leader(view.leader.value).replication if view.leader.version else ""

    try:
        return asyncio.run(read())
    except (Unreachable, rec.RecordError, OSError) as exc:
        log.warning("etcd_lookup_failed", error=str(exc))
        return ""


def check_shard(config: Config) -> None:
    """A one-pair node (``coordinator.shard = ""``) in a cluster of shards refuses to start: it
    would never be elected there (shard_keys.py), and its data belongs to a shard now."""
    if not config["coordinator.endpoints"] or config["coordinator.shard"]:
        return

    async def read() -> str | None:
        etcd = Etcd(config)
        try:
            await etcd.connect()
            await etcd.authenticate()
            return sharded_by(await etcd.view())
        finally:
            await etcd.close()

    try:
        marker = asyncio.run(read())
    except (Unreachable, rec.RecordError, OSError) as exc:  # the election's gate refuses it later
        log.warning("etcd_lookup_failed", error=str(exc))
        return
    if marker is not None:
        into = f"; this pair's keys were upgraded into shard {marker!r}: set coordinator.shard = {marker!r}" if marker else ""
        raise StartupRefused(f"coordinator.shard is empty (a one-pair cluster) but cluster "
                             f"{config['coordinator.cluster']!r} in etcd is a cluster of shards{into}")


def prestart(config: Config, lock: DirLock) -> None:
    """Entry point ``tidemark.prestart: replication``: the bootstrap, with etcd to find the master."""
    check_shard(config)
    bootstrap.prestart(config, lock, elected_master)
