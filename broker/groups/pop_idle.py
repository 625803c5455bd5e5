"""Pops that found nothing, remembered until something they depended on changes.

A pop that visited every queue of its topic and leased nothing is remembered with what it depended
on: the topic's growth (the dispatcher's word) and identity (a topic deleted and created again is
another), the group's own records on the topic (acks move the window, nacks and changed leases make
messages visible), the epoch, and when its next lease ends. A role change forgets everything.
Until one of them changes or that time comes, the next pop of the group answers at once instead of
visiting every queue again (2,000 waiting pops of a 1,024-queue topic each walked all of them
whenever they came back). Cheap enough for the event loop to ask before handing a pop to a thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

State = tuple[int, int, int, int, int]  # (generation, epoch, topic id, its growth count, the group's record count on it)
ENTRIES_MAX = 100_000


class IdlePops:
    def __init__(self, epoch: Callable[[], int], topic_id: Callable[[str], int]) -> None:
        """``topic_id``: the topic's id now (-1 when it does not exist)."""
        self._epoch = epoch
        self._topic_id = topic_id
        self._lock = threading.Lock()
        self._generation = 0  # bumped whenever the maps are cleared: no state from before matches
        self._grown: dict[str, int] = {}
        self._changed: dict[tuple[str, str], int] = {}
        self._idle: dict[tuple[str, str], tuple[State, int | None]] = {}

    def queues_grew(self, keys: set[tuple[str, int]] | None) -> None:
        """The dispatcher's word that queues grew (None: anything may have changed)."""
        with self._lock:
            if keys is None or len(self._grown) > ENTRIES_MAX:
                self._clear()
            for topic in {t for t, _ in keys or ()}:
                self._grown[topic] = self._grown.get(topic, 0) + 1

    def forget(self, _role: str = "") -> None:
        """Everything (a role listener: a node that is no longer master answers nothing from here)."""
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self._generation += 1
        self._idle.clear()
        self._grown.clear()
        self._changed.clear()

    def records_appended(self, keys: Iterable[tuple[str, str, int]]) -> None:
        """A record of the group touched these (group, topic, queue)s."""
        with self._lock:
            for group, topic in {(g, t) for g, t, _ in keys}:
                self._changed[(group, topic)] = self._changed.get((group, topic), 0) + 1

    def state(self, group: str, topic: str) -> State:
        """Read before a pop walks the queues: what a "nothing" it finds depends on."""
        topic_id = self._topic_id(topic)
        with self._lock:
            return self._generation, self._epoch(), topic_id, self._grown.get(topic, 0), self._changed.get((group, topic), 0)

    def still_idle(self, group: str, topic: str, now_ms: int) -> tuple[bool, int | None]:
        """A pop of ``group`` on ``topic`` would find nothing, as the last one did (and when to look again)."""
        with self._lock:
            idle = self._idle.get((group, topic))
        if idle is None or idle[0] != self.state(group, topic) or (idle[1] is not None and now_ms >= idle[1]):
            return False, None
        return True, idle[1]

    def remember(self, group: str, topic: str, state: State, wake_ms: int | None) -> None:
        with self._lock:
            if len(self._idle) > ENTRIES_MAX or len(self._changed) > ENTRIES_MAX:
                self._clear()
            if state[0] == self._generation:
                self._idle[(group, topic)] = (state, wake_ms)
