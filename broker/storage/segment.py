"""One commit-log segment file: ``<start offset, 20 digits>.log`` holding whole batches."""

from __future__ import annotations

import errno
import os

from broker.storage.deferred_close import DEFERRED
from broker.storage.failpoints import durable_sync, note_created, note_truncated

SUFFIX = ".log"
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)  # writev takes at most this many buffers


class FsyncFailed(Exception):
    """An fsync failed: the page cache can no longer be trusted, the process must restart."""


def segment_name(start_offset: int) -> str:
    return f"{start_offset:020d}{SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    """Start offset encoded in a segment file name, None for other files."""
    if not name.endswith(SUFFIX) or len(name) != 20 + len(SUFFIX):
        return None
    stem = name[:20]
    return int(stem) if stem.isdigit() else None


class Segment:
    """An open segment: append with writev, read with pread, sync with fdatasync."""

    def __init__(self, directory: str, start_offset: int, *, create: bool = False, read_only: bool = False) -> None:
        self.start_offset = start_offset
        self.path = os.path.join(directory, segment_name(start_offset))
        flags = os.O_RDONLY if read_only else os.O_RDWR | os.O_APPEND
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        self.fd = os.open(self.path, flags, 0o600)
        if create:
            note_created(self.path)
        self.size_bytes = os.fstat(self.fd).st_size

    @property
    def end_offset(self) -> int:
        return self.start_offset + self.size_bytes

    def append(self, chunks: list[bytes]) -> None:
        """Write every chunk or nothing (a failed or short write is undone with ftruncate)."""
        total = 0
        try:
            for i in range(0, len(chunks), IOV_MAX):
                group = chunks[i : i + IOV_MAX]
                want = sum(len(c) for c in group)
                written = os.writev(self.fd, group)
                total += written
                if written != want:
                    raise OSError(errno.ENOSPC, f"short write to {self.path}: {written} of {want} bytes")
        except OSError:
            os.ftruncate(self.fd, self.size_bytes)
            raise
        self.size_bytes += total

    def read(self, position: int, length: int) -> bytes:
        return os.pread(self.fd, length, position)

    def sync(self) -> None:
        durable_sync(self.fd, self.path)

    def truncate(self, size_bytes: int) -> None:
        os.ftruncate(self.fd, size_bytes)
        self.size_bytes = size_bytes
        durable_sync(self.fd, self.path, data_only=False)
        note_truncated(size_bytes, self.path)

    def close(self) -> None:
        os.close(self.fd)

    def close_later(self) -> None:
        """Close after a grace period: readers may still hold this segment (see deferred_close)."""
        DEFERRED.defer(self.fd)
