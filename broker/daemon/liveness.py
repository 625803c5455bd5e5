"""What the watchdog ping vouches for: the daemon still makes progress, not merely that it runs.

The main loop pings systemd's watchdog only while ``check()`` finds nothing wrong. The check
that matters most is the flusher: with unflushed bytes pending, the flushed offset must move
within ``stall_s`` (a hung disk or a deadlocked append path stops it); systemd then kills and
restarts the daemon after ``WatchdogSec=``.
"""

from __future__ import annotations


class FlushProgress:
    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._last_flushed = -1
        self._waiting_since: float | None = None

    def check(self, max_offset: int, flushed_offset: int, now: float) -> str | None:
        """None when healthy, else a one-line reason (and no ping)."""
        if flushed_offset != self._last_flushed or flushed_offset >= max_offset:
            self._last_flushed = flushed_offset
            self._waiting_since = now if flushed_offset < max_offset else None
            return None
        if self._waiting_since is None:
            self._waiting_since = now
        stalled_s = now - self._waiting_since
        if stalled_s > self.stall_s:
            return (f"flushed offset stuck at {flushed_offset} for {stalled_s:.1f} s with "
                    f"{max_offset - flushed_offset} bytes unflushed")
        return None
