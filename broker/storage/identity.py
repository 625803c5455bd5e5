"""Data-directory identity: cluster id and node id, persisted with the atomic-file helper.

Spec: docs/formats/small-file.md (the `identity` row) and docs/formats/README.md (new directories).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass

from broker.invariant import StartupRefused
from broker.storage import atomic_file

MAGIC = b"TMID"
VERSION = 1
FILE_NAME = "identity"


@dataclass(frozen=True)
class Identity:
    cluster_id: str
    node_id: str


def adopt_cluster(data_dir: str, cluster_id: str) -> Identity:
    """An empty slave joins its master's cluster (only before it holds any data)."""
    path = os.path.join(data_dir, FILE_NAME)
    loaded = atomic_file.load(path, MAGIC, VERSION)
    node_id = json.loads(loaded.payload)["node_id"] if loaded else uuid.uuid4().hex[:12]
    ident = Identity(cluster_id, str(node_id))
    atomic_file.persist(path, MAGIC, VERSION, json.dumps(ident.__dict__).encode())
    return ident


def load_or_create(data_dir: str, *, is_new: bool, cluster_id: str = "", node_id: str = "") -> Identity:
    path = os.path.join(data_dir, FILE_NAME)
    loaded = atomic_file.load(path, MAGIC, VERSION)
    if loaded is None:
        if not is_new:
            raise StartupRefused(
                f"{path}: no valid identity file in a data directory that holds data; "
                "restore it from backup (or from its .broken copy after inspection)"
            )
        ident = Identity(cluster_id or uuid.uuid4().hex, node_id or uuid.uuid4().hex[:12])
        atomic_file.persist(path, MAGIC, VERSION, json.dumps(ident.__dict__).encode())
        return ident
    data = json.loads(loaded.payload)
    ident = Identity(str(data["cluster_id"]), str(data["node_id"]))
    if cluster_id and cluster_id != ident.cluster_id:
        raise StartupRefused(f"{path}: data directory belongs to cluster {ident.cluster_id}, config says {cluster_id}")
    return ident
