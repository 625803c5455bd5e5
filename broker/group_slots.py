"""Which group slot a consumer group or transactional id hashes to (docs/shards.md "Groups across
shards"): ``crc32c(name) % SLOTS``. Clients, the CLI and the nodes all hash the same way; the
slot -> shard map itself is etcd's (``replication/coordination/slots.py``)."""

from __future__ import annotations

import crc32c

SLOTS = 256


def slot_of(name: str) -> int:
    return crc32c.crc32c(name.encode()) % SLOTS
