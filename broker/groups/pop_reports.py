"""What the pop groups hold: groups, per-queue state, messages in flight (describe and metrics)."""

from __future__ import annotations

from typing import Any

from broker.errors import BrokerError
from broker.groups.pop_parts import PopParts


class PopReports(PopParts):
    def groups(self) -> set[str]:
        with self.view.lock:
            return set(self.view.groups)

    def describe(self, group: str) -> dict[str, Any]:
        with self.view.lock:
            g = self.view.groups.get(group)
            if g is None:
                return {"queues": {}, "dlq_messages": 0, "redeliveries": 0}
            queues = {}
            for (t, q), pq in g.queues.items():
                try:
                    _, high = self.store.reads.committed_bounds(t, q)  # (a read_uncommitted group's lag too)
                except BrokerError:
                    high = pq.cursor
                in_flight = pq.in_flight()
                queues[(t, q)] = {"in_flight": in_flight, "pop_offset": pq.base,
                                  "lag": self._unleased(t, q, pq.cursor, high) + in_flight}
            return {"queues": queues, "dlq_messages": g.dlq, "redeliveries": g.redeliveries}

    def _unleased(self, topic: str, queue: int, cursor: int, high: int) -> int:
        """Offsets in [cursor, high) this shard will lease: not those of other shards' segments
        between its own (a queue that moved away and back: they are leased there)."""
        try:
            gaps = self.store.placement.pop_gaps(topic, queue) if self.store.placement is not None else []
        except BrokerError:  # etcd's placements not loaded yet: counted as this shard's
            gaps = []
        held = sum(max(0, min(end, high) - max(start, cursor)) for start, end in gaps)
        return max(0, high - cursor - held)

    def in_flight_total(self) -> int:
        return self.view.in_flight_total()
