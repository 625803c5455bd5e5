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
                                  "lag": max(0, high - pq.cursor) + in_flight}
            return {"queues": queues, "dlq_messages": g.dlq, "redeliveries": g.redeliveries}

    def in_flight_total(self) -> int:
        return self.view.in_flight_total()
