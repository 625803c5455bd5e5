"""The daemon's threads carry their names down to the OS: ``top -H``, ``ps -L`` and
``/proc/PID/task/*/comm`` show ``flusher``, ``dispatcher``, ``grpc-loop``... instead of ``python``
for every one, so an operator (or ``bench/send_profile.py``) can tell which thread burns a core or
waits for one. Linux keeps at most 15 bytes of a name; elsewhere names stay Python's own."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from typing import Any

PR_SET_NAME = 15  # prctl(2)
OS_NAME_BYTES_MAX = 15

_prctl: Any = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no libc symbol: names stay Python's own
        _prctl = None


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (cut to 15 bytes) as its OS name; a no-op off Linux."""
    if _prctl is None:
        return
    with contextlib.suppress(Exception):  # cosmetic: nothing here may keep a flusher or a pool worker from running
        _prctl(PR_SET_NAME, name.encode("ascii", "replace")[:OS_NAME_BYTES_MAX], 0, 0, 0)


class NamedThread(threading.Thread):
    """A ``threading.Thread`` that takes its ``name`` as its OS name when it starts running."""

    def run(self) -> None:
        name_os_thread(self.name)
        super().run()


def name_pool_thread() -> None:
    """A ``ThreadPoolExecutor`` ``initializer``: the worker takes its Python name (``prefix_N``) as its OS name."""
    name_os_thread(threading.current_thread().name)
