"""Which shard coordinates a consumer group (docs/shards.md, "Groups across shards").

A group's coordinator is the shard of its **slot**, ``crc32c(group) % SLOTS``; etcd keeps the
slot -> shard map at ``/tidemark/<cluster>/slots/<slot>`` (``{"v": 1, "shard": ...}``). A slot
is given a shard the first time a group of it needs one: the shard with a master that holds
the fewest slots (ties to the lowest name), in an etcd transaction that requires the key
absent, so every node agrees whichever asks first. A shard that joins later takes the slots
still unassigned. The map never changes by itself afterwards: a group's members, assignment
and committed offsets stay on one shard across failovers (moving slots is a move, issue 39).
"""

from __future__ import annotations

import json

import crc32c

from replication.coordination.records import FORMAT_VERSION, RecordError

SLOTS = 256


def slot_of(group: str) -> int:
    return crc32c.crc32c(group.encode()) % SLOTS


def encode(shard: str) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, "shard": shard}, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes) -> str:
    try:
        shard = json.loads(raw)["shard"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise RecordError(f"not a slot record: {exc}") from None
    if not isinstance(shard, str) or not shard:
        raise RecordError("a slot record without a shard")
    return shard


def parse_key(name: str) -> int | None:
    """The slot of a key name ``slots/<n>`` (relative to the cluster's root); None if not one."""
    _, _, tail = name.partition("slots/")
    return int(tail) if tail.isdigit() and 0 <= int(tail) < SLOTS and name == f"slots/{int(tail)}" else None


def pick(held: dict[str, int], live: list[str]) -> str:
    """The shard for a new slot: among ``live`` shards (with a master), the one with the fewest
    slots in ``held``, ties to the lowest name."""
    if not live:
        raise ValueError("no shard with a master to coordinate groups")
    return min(sorted(live), key=lambda s: held.get(s, 0))
