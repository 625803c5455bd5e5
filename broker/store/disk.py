"""Free space on the data directory's filesystem, read at most every 100 ms (``storage.min_free_bytes``)."""

from __future__ import annotations

import os
import time

from broker import metrics

RECHECK_S = 0.1


class DiskSpace:
    def __init__(self, path: str) -> None:
        self.path = path
        self._checked_at = 0.0
        self._free_bytes = 1 << 62

    def free_bytes(self) -> int:
        now = time.monotonic()
        if now - self._checked_at > RECHECK_S:
            st = os.statvfs(self.path)
            self._free_bytes = st.f_bavail * st.f_frsize
            self._checked_at = now
            metrics.FREE_DISK.set(self._free_bytes)
        return self._free_bytes

    def recheck(self) -> None:
        """Read it again on the next call (a write just failed for lack of space)."""
        self._checked_at = 0.0
