"""What lives in etcd under ``/tidemark/<cluster>/`` (spec: docs/formats/etcd-keys.md).

``leader``      bound to the master's lease: who is master, in which epoch, at which addresses.
``epoch``       the highest epoch ever taken (no lease): raised in the transaction that writes
                ``leader``, so two masters can never share an epoch.
``insync``      the in-sync set (no lease): the nodes that hold everything confirmed; only they may
                be elected (unless ``unclean_election``). Written only by the master, compared
                against its ``leader`` key.
``nodes/<id>``  bound to each node's lease: its addresses and what it holds (max epoch, log end),
                for the first election of a new cluster and for switchovers.
``switchover``  bound to the requester's lease: hand the mastership to ``target``.

A pair with ``coordinator.shard`` set keeps the same keys under ``/tidemark/<cluster>/shards/<shard>/``
(docs/shards.md); the cluster's root then holds ``sharded`` (no lease), which keeps a one-pair node
(shard "") from ever campaigning in a cluster of shards, and records which shard a one-pair
cluster's keys were upgraded into; ``topology/<shard>`` (bound to the shard master's lease) says
where the shard serves: its master and its nodes' client addresses, written by the master when
elected and when its nodes change. Every node watches ``topics/`` and ``topology/`` only (one
range: nothing sorts between them), never the shards' own keys, whose node records are rewritten
every second: a watch of those would send every node each other node's heartbeat.

Values are JSON objects, one per key; unknown fields are ignored (a newer node may add some).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1


def prefix(cluster: str, shard: str = "") -> str:
    """Where a pair's keys live: the cluster's root for a one-pair cluster, else its shard's."""
    return f"/tidemark/{cluster}/shards/{shard}/" if shard else f"/tidemark/{cluster}/"


@dataclass(frozen=True)
class Sharded:
    upgraded_from_pair: str = ""  # the shard a one-pair cluster's keys moved into ("": none did)


@dataclass(frozen=True)
class Leader:
    node_id: str
    epoch: int
    client: str  # where writers go
    replication: str  # where slaves follow


@dataclass(frozen=True)
class InSync:
    epoch: int  # the epoch of the master that wrote it
    members: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Node:
    node_id: str
    client: str
    replication: str
    max_epoch: int = 0
    log_end: int = 0


@dataclass(frozen=True)
class Switchover:
    target: str  # node id that should become master
    epoch: int  # the epoch it replaces (a stale request for an older epoch is ignored)


@dataclass(frozen=True)
class Topology:
    node_id: str  # the shard's master
    epoch: int
    client: str  # where writers go
    nodes: tuple[str, ...] = ()  # every node's client address (the master's among them)


def topology_key(cluster: str, shard: str) -> str:
    return f"/tidemark/{cluster}/topology/{shard}"


def encode(record: Leader | InSync | Node | Switchover | Sharded | Topology) -> bytes:
    body: dict[str, Any] = {"v": FORMAT_VERSION, **asdict(record)}
    if isinstance(record, InSync):
        body["members"] = sorted(record.members)
    return json.dumps(body, sort_keys=True).encode()


class RecordError(ValueError):
    """A value in etcd that is not what this version writes (shown to the operator, never trusted)."""


def _fields(raw: bytes, names: tuple[str, ...]) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"not JSON: {exc}") from None
    if not isinstance(body, dict) or any(n not in body for n in names):
        raise RecordError(f"expected an object with {', '.join(names)}")
    return body


def decode_leader(raw: bytes) -> Leader:
    b = _fields(raw, ("node_id", "epoch", "client", "replication"))
    return Leader(str(b["node_id"]), int(b["epoch"]), str(b["client"]), str(b["replication"]))


def decode_insync(raw: bytes) -> InSync:
    b = _fields(raw, ("epoch", "members"))
    return InSync(int(b["epoch"]), tuple(str(m) for m in b["members"]))


def decode_node(raw: bytes) -> Node:
    b = _fields(raw, ("node_id", "client", "replication"))
    return Node(str(b["node_id"]), str(b["client"]), str(b["replication"]), int(b.get("max_epoch", 0)),
                int(b.get("log_end", 0)))


def decode_sharded(raw: bytes) -> Sharded:
    b = _fields(raw, ())
    return Sharded(str(b.get("upgraded_from_pair", "")))


def decode_topology(raw: bytes) -> Topology:
    b = _fields(raw, ("node_id", "epoch", "client", "nodes"))
    if not isinstance(b["nodes"], list):
        raise RecordError("nodes: expected a list")
    try:  # every node reads this key: a bad value must not stop a node's copy of the cluster
        return Topology(str(b["node_id"]), int(b["epoch"]), str(b["client"]), tuple(str(n) for n in b["nodes"]))
    except (TypeError, ValueError) as exc:
        raise RecordError(f"not a topology: {exc}") from None


def decode_switchover(raw: bytes) -> Switchover:
    b = _fields(raw, ("target", "epoch"))
    return Switchover(str(b["target"]), int(b["epoch"]))
