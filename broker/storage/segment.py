"""One commit-log segment file: ``<start offset, 20 digits>.log`` holding whole batches."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

import structlog

from broker.storage.failpoints import durable_sync, note_created, note_truncated
from broker.storage.handles import HANDLES

log = structlog.get_logger("segment")
SUFFIX = ".log"
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)  # writev takes at most this many buffers


class FsyncFailed(Exception):
    """An fsync failed: the page cache can no longer be trusted, the process must restart."""


def segment_name(start_offset: int) -> str:
    return f"{start_offset:020d}{SUFFIX}"


def parse_segment_name(name: str, suffix: str = SUFFIX) -> int | None:
    """Start offset encoded in a segment file name (``suffix``: of another file named the same
    way), None for other files. ASCII digits only: ``str.isdigit`` and ``int`` take other scripts'
    digits too ('١٢٣'), which no file of ours is named in."""
    stem = name[: -len(suffix)]
    if not name.endswith(suffix) or len(stem) != 20 or not (stem.isascii() and stem.isdigit()):
        return None
    return int(stem)


class Segment:
    """A segment: append with writev, read with pread, sync with fdatasync. Its descriptor comes
    from the bounded set of open files (``handles.HANDLES``), opened again when it was evicted."""

    def __init__(self, directory: str, start_offset: int, *, create: bool = False, read_only: bool = False) -> None:
        self.start_offset = start_offset
        self.path = os.path.join(directory, segment_name(start_offset))
        flags = os.O_RDONLY if read_only else os.O_RDWR | os.O_APPEND
        if create:
            fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            note_created(self.path)
            HANDLES.register(self.path, flags, fd)
        else:
            HANDLES.register(self.path, flags)
        with HANDLES.use(self.path) as fd:
            self.size_bytes = os.fstat(fd).st_size

    @property
    def end_offset(self) -> int:
        return self.start_offset + self.size_bytes

    def append(self, chunks: Sequence[bytes | memoryview]) -> None:
        """Write every chunk or nothing (a failed or short write is undone with ftruncate)."""
        total = 0
        with HANDLES.use(self.path) as fd:
            try:
                for i in range(0, len(chunks), IOV_MAX):
                    group = chunks[i : i + IOV_MAX]
                    want = sum(len(c) for c in group)
                    written = os.writev(fd, group)
                    total += written
                    if written != want:
                        raise OSError(errno.ENOSPC, f"short write to {self.path}: {written} of {want} bytes")
            except OSError:
                os.ftruncate(fd, self.size_bytes)
                raise
        self.size_bytes += total

    def read(self, position: int, length: int) -> bytes:
        """Bytes at ``position``; fewer (or none) when the file was deleted meanwhile (retention)."""
        try:
            with HANDLES.use(self.path) as fd:
                return os.pread(fd, length, position)
        except FileNotFoundError:
            return b""

    def readinto(self, buffer: memoryview, position: int) -> int:
        """Fill ``buffer`` from ``position`` (one preadv, no copy); bytes read."""
        try:
            with HANDLES.use(self.path) as fd:
                return os.preadv(fd, [buffer], position)
        except FileNotFoundError:
            return 0

    def sync(self) -> None:
        with HANDLES.use(self.path) as fd:
            durable_sync(fd, self.path)

    def drop_cache(self, position: int, length: int) -> None:
        """Advise the kernel to drop the cached pages of ``[position, position + length)``. Only
        clean (synced) pages go; a later read of them reads the disk. Advice only: a segment
        deleted meanwhile is skipped, nothing is changed in the file."""
        if length <= 0:
            return
        try:
            with HANDLES.use(self.path) as fd:
                os.posix_fadvise(fd, position, length, os.POSIX_FADV_DONTNEED)
        except OSError as exc:  # deleted meanwhile, out of descriptors, ...: advice that was not given
            if not isinstance(exc, FileNotFoundError):
                log.warning("page_cache_release_skipped", path=self.path, error=str(exc))

    def truncate(self, size_bytes: int) -> None:
        with HANDLES.use(self.path) as fd:
            os.ftruncate(fd, size_bytes)
            self.size_bytes = size_bytes
            durable_sync(fd, self.path, data_only=False)
        note_truncated(size_bytes, self.path)

    def close(self) -> None:
        """Give its descriptor back; when the file is being deleted, that happens once no reader holds it."""
        HANDLES.forget(self.path)
