"""The commit log gives synced pages older than its cache window back to the kernel.

Residency is read with ``mincore(2)`` on a mapping of the segment file: the kernel's own answer of
which pages are in the page cache, not something the log reports about itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

from broker.storage.commitlog import CACHE_RELEASE_STEP_BYTES, CommitLog
from tests.storeutil import create_topic, open_store, read_all, send, wait_views_applied
from tests.waits import wait_until

MiB = 1 << 20
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(path: str, start: int = 0, end: int | None = None) -> int:
    """Bytes of ``path`` in ``[start, end)`` (whole pages) that are in the page cache now."""
    size = os.path.getsize(path)
    end = size if end is None else min(end, size)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return PAGE * sum(vec[i] & 1 for i in range(start // PAGE, (end + PAGE - 1) // PAGE))
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def _log(path: Path, segment_bytes: int, window_bytes: int = 0) -> CommitLog:
    log = CommitLog(str(path), segment_bytes, cache_window_bytes=window_bytes)
    log.ensure_active(0)
    return log


def _fill(log: CommitLog, mib: int) -> bytes:
    """Append ``mib`` batches of 1 MiB (distinct bytes), sync; return everything written."""
    written = []
    for i in range(mib):
        chunk = bytes([i % 251]) * MiB
        log.append([[chunk]])
        written.append(chunk)
    log.sync()
    return b"".join(written)


def test_pages_further_than_the_window_behind_the_end_leave_the_cache_and_still_read_back(tmp_path: Path) -> None:
    window = 8 * MiB
    log = _log(tmp_path / "log", 16 * MiB, window)  # 40 MiB: three segments
    data = _fill(log, 40)
    segments = log.segments
    assert len(segments) == 3
    before = sum(resident_bytes(s.path) for s in segments)
    assert before >= 36 * MiB  # just written: the kernel still holds (nearly) all of it

    log.release_cache(log.max_offset)

    cut = log.max_offset - window
    for s in segments:
        old_end = min(s.end_offset, cut) - s.start_offset
        if old_end > 0:
            assert resident_bytes(s.path, 0, old_end) == 0, f"{s.path} keeps pages older than the window"
        if s.end_offset > cut:  # the window itself stays in memory
            new_start = max(cut - s.start_offset, 0)
            assert resident_bytes(s.path, new_start + PAGE) >= s.size_bytes - new_start - 2 * PAGE
    assert log.read(0, len(data)) == data  # dropped pages come back from the disk, equal


def test_the_cache_is_released_in_steps_and_each_range_once(tmp_path: Path) -> None:
    log = _log(tmp_path / "log", 64 * MiB, 4 * MiB)
    _fill(log, 6)
    log.release_cache(log.max_offset)  # 2 MiB past the window: less than a step, nothing yet
    assert CACHE_RELEASE_STEP_BYTES == 4 * MiB  # noqa: SIM300 (the step this test is written for)
    assert resident_bytes(log.segments[0].path, 0, 2 * MiB) == 2 * MiB
    _fill(log, 4)
    log.release_cache(log.max_offset)
    assert resident_bytes(log.segments[0].path, 0, 6 * MiB) == 0
    with open(log.segments[0].path, "rb") as f:  # a reader brings old pages back...
        assert len(f.read(2 * MiB)) == 2 * MiB
    _fill(log, 4)
    log.release_cache(log.max_offset)  # ...and they stay: each range is released once
    assert resident_bytes(log.segments[0].path, 0, 2 * MiB) == 2 * MiB
    assert resident_bytes(log.segments[0].path, 6 * MiB, 10 * MiB) == 0


def test_window_zero_leaves_the_cache_to_the_kernel(tmp_path: Path) -> None:
    log = _log(tmp_path / "log", 64 * MiB)
    _fill(log, 12)
    log.release_cache(log.max_offset)
    assert resident_bytes(log.segments[0].path) >= 11 * MiB


def test_the_store_releases_the_cache_as_it_syncs(tmp_path: Path) -> None:
    """Wired in: the flusher releases after its fsync; consumers still read everything back."""
    s = open_store(str(tmp_path / "d"), **{"commitlog.cache_window_bytes": 4 * MiB, "commitlog.segment_bytes": 64 * MiB})
    try:
        create_topic(s, "t")
        bodies = [os.urandom(64 * 1024) for _ in range(256)]  # 16 MiB in batches of 1 MiB
        for i in range(0, len(bodies), 16):
            end = send(s, "t", bodies[i:i + 16])
            wait_views_applied(s, end)  # the views read each batch before its pages may go
        segment = s.log.segments[-1].path
        # (from 1 MiB: a reader, a view say, may read the first batch again; that page may come back)
        wait_until(lambda: resident_bytes(segment, MiB, 8 * MiB) == 0, 5, "the flusher to release the old pages",
                   observe=lambda: resident_bytes(segment, 0, 8 * MiB))
        assert resident_bytes(segment, s.log.max_offset - 2 * MiB) > 0  # the newest bytes stay cached
        assert read_all(s, "t") == bodies
    finally:
        s.stop()
