"""One daemon per data directory (DESIGN §10): an exclusive ``flock`` on ``DATA_DIR/LOCK``.

The lock lives as long as the process (the kernel drops it when the process dies, however it
dies), so there is no stale lock to clean up. The file holds the owner's pid, for the message a
second daemon prints. ``holder`` tells a reader (``log verify``) whether a daemon has the
directory, without writing anything.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from broker.invariant import StartupRefused
from broker.storage.regular import NotRegularFile, open_regular

LOCK_NAME = "LOCK"


class DirectoryInUse(StartupRefused):
    """Another process holds the data directory."""


class DirLock:
    """The exclusive lock on one data directory, held through an open file descriptor."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path  # the LOCK file
        self.fd = fd

    @classmethod
    def acquire(cls, data_dir: str) -> DirLock:
        """Lock ``data_dir`` (created if missing) or raise ``DirectoryInUse`` naming the holder."""
        try:
            os.makedirs(data_dir, mode=0o700, exist_ok=True)
            path = os.path.join(data_dir, LOCK_NAME)
            fd = open_regular(path, os.O_RDWR | os.O_CREAT)
        except NotRegularFile as exc:
            raise StartupRefused(str(exc)) from None
        except OSError as exc:
            raise StartupRefused(f"data directory {data_dir}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StartupRefused(f"data directory {data_dir}: cannot lock {path}: {exc.strerror}") from None
            raise DirectoryInUse(f"data directory {data_dir} is in use by pid {_pid_in(path)}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    def moved_to(self, data_dir: str) -> None:
        """The locked directory was renamed to ``data_dir`` (the lock goes with it)."""
        self.path = os.path.join(data_dir, LOCK_NAME)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


def holder(data_dir: str) -> int | None:
    """The pid of the daemon holding ``data_dir``, or None. Looks the flock up in ``/proc/locks``
    rather than taking one (a probe that locks, even shared and briefly, could make a daemon starting
    at that instant refuse); opens nothing for writing."""
    path = os.path.join(data_dir, LOCK_NAME)
    try:
        st = os.stat(path)
    except OSError:
        return None
    try:
        with open("/proc/locks", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return _probe(path)
    for line in lines:
        parts = line.split()
        if len(parts) < 6 or parts[1] != "FLOCK" or parts[0].endswith("->"):
            continue
        major, minor, inode = parts[5].split(":")
        if (int(major, 16), int(minor, 16), int(inode)) == (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino):
            return int(parts[4])
    return None


def _probe(path: str) -> int | None:
    """Without ``/proc/locks``: try a shared lock (released at once)."""
    try:
        fd = open_regular(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _pid_in(path) or -1
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def only_lock_inside(data_dir: str) -> bool:
    """Whether ``data_dir`` is empty but for its lock file (a directory a bundle may replace)."""
    with contextlib.suppress(FileNotFoundError):
        return set(os.listdir(data_dir)) <= {LOCK_NAME}
    return True


def _pid_in(path: str) -> int:
    try:
        with open(open_regular(path, os.O_RDONLY), encoding="ascii") as f:
            return int(f.read(32).strip() or 0)
    except (OSError, ValueError):
        return 0
