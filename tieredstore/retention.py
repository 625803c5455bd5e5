"""Retention in the object store (``tieredstore.retention_ms``): whole objects only, oldest first.

Never deleted: the newest object (it marks the upload break point), an object not yet expired
or anything after it (what stays is contiguous), and any object holding an offset at or above
``store.retention.read_floor()`` (a pending timer message's body, a snapshot stream).
"""

from __future__ import annotations

from tieredstore.objects import TieredObject


def plan_deletions(objects: list[TieredObject], now_s: float, retention_ms: int, hold: int | None) -> list[TieredObject]:
    """The objects to delete now (a prefix of ``objects``, sorted by start)."""
    if not retention_ms:
        return []
    doomed: list[TieredObject] = []
    for o in objects[:-1]:
        if (now_s - o.modified_s) * 1000 < retention_ms:
            break
        if hold is not None and o.end > hold:
            break
        doomed.append(o)
    return doomed
