"""A stand-in for systemd's side of sd_notify: a datagram socket that records every message."""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Notification:
    at: float  # time.monotonic() when received
    fields: dict[str, str]


class NotifySocket:
    """Binds ``@name`` (abstract namespace) or a path; ``env()`` is what the daemon needs."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.messages: list[Notification] = []
        self._cond = threading.Condition()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind("\0" + address[1:] if address.startswith("@") else address)
        self._sock.settimeout(0.2)
        self._closed = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    @classmethod
    def abstract(cls) -> NotifySocket:
        return cls(f"@tidemark-test-{os.getpid()}-{time.monotonic_ns()}")

    def env(self, watchdog_usec: int | None = None) -> dict[str, str]:
        env = {"NOTIFY_SOCKET": self.address}
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        return env

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self._cond:
                self.messages.append(Notification(time.monotonic(), fields))
                self._cond.notify_all()

    def wait_for(self, key: str, value: str | None = None, after: int = 0, timeout_s: float = 30.0) -> int:
        """Index of the first message from ``after`` on that has ``key`` (= ``value``)."""

        def find() -> int | None:
            for i in range(after, len(self.messages)):
                f = self.messages[i].fields
                if key in f and (value is None or f[key] == value):
                    return i
            return None

        with self._cond:
            found = self._cond.wait_for(lambda: find() is not None, timeout_s)
            if not found:
                raise TimeoutError(f"no {key}={value} after message {after}: {[m.fields for m in self.messages]}")
            index = find()
            assert index is not None
            return index

    def count(self, key: str, after: int = 0) -> int:
        with self._cond:
            return sum(1 for m in self.messages[after:] if key in m.fields)

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        self._thread.join(2)
