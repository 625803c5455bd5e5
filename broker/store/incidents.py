"""What went wrong in background work (DESIGN §10: no thread dies silently).

Every background loop that survives a failure records it here (logged, counted in
``tidemark_background_errors{component}``, shown in ``status()["errors"]`` with its count, last
message and time) and clears it once the loop succeeds again, so a problem that persists stays
visible and one that healed leaves only its count.

An incident belongs to the thread that recorded it. A role change ends some loops for good (the
follower on a promote; the tiered uploader and the timer firing on a demote): an ended loop can
never clear what it reported, so ``Store.set_role`` retires the incidents whose thread has ended
(``retire_ended``: inactive, count kept). A loop that goes on reports again at its next attempt.
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
    thread: threading.Thread | None = None  # the one that recorded it last


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
            inc.thread = threading.current_thread()
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

    def retire_ended(self, why: str) -> None:
        """The loops that recorded active incidents and have ended since will not clear them: retire those."""
        with self._lock:
            ended = [name for name, i in self._by_component.items()
                     if i.active and i.thread is not None and not i.thread.is_alive()]
            for name in ended:
                self._by_component[name].active = False
        for name in ended:
            log.info("background_error_retired", component=name, reason=why)

    def report_to(self, component: str) -> Callable[[str], None]:
        """A callback for a loop of ``component``: a message records a failure, "" a success."""
        return lambda message: self.record(component, message) if message else self.clear(component)

    def snapshot(self) -> dict[str, dict[str, object]]:
        with self._lock:
            return {name: {"count": i.count, "error": i.message if i.active else "", "last_ms": i.at_ms,
                           "active": i.active} for name, i in self._by_component.items()}
