"""Which shard coordinates a consumer group (docs/shards.md, "Groups across shards").

A group's coordinator is the shard of its **slot**, ``crc32c(group) % SLOTS``; etcd keeps the
slot -> shard map at ``/tidemark/<cluster>/slots/<slot>`` (``{"v": 1, "shard": ...}``). A slot
is given a shard the first time a group of it needs one: the shard with a master that holds
the fewest slots (ties to the lowest name), in an etcd transaction that requires the key
absent, so every node agrees whichever asks first. A shard that joins later takes the slots
still unassigned. The map never changes by itself afterwards: a group's members, assignment
and committed offsets stay on one shard across failovers, until an operator moves the slot
(``replication/slot_moves.py``: the record gains ``"to"`` while it moves).
"""

from __future__ import annotations

import json

from broker.group_slots import SLOTS, slot_of
from replication.coordination.records import FORMAT_VERSION, RecordError

__all__ = ["SLOTS", "decode", "decode_moving", "encode", "parse_key", "pick", "slot_of"]


def encode(shard: str, to: str = "") -> bytes:
    """A slot's record; ``to``: the slot is moving there (its shard refuses new work for it meanwhile).
    One encoding (sorted keys, no spaces): a move compares the whole value in etcd."""
    fields: dict[str, object] = {"v": FORMAT_VERSION, "shard": shard}
    if to:
        fields["to"] = to
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes) -> str:
    return decode_moving(raw)[0]


def decode_moving(raw: bytes) -> tuple[str, str]:
    """(the shard coordinating the slot, the shard it is moving to or '')."""
    try:
        fields = json.loads(raw)
        shard, to = fields["shard"], fields.get("to", "")
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise RecordError(f"not a slot record: {exc}") from None
    if not isinstance(shard, str) or not shard:
        raise RecordError("a slot record without a shard")
    if not isinstance(to, str) or to == shard:
        raise RecordError("a slot record moving to no other shard")
    return shard, to


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
