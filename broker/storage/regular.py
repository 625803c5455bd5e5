"""Files of a data directory are opened only as regular files (docs/formats/README.md).

What else may sit where a segment, a queue file or a small file belongs: a FIFO, whose open for
reading waits for a writer that never comes (a daemon stuck in start-up, deaf to SIGTERM; ``log
verify`` hanging), or a symlink, maybe out of the directory (to ``/dev/zero``: a read that never
ends; to another node's files). So every open of such a file goes through ``open_regular``:
``O_NONBLOCK`` (opening a FIFO never waits; on a regular file the flag changes nothing),
``O_NOFOLLOW`` (a symlink in the file's place is refused, wherever it points), then ``fstat``:
anything but a regular file is closed and refused with ``NotRegularFile``, an ``OSError`` whose
message names the file. Where a size is all that is needed, ``regular_stat`` is the same rule
with one ``lstat``. The directories themselves are not checked.
"""

from __future__ import annotations

import errno
import os
import stat

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
# what open itself answers for: a symlink (O_NOFOLLOW), a FIFO without a reader (O_WRONLY) or a socket, a directory
_REFUSED_BY_OPEN = (errno.ELOOP, errno.ENXIO, errno.EISDIR)


class NotRegularFile(OSError):
    """A data-directory file that is not a regular file: ``str()`` is ``"<path>: not a regular file (a FIFO)"``."""

    def __init__(self, path: str, mode: int) -> None:
        kind = next((name for test, name in _KINDS if test(mode)), f"file type {stat.S_IFMT(mode):#o}")
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", path)

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open(path, flags | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, mode)``, refused unless it is a regular file."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in _REFUSED_BY_OPEN:
            regular_stat(path)  # says what it is (raises), or it is a regular file after all: the error stands
        raise
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise NotRegularFile(path, st_mode)
    return fd


def regular_stat(path: str) -> os.stat_result:
    """``os.lstat(path)``, refused unless it is a regular file (FileNotFoundError when there is none)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(path, st.st_mode)
    return st


def read_regular(path: str) -> bytes:
    """The whole content of ``path``, opened with ``open_regular``."""
    with open(open_regular(path, os.O_RDONLY), "rb") as f:
        return f.read()
