"""Deferred closing of file descriptors whose files were deleted.

A reader may have taken a segment or queue file just before retention or a topic delete removed
it. Closing the fd at once could let ``os.open`` hand the same number to another file, and the
reader would then read the wrong file's bytes. Deleted files stay readable through an open fd,
so we unlink at once and close after ``GRACE_S`` (longer than any pull wait plus its timeout).
"""

from __future__ import annotations

import os
import threading
import time

GRACE_S = 120.0


class DeferredCloser:
    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._pending: list[tuple[float, int]] = []

    def defer(self, fd: int) -> None:
        with self._lock:
            self._pending.append((time.monotonic() + self.grace_s, fd))

    def reap(self, *, everything: bool = False) -> int:
        """Close the fds whose grace has passed (all of them at shutdown); return how many."""
        now = time.monotonic()
        with self._lock:
            due = [fd for t, fd in self._pending if everything or t <= now]
            self._pending = [] if everything else [(t, fd) for t, fd in self._pending if t > now]
        for fd in due:
            os.close(fd)
        return len(due)


DEFERRED = DeferredCloser()
