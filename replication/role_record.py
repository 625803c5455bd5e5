"""A promote or demote outlives the process (spec: docs/formats/role-change.md).

The role is configuration (``node.role``, ``node.master``), but promote and demote change it at
run time. If the configuration is not edited to match and the daemon restarts (a crash, systemd's
``Restart=on-failure``), a demoted master would come back as a master next to the promoted one.
So each runtime change is recorded in the data directory, and a start whose configuration
disagrees with the record is refused (exit 2) with what to change. A start that agrees removes
the record: the configuration has caught up, and later edits are the operator's again.
"""

from __future__ import annotations

import json
import os
import time

from broker import clock
from broker.config import Config, ConfigError
from broker.storage import atomic_file

MAGIC = b"TMRC"
VERSION = 1
FILE_NAME = "role_change"


def record(data_dir: str, role: str, master: str, epoch: int) -> None:
    payload = {"role": role, "master": master, "epoch": epoch, "time_ms": clock.wall_ms()}
    atomic_file.persist(os.path.join(data_dir, FILE_NAME), MAGIC, VERSION, json.dumps(payload).encode())


def check(config: Config) -> None:
    """Refuse a start whose ``node.role``/``node.master`` contradict the last runtime role change."""
    path = os.path.join(config["node.data_dir"], FILE_NAME)
    if config["coordinator.endpoints"]:  # the election decides the role; a manual change is history
        return
    if not atomic_file.exists_any(path):
        return
    loaded = atomic_file.load(path, MAGIC, VERSION)
    if loaded is None:
        return  # quarantined as .broken by load(): nothing trustworthy to compare with
    rec = json.loads(loaded.payload)
    role, master = rec["role"], rec["master"]
    agrees = config["node.role"] == role and (role == "master" or config["node.master"] == master)
    if agrees:
        for suffix in ("", ".bak"):
            if os.path.exists(path + suffix):
                os.unlink(path + suffix)
        return
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rec["time_ms"] / 1000))
    configured = config["node.role"] + (f" of {config['node.master']}" if config["node.role"] == "slave" else "")
    if role == "master":
        # The record is only what this node knew when it stopped: another node may have become
        # master since. Never advise "master" blindly: two masters would follow.
        raise ConfigError(
            f"node.role: this node became master at run time (epoch {rec['epoch']}, {when}) but the configuration "
            f"says {configured}; first check the other node (tidemark status): if it is master now (a higher epoch), "
            f"remove {path} and start this node as configured (a slave); only if no other node is master, set "
            'node.role = "master"')
    raise ConfigError(
        f"node.role: this node became a slave of {master} at run time (epoch {rec['epoch']}, {when}) but the "
        f'configuration says {configured}; set node.role = "slave", node.master = "{master}" (starting it as a '
        f"master would make a second master), or, to follow another master, remove {path} after checking which "
        "node is master (tidemark status)")
