"""The target assignment of a subscribe-mode group: sticky and balanced (DESIGN §12).

A pure function, so that it is tested alone and the coordinator only decides *when* a queue may
move. Per topic, the queues are shared among the members that subscribe to it: each gets
``floor(n / k)`` or ``ceil(n / k)`` queues. A queue stays with its current owner while that owner
is under its quota (sticky: a join or a leave moves only what must move); the rest go to the
members with the fewest queues overall, so that a member subscribed to several topics is not
loaded on each of them at once.
"""

from __future__ import annotations

from collections.abc import Mapping

QueueKey = tuple[str, int]


def assign(queues: Mapping[str, int], subscriptions: Mapping[str, frozenset[str]],
           current: Mapping[QueueKey, str]) -> dict[QueueKey, str]:
    """Owner of every queue of every subscribed topic.

    ``queues``: topic → queue count (topics that do not exist are left out by the caller).
    ``subscriptions``: member id → topics. ``current``: the previous target (queue → member).
    """
    target: dict[QueueKey, str] = {}
    load: dict[str, int] = dict.fromkeys(subscriptions, 0)
    for topic in sorted({t for topics in subscriptions.values() for t in topics if t in queues}):
        members = sorted(m for m, topics in subscriptions.items() if topic in topics)
        count = queues[topic]
        base, extra = divmod(count, len(members))
        # the members that keep the most queues get the ``extra`` larger quotas: fewer moves
        kept: dict[str, list[int]] = {m: [] for m in members}
        for q in range(count):
            owner = current.get((topic, q))
            if owner in kept:
                kept[owner].append(q)
        by_kept = sorted(members, key=lambda m: (-len(kept[m]), load[m], m))
        quota = {m: base + (1 if i < extra else 0) for i, m in enumerate(by_kept)}
        for m in members:
            for q in kept[m][: quota[m]]:
                target[(topic, q)] = m
        free = [q for q in range(count) if (topic, q) not in target]
        owned = {m: min(len(kept[m]), quota[m]) for m in members}
        for q in free:
            m = min((m for m in members if owned[m] < quota[m]), key=lambda m: (load[m] + owned[m], m))
            target[(topic, q)] = m
            owned[m] += 1
        for m in members:
            load[m] += owned[m]
    return target
