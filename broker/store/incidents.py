"""What went wrong in background work (DESIGN §10: no thread dies silently).

Every background loop that survives a failure records it here (logged, counted in
``tidemark_background_errors{component}``, shown in ``status()["errors"]`` with its count, last
message and time) and clears it once the loop succeeds again, so a problem that persists stays
visible and one that healed leaves only its count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from broker import clock, metrics

log = structlog.get_logger("incidents")
MESSAGE_MAX = 300


@dataclass
class Incident:
    count: int
    message: str
    at_ms: int
    active: bool


class Incidents:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_component: dict[str, Incident] = {}

    def record(self, component: str, message: str) -> None:
        """A background step of ``component`` failed; it will be retried."""
        now_ms = clock.wall_ms()
        with self._lock:
            inc = self._by_component.get(component)
            if inc is None:
                inc = self._by_component[component] = Incident(0, "", now_ms, True)
            first = not inc.active
            inc.count += 1
            inc.message = message[:MESSAGE_MAX]
            inc.at_ms = now_ms
            inc.active = True
        metrics.BACKGROUND_ERRORS.labels(component).inc()
        if first or inc.count == 1 or inc.count % 100 == 0:
            log.warning("background_error", component=component, error=message, count=inc.count)

    def clear(self, component: str) -> None:
        """``component`` works again."""
        with self._lock:
            inc = self._by_component.get(component)
            if inc is None or not inc.active:
                return
            inc.active = False
        log.info("background_recovered", component=component)

    def report_to(self, component: str) -> Callable[[str], None]:
        """A callback for a loop of ``component``: a message records a failure, "" a success."""
        return lambda message: self.record(component, message) if message else self.clear(component)

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._lock:
            return {name: {"count": i.count, "error": i.message if i.active else "", "last_ms": i.at_ms,
                           "active": i.active} for name, i in self._by_component.items()}
