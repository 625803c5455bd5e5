"""Named crash points and the fsync journal used by power-loss tests.

A failpoint is inert unless the environment arms it::

    TIDEMARK_FAILPOINTS="commitlog_after_write=exit,views_before_checkpoint=exit@3"

Actions: ``exit`` (SIGKILL this process at the first hit), ``exit@N`` (at the N-th hit),
``sleep:MS`` (pause, to widen a race window in a test). Names follow
``<component>_<before|after>_<action>``.

``TIDEMARK_FSYNC_JOURNAL=/path`` makes every durable sync append ``S <size> <path>`` to that file,
and every creation or truncation ``R <size> <path>`` (a reset). ``kill -9`` keeps the page cache,
so a power-loss test cuts each listed file to its durable length: the largest size synced since
its last reset (syncs of one file may run concurrently and journal out of order). Exactly the
bytes an fsync promised survive, nothing more.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import re
import signal
import threading
import time

from broker.errors import shown
from broker.storage.regular import open_regular

_ENV_FAILPOINTS = "TIDEMARK_FAILPOINTS"
_ENV_JOURNAL = "TIDEMARK_FSYNC_JOURNAL"


def _parse(spec: str) -> dict[str, str]:
    armed: dict[str, str] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, action = item.partition("=")
        action = action.strip() or "exit"
        if not re.fullmatch(r"exit|exit@\d+|sleep:\d+", action):
            raise ValueError(f"{_ENV_FAILPOINTS}: unknown action {action!r} for {shown(name)}")
        armed[name.strip()] = action
    return armed


_armed = _parse(os.environ.get(_ENV_FAILPOINTS, ""))
_hits: dict[str, int] = {}
_lock = threading.Lock()
_journal_path = os.environ.get(_ENV_JOURNAL, "")


def failpoint(name: str) -> None:
    """Crash, pause or do nothing at a named point, as the environment says."""
    if not _armed:
        return
    action = _armed.get(name)
    if action is None:
        return
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        hit = _hits[name]
    if action.startswith("sleep:"):
        time.sleep(int(action[6:]) / 1000.0)
        return
    at = 1
    if action.startswith("exit@"):
        at = int(action[5:])
    if hit == at:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(10)  # SIGKILL is delivered asynchronously; never run past the point.


async def failpoint_async(name: str) -> None:
    """``failpoint`` on an event loop: a ``sleep:MS`` pauses this coroutine, not the loop."""
    if _armed.get(name, "").startswith("sleep:"):
        await asyncio.sleep(int(_armed[name][6:]) / 1000.0)
        return
    failpoint(name)


def _journal(kind: str, size: int, path: str) -> None:
    if not _journal_path:
        return
    line = f"{kind} {size} {os.path.realpath(path)}\n".encode()
    fd = os.open(_journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def note_created(path: str) -> None:
    """Journal a new file: until it is fsynced, a power cut leaves it empty."""
    _journal("R", 0, path)


def note_truncated(size: int, path: str) -> None:
    """Journal a truncation (made durable by the caller's fsync): the file restarts at ``size``."""
    _journal("R", size, path)


def durable_sync(fd: int, path: str, *, data_only: bool = True) -> None:
    """fdatasync/fsync ``fd`` and journal the length that is now durable.

    The size is read before the sync: bytes appended meanwhile by another thread are not covered.
    """
    size = os.fstat(fd).st_size if _journal_path else 0
    if data_only:
        os.fdatasync(fd)
    else:
        os.fsync(fd)
    if _journal_path:
        _journal("S", size, path)


SYNCFS_MIN = 64  # more files than this to make durable at once: one syncfs(2) instead of an fsync each
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def syncfs(path: str) -> None:
    """Make everything written on the filesystem holding ``path`` durable (one syscall)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def durable_sync_many(paths: list[str], directories: list[str], anchor: str) -> None:
    """Make ``paths`` (file contents) and ``directories`` (their entries) durable: one fsync each,
    or, beyond ``SYNCFS_MIN`` of them, one ``syncfs`` of the filesystem holding ``anchor`` (every
    file is journalled as synced at its size before the sync, as ``durable_sync`` does)."""
    if len(paths) + len(directories) <= SYNCFS_MIN:
        for path in paths:
            fd = open_regular(path, os.O_RDONLY)
            try:
                durable_sync(fd, path)
            finally:
                os.close(fd)
        for d in directories:
            fsync_dir(d)
        return
    sizes = [(os.stat(p).st_size, p) for p in paths] if _journal_path else []
    syncfs(anchor)
    for size, path in sizes:
        _journal("S", size, path)


def fsync_dir(path: str) -> None:
    """Make renames and creations inside directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
