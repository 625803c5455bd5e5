"""Leader-epoch history (DESIGN §4): ``[(epoch, start_offset), ...]``, persisted atomically.

Each promotion starts epoch ``e`` at offset ``o`` (the log end then). Every batch carries the
epoch of the master that appended it, so a node's history is also derivable from its log; the
file makes it available without a scan and records epochs that have not written yet.
Spec: docs/formats/epochs.md.
"""

from __future__ import annotations

import json
import os
import threading

from broker.storage import atomic_file

MAGIC = b"TMEP"
VERSION = 1
FILE_NAME = "epochs"


class EpochHistory:
    def __init__(self, data_dir: str) -> None:
        self.path = os.path.join(data_dir, FILE_NAME)
        self.entries: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def load(self) -> bool:
        loaded = atomic_file.load(self.path, MAGIC, VERSION)
        if loaded is None:
            return False
        self.entries = [(int(e), int(o)) for e, o in json.loads(loaded.payload)["entries"]]
        return True

    def _persist(self) -> None:
        atomic_file.persist(self.path, MAGIC, VERSION, json.dumps({"entries": self.entries}).encode())

    @property
    def current(self) -> int:
        return self.entries[-1][0] if self.entries else 0

    def start(self, epoch: int, offset: int) -> None:
        """Begin ``epoch`` at ``offset`` (a promotion, or an epoch learned from the master)."""
        with self._lock:
            if self.entries and epoch <= self.current:
                return
            self.entries.append((epoch, offset))
            self._persist()

    def truncate(self, offset: int) -> None:
        """Forget epochs that start above ``offset`` (after the log was cut there)."""
        with self._lock:
            kept = [(e, o) for e, o in self.entries if o <= offset]
            if kept != self.entries:
                self.entries = kept
                self._persist()

    def replace(self, entries: list[tuple[int, int]]) -> None:
        with self._lock:
            self.entries = list(entries)
            self._persist()

    def highest(self) -> int:
        """The highest epoch this node knows of (0 for none): a new epoch must be above it, and a
        leader record at or below it is not news (the rule the coordinator and the role changes use)."""
        with self._lock:
            return max((e for e, _ in self.entries), default=0)

    def snapshot(self) -> list[tuple[int, int]]:
        with self._lock:
            return list(self.entries)


def divergence_point(leader: list[tuple[int, int]], leader_end: int,
                     follower: list[tuple[int, int]], follower_end: int) -> int:
    """Offset up to which the follower's log equals the leader's (Kafka's leader-epoch rule).

    The newest epoch both histories hold with the same start is common; the logs agree up to
    the smaller of its end in either history (and the follower's log end).
    """
    leader_starts = dict(leader)
    common = [(e, o) for e, o in follower if leader_starts.get(e) == o]
    if not common:
        return 0
    epoch = common[-1][0]

    def end_in(history: list[tuple[int, int]], log_end: int) -> int:
        for i, (e, _) in enumerate(history):
            if e == epoch:
                return history[i + 1][1] if i + 1 < len(history) else log_end
        return log_end

    return min(end_in(leader, leader_end), end_in(follower, follower_end), follower_end)
