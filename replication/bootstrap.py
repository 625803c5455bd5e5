"""Bootstrap a slave before its store opens (run by ``coordination.lookup.prestart``, the entry point).

Runs when the daemon starts as a slave and either its data directory is new, or a previous run
marked it ``needs_bootstrap`` (its position was removed by the master's retention, or it
diverged below what its views applied: an unclean node). A marked directory is moved aside to
``<dir>.old-<unix time>`` (renamed, never deleted); then a snapshot bundle is installed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import grpc
import structlog

from broker import clock
from broker.config import Config
from broker.storage.dirlock import DirLock, only_lock_inside
from broker.store.recovery import is_new_data_dir
from replication import role_record
from replication.bundle import BundleError, install
from replication.channel import call_metadata, open_channel

log = structlog.get_logger("replication.bootstrap")
NEEDS_BOOTSTRAP = "needs_bootstrap"


def prestart(config: Config, lock: DirLock, elected_master: Callable[[Config], str] = lambda _: "") -> None:
    """Bootstrap an empty (or marked) directory from the master: ``node.master`` for a manual
    slave, the master ``elected_master`` finds in etcd under a coordinator."""
    role_record.check(config)  # a promote/demote the configuration does not reflect yet: refuse
    master = config["node.master"] if config["node.role"] == "slave" else ""
    if config["coordinator.endpoints"] and needs_bootstrap(config["node.data_dir"]):
        master = elected_master(config)  # the replication address of etcd's leader, if there is one
        if not master:
            log.warning("bootstrap_deferred", reason="etcd names no master to bootstrap from; starting as is")
            return
    if not master:
        return
    data_dir = config["node.data_dir"]
    if os.path.exists(os.path.join(data_dir, NEEDS_BOOTSTRAP)):
        aside = f"{data_dir.rstrip('/')}.old-{int(clock.wall_s())}"
        os.rename(data_dir, aside)
        log.warning("data_dir_moved_aside", data_dir=data_dir, moved_to=aside, reason="re-bootstrap")
    elif not is_new_data_dir(data_dir) or not only_lock_inside(data_dir):
        return
    t0 = time.monotonic()
    try:
        manifest = install(master, data_dir, lock, cluster_id=config["node.cluster_id"],
                           channel=lambda address: open_channel(config, address, [("grpc.max_receive_message_length", 64 << 20)]),
                           metadata=call_metadata(config))
    except (grpc.RpcError, BundleError, OSError) as exc:
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)  # type: ignore[attr-defined]
        log.warning("bootstrap_failed", master=master, error=detail,
                    note="starting empty; the follower will stream from the master's log start")
        return
    log.info("bootstrapped", seconds=round(time.monotonic() - t0, 3), snapshot_offset=manifest["snapshot_offset"],
             log_start=manifest["log_start"])


def needs_bootstrap(data_dir: str) -> bool:
    """Marked for a re-bootstrap, or new (an empty directory joining a running cluster)."""
    return os.path.exists(os.path.join(data_dir, NEEDS_BOOTSTRAP)) or (
        is_new_data_dir(data_dir) and only_lock_inside(data_dir))


def restart_for_bootstrap(data_dir: str, reason: str) -> None:
    """Mark the directory and re-execute the daemon: ``prestart`` then moves it aside and bootstraps."""
    with open(os.path.join(data_dir, NEEDS_BOOTSTRAP), "w") as f:
        f.write(reason + "\n")
        f.flush()
        os.fsync(f.fileno())
    log.warning("restarting_for_bootstrap", reason=reason)
    os.execv(sys.executable, [sys.executable, "-m", "broker.cli", *sys.argv[1:]])
