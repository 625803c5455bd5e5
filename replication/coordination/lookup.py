"""One-shot reads of etcd for code that runs before the daemon (a bootstrap looks up the master)."""

from __future__ import annotations

import asyncio

import structlog

from broker.config import Config
from broker.storage.dirlock import DirLock
from replication import bootstrap
from replication.coordination import records as rec
from replication.coordination.etcd import Etcd, Unreachable

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


def prestart(config: Config, lock: DirLock) -> None:
    """Entry point ``tidemark.prestart: replication``: the bootstrap, with etcd to find the master."""
    bootstrap.prestart(config, lock, elected_master)
