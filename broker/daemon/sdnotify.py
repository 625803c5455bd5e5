"""systemd's notify protocol (sd_notify(3)), written out: no dependency.

A message is one AF_UNIX datagram of ``KEY=VALUE`` lines sent to ``$NOTIFY_SOCKET`` (a path,
or ``@name`` for the abstract namespace). Outside systemd the variable is unset and every call
is a no-op returning False. The watchdog interval comes from ``$WATCHDOG_USEC``; it applies to
this process only when ``$WATCHDOG_PID`` is unset or names us (sd_watchdog_enabled(3)).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


class Notifier:
    """Sends state changes to systemd; harmless when not run by systemd."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + path[1:] if path.startswith("@") else path
        self._sock: socket.socket | None = None
        self.watchdog_usec = _watchdog_usec(env)

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def send(self, **fields: object) -> bool:
        """One datagram, e.g. ``send(READY=1, STATUS="serving")``; False if nobody listens."""
        if not self._address:
            return False
        payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self._address)
        except OSError:
            return False  # systemd gone or socket full: the daemon carries on regardless
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def reloading(self) -> bool:
        """RELOADING=1 with the CLOCK_MONOTONIC time systemd ≥ 253 requires next to it."""
        return self.send(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half the watchdog timeout, as systemd recommends; None = no watchdog."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_usec(env: Mapping[str, str]) -> int:
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return 0
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return 0
    return max(usec, 0)
