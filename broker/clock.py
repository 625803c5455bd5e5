"""The daemon's wall clock: ``wall_s()`` / ``wall_ms()``, what store times, timer due checks, pop
lease deadlines and retention ages are read from.

A test hook shifts it without touching the host's clock (a clock step on one node, as NTP makes
one)::

    TIDEMARK_CLOCK_OFFSET_FILE=/path    # the file holds one integer: milliseconds to add (may be < 0)

The file is looked at (``os.stat``) at most every 50 ms and read again when it changed; a missing or
unreadable file means no offset. Without the variable the clock is ``time.time()``. Monotonic
clocks (etcd lease and write permit, timeouts, intervals) are never shifted.
"""

from __future__ import annotations

import os
import threading
import time

_ENV_OFFSET_FILE = "TIDEMARK_CLOCK_OFFSET_FILE"
RECHECK_S = 0.05


class _OffsetFile:
    def __init__(self, path: str) -> None:
        self.path = path
        self.offset_s = 0.0
        self._checked = -1.0  # monotonic time of the last stat
        self._seen: tuple[float, int] | None = None  # (mtime, size) last read
        self._lock = threading.Lock()

    def current_s(self) -> float:
        now = time.monotonic()
        if now - self._checked < RECHECK_S:
            return self.offset_s
        with self._lock:
            self._checked = now
            try:
                st = os.stat(self.path)
                seen = (st.st_mtime, st.st_size)
                if seen != self._seen:
                    with open(self.path) as f:
                        self.offset_s = int(f.read().strip() or 0) / 1000.0
                    self._seen = seen
            except (OSError, ValueError):
                self.offset_s, self._seen = 0.0, None
            return self.offset_s


_path = os.environ.get(_ENV_OFFSET_FILE, "")
_offset = _OffsetFile(_path) if _path else None


def wall_s() -> float:
    """Seconds since the epoch, as this node's clock says."""
    if _offset is None:
        return time.time()
    return time.time() + _offset.current_s()


def wall_ms() -> int:
    """Milliseconds since the epoch, as this node's clock says."""
    return int(wall_s() * 1000)
