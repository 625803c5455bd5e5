"""A bounded set of open file descriptors (DESIGN §10: ``limits.open_files_max``).

Segments and queue files are opened on use and kept open in least-recently-used order; beyond
the limit the idle ones are closed (one in use is never closed). So 100,000 queues cost at most
the limit in descriptors, and a burst of reads cannot exhaust the process's ``RLIMIT_NOFILE``.
A file that was deleted or renamed is ``forget``-ed: its descriptor closes as soon as no reader
holds it (a reader that took it just before the delete still reads the old bytes, safely).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from broker import metrics
from broker.storage.regular import open_regular

OPEN_FILES_DEFAULT = 1024


@dataclass
class _Handle:
    fd: int
    users: int = 0
    doomed: bool = False  # forgotten while in use: close on the last release


class FileHandles:
    def __init__(self, limit: int = OPEN_FILES_DEFAULT) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[str, _Handle] = OrderedDict()  # least recently used first
        self._flags: dict[str, int] = {}

    def set_limit(self, limit: int) -> None:
        with self._lock:
            self.limit = limit
            self._evict()

    def register(self, path: str, flags: int, fd: int | None = None) -> None:
        """How ``path`` is (re)opened; ``fd``: a descriptor the caller just opened (e.g. with O_EXCL)."""
        with self._lock:
            self._flags[path] = flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)
            if fd is not None:
                self._open[path] = _Handle(fd)
                self._evict()

    def register_many(self, paths: list[str], flags: int) -> None:
        """``register`` for many files at once (100,000 queue files at start-up, one lock)."""
        flags &= ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)
        with self._lock:
            self._flags.update(dict.fromkeys(paths, flags))

    @contextmanager
    def use(self, path: str) -> Iterator[int]:
        """A descriptor of ``path``, open for as long as the block runs."""
        with self._lock:
            handle = self._open.get(path)
            if handle is None or handle.doomed:
                handle = _Handle(self._open_fd(path))
                self._open[path] = handle
            self._open.move_to_end(path)
            handle.users += 1
            self._evict()
        try:
            yield handle.fd
        finally:
            with self._lock:
                handle.users -= 1
                if handle.doomed and handle.users == 0:
                    os.close(handle.fd)
                else:
                    self._evict()

    def pin(self, path: str) -> None:
        """Keep ``path`` open until ``unpin`` (the active segment: written and synced all the time)."""
        with self._lock:
            handle = self._open.get(path)
            if handle is None or handle.doomed:
                handle = self._open[path] = _Handle(self._open_fd(path))
            handle.users += 1
            self._evict()

    def unpin(self, path: str) -> None:
        with self._lock:
            handle = self._open.get(path)
            if handle is not None:
                handle.users -= 1
                self._evict()

    def forget(self, path: str) -> None:
        """``path`` was deleted or renamed: close its descriptor once nobody uses it."""
        with self._lock:
            self._flags.pop(path, None)
            handle = self._open.pop(path, None)
            if handle is None:
                return
            if handle.users:
                handle.doomed = True
            else:
                os.close(handle.fd)

    @property
    def open_count(self) -> int:
        with self._lock:
            return len(self._open)

    def _open_fd(self, path: str) -> int:
        """Regular files only (a FIFO or a symlink in a segment's place is refused, never waited on)."""
        flags = self._flags.get(path, os.O_RDONLY)
        try:
            return open_regular(path, flags)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            self._evict(keep=0)  # the process is out of descriptors: give back every idle one, once
            return open_regular(path, flags)

    def _evict(self, keep: int | None = None) -> None:
        limit = self.limit if keep is None else keep
        if len(self._open) > limit:
            for path in list(self._open):
                if len(self._open) <= limit:
                    break
                handle = self._open[path]
                if handle.users == 0:
                    del self._open[path]
                    os.close(handle.fd)
        metrics.OPEN_FILES.set(len(self._open))


HANDLES = FileHandles()
