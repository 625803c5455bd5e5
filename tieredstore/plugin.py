"""Entry point ``tidemark.plugins: tieredstore``: wires tiered storage into a daemon.

On both nodes: the read-through reader (a ``ColdReader``), the local retention floor (only
uploaded ranges may be deleted) and the status fields. On the master only: the uploader, started
on promotion and stopped on demotion (a role listener). See broker/ports.py. ``broker`` never imports this
package (DESIGN §9).
"""

from __future__ import annotations

import structlog

from broker.config import Config, tiering_enabled
from broker.daemon.plugins import PluginHost
from broker.invariant import StartupRefused
from broker.store import Store
from tieredstore import metrics
from tieredstore.backend import Backend
from tieredstore.cache import BlockCache
from tieredstore.index import ObjectIndex
from tieredstore.posix import PosixBackend
from tieredstore.reader import ColdReader
from tieredstore.uploader import Uploader

log = structlog.get_logger("tieredstore")


def make_backend(config: Config, node_id: str = "") -> Backend:
    """The backend the configuration names (tiering must be enabled)."""
    if config["tieredstore.backend"] == "s3":
        try:
            from tieredstore.s3 import S3Backend  # noqa: PLC0415 - boto3 takes ~0.35 s to import: only when used
        except ImportError as exc:
            raise StartupRefused(f"tieredstore.backend = \"s3\" needs boto3 ({exc}): pip install 'tidemark[s3]'") from None

        return S3Backend(
            bucket=config["tieredstore.s3_bucket"], prefix=config["tieredstore.s3_prefix"],
            endpoint=config["tieredstore.s3_endpoint"], region=config["tieredstore.s3_region"],
            access_key_id=config["tieredstore.s3_access_key_id"],
            secret_access_key=config["tieredstore.s3_secret_access_key"],
            retries_max=config["tieredstore.s3_retries_max"],
            on_retry=lambda op: metrics.BACKEND_ERRORS.labels(op).inc(),
        )
    return PosixBackend(config["tieredstore.root"], node_id)


class Tiering:
    """Tiered storage on one node: reader everywhere, uploader while master."""

    def __init__(self, store: Store, config: Config) -> None:
        self.store = store
        self.backend = make_backend(config, store.identity.node_id)
        self.index = ObjectIndex(self.backend)
        self.reader = ColdReader(store, self.backend, self.index, BlockCache(config["tieredstore.read_cache_bytes"]))
        self.uploader = Uploader(store, self.backend, self.index, config)

    def uploaded_offset(self) -> int:
        """Every log byte below this is in the object store (recorded in the log, or uploaded by us)."""
        return max(self.store.views.metadata.tiered_uploaded_offset, self.uploader.uploaded_offset)

    def on_role(self, role: str) -> None:
        if role == "master":
            self.uploader.start()
        else:
            self.uploader.stop()

    def start(self) -> None:
        if self.store.role == "master":
            self.uploader.start()

    def stop(self) -> None:
        self.uploader.close()
        self.backend.close()

    def status(self, st: dict[str, object]) -> None:
        uploaded = self.uploaded_offset()
        metrics.UPLOADED_OFFSET.set(uploaded)
        st["tiered_uploaded_offset"] = uploaded
        st["tiered"] = {
            "backend": self.backend.name,
            "recorded_offset": self.store.views.metadata.tiered_uploaded_offset,
            "uploading": self.uploader.running,
            "objects": len(self.index.objects()),
            "readable_min_offset": self.store.reads.readable_min_offset(),
            "read_cache_bytes": self.reader.cache.used_bytes,
            "gaps": self.uploader.gaps[:10],
            "error": self.uploader.last_error,
        }


def attach(daemon: PluginHost) -> None:
    store, config = daemon.store, daemon.config
    if not tiering_enabled(config):
        return
    tiering = Tiering(store, config)
    store.register_cold_reader(tiering.reader)
    store.register_retention_floor(tiering.uploaded_offset)
    store.register_status_provider(tiering.status)
    store.register_role_listener(tiering.on_role)
    daemon.on_start.append(tiering.start)
    daemon.on_stop.insert(0, tiering.stop)
    log.info("tiered_storage_attached", backend=tiering.backend.name)
