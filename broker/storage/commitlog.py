"""The commit log: one append-only byte sequence for all topics, cut into segments.

Offsets are byte positions (global). The log knows nothing of views or confirm offsets; it
appends whole batches, reads byte ranges, syncs, truncates and deletes old segments.
Recovery (``broker/store/recovery.py``) decides what is valid before the log takes writes.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
from collections.abc import Sequence

from broker.storage.failpoints import failpoint, fsync_dir
from broker.storage.handles import HANDLES
from broker.storage.segment import FsyncFailed, Segment, parse_segment_name

CACHE_RELEASE_STEP_BYTES = 4 << 20  # page cache is given back in steps of this many bytes, not at every fsync


class CommitLog:
    """Segments in ``directory``; the last one is active and takes appends."""

    def __init__(self, directory: str, segment_bytes: int, *, read_only: bool = False, cache_window_bytes: int = 0) -> None:
        """``read_only``: open existing segments for reading only (``log verify``); never create.
        ``cache_window_bytes``: see ``release_cache`` (0: leave the page cache to the kernel)."""
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.cache_window_bytes = cache_window_bytes
        self._cache_released_to = 0  # log bytes below this offset were already given back to the kernel
        if not read_only:
            os.makedirs(directory, exist_ok=True)
        self._segments: list[Segment] = []
        self._starts: list[int] = []
        self._lock = threading.Lock()  # guards the segment list; appends are serialised by the caller
        self._read_only = read_only
        self._pinned = ""  # the active segment stays open (written and synced all the time)
        names = os.listdir(directory)
        starts = sorted(s for s in (parse_segment_name(n) for n in names) if s is not None)
        self.stray_names = sorted(n for n in names if parse_segment_name(n) is None)  # not segments: never read
        for start in starts:
            self._segments.append(Segment(directory, start, read_only=read_only))
            self._starts.append(start)
        self._pin_active()

    # -- shape -------------------------------------------------------------------------------
    @property
    def segments(self) -> list[Segment]:
        with self._lock:
            return list(self._segments)

    @property
    def min_offset(self) -> int:
        with self._lock:
            return self._segments[0].start_offset if self._segments else 0

    @property
    def max_offset(self) -> int:
        with self._lock:
            return self._segments[-1].end_offset if self._segments else 0

    def ensure_active(self, start_offset: int) -> None:
        """Create the first segment at ``start_offset`` when the log has none."""
        with self._lock:
            if not self._segments:
                self._add_segment(start_offset)

    def _add_segment(self, start_offset: int) -> Segment:
        seg = Segment(self.directory, start_offset, create=True)
        fsync_dir(self.directory)
        self._segments.append(seg)
        self._starts.append(start_offset)
        self._pin_active()
        return seg

    def _pin_active(self) -> None:
        """Keep the last segment's descriptor open; let the previous one go back to the LRU."""
        active = self._segments[-1].path if self._segments and not self._read_only else ""
        if active == self._pinned:
            return
        if self._pinned:
            HANDLES.unpin(self._pinned)
        if active:
            HANDLES.pin(active)
        self._pinned = active

    # -- writes ------------------------------------------------------------------------------
    def append(self, batches: Sequence[Sequence[bytes | memoryview]]) -> int:
        """Append batches (each a list of byte chunks); return the new max offset.

        The caller serialises appends and has already written each batch's offset into its
        header, computed from ``max_offset``. A batch never spans two segments.
        """
        with self._lock:
            active = self._segments[-1]
        pending: list[bytes | memoryview] = []
        pending_bytes = 0
        for chunks in batches:
            size = sum(len(c) for c in chunks)
            if active.size_bytes + pending_bytes > 0 and active.size_bytes + pending_bytes + size > self.segment_bytes:
                if pending:
                    active.append(pending)
                    pending, pending_bytes = [], 0
                active = self._roll(active)
            pending += chunks
            pending_bytes += size
        if pending:
            failpoint("commitlog_before_write")
            active.append(pending)
            failpoint("commitlog_after_write")
        return active.end_offset

    def _roll(self, active: Segment) -> Segment:
        # The old segment is durable before its successor exists: a power cut can never leave a
        # short segment followed by another (recovery would see a gap).
        try:
            active.sync()
        except OSError as exc:
            raise FsyncFailed(f"fsync of {active.path} failed: {exc}") from exc
        with self._lock:
            return self._add_segment(active.end_offset)

    def sync(self) -> int:
        """fdatasync everything written so far; return the offset that is now durable."""
        with self._lock:
            active = self._segments[-1] if self._segments else None
            target = active.end_offset if active else 0
        if active is not None:
            failpoint("commitlog_before_fsync")
            active.sync()
            failpoint("commitlog_after_fsync")
        return target

    def release_cache(self, flushed_offset: int) -> None:
        """Give back to the kernel the cached pages of log bytes more than ``cache_window_bytes``
        below ``flushed_offset`` (all synced, so all clean), in steps of ``CACHE_RELEASE_STEP_BYTES``.

        Why: a log's page cache otherwise grows until memory is full, every append taking a page
        nobody gave back. Freeing pages as fast as the log takes new ones keeps appends on recycled
        pages; on a VM whose memory the host backs on first touch (these machines), a 1 MiB write
        into fresh pages took 2.5-2.8 ms against 0.35 ms into recycled ones (docs/operations.md).
        Readers of the newest ``cache_window_bytes`` (the views, the slave, consumers keeping up)
        still read memory; older reads go to the disk. Called after each sync (the flusher, a
        slave's follower, a stop); only synced offsets are named, and a race with a truncation can
        only drop pages that are read again: advice never changes the file.
        """
        if not self.cache_window_bytes:
            return
        upto = flushed_offset - self.cache_window_bytes
        with self._lock:
            start = self._cache_released_to
            if upto - start < CACHE_RELEASE_STEP_BYTES:
                return
            self._cache_released_to = upto
            ranges = [(seg, seg.start_offset, min(upto, seg.end_offset)) for seg in self._segments
                      if seg.end_offset > start and seg.start_offset < upto]
        for seg, base, end in ranges:  # whole pages: the kernel keeps a page the range covers only in part
            lo = (max(start, base) - base) // mmap.PAGESIZE * mmap.PAGESIZE
            seg.drop_cache(lo, end - base - lo)

    def truncate(self, offset: int) -> None:
        """Remove every byte at or above ``offset`` (a batch boundary), durably."""
        with self._lock:
            self._cache_released_to = min(self._cache_released_to, offset)
            while len(self._segments) > 1 and self._segments[-1].start_offset >= offset:
                seg = self._segments.pop()
                self._starts.pop()
                if seg.path == self._pinned:
                    HANDLES.unpin(seg.path)
                    self._pinned = ""
                seg.close()
                os.unlink(seg.path)
            if self._segments:
                seg = self._segments[-1]
                if seg.end_offset > offset:
                    seg.truncate(max(0, offset - seg.start_offset))
            self._pin_active()
            fsync_dir(self.directory)

    def delete_segments_below(self, offset: int) -> list[str]:
        """Delete whole non-active segments that end at or below ``offset``; return their paths."""
        removed: list[str] = []
        with self._lock:
            while len(self._segments) > 1 and self._segments[0].end_offset <= offset:
                seg = self._segments.pop(0)
                self._starts.pop(0)
                seg.close()
                os.unlink(seg.path)
                removed.append(seg.path)
        if removed:
            fsync_dir(self.directory)
        return removed

    # -- reads -------------------------------------------------------------------------------
    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) clipped to the log's end; may span segments."""
        parts: list[bytes] = []
        with self._lock:
            i = bisect.bisect_right(self._starts, offset) - 1
            segs = self._segments[max(i, 0) :]
        for seg in segs:
            if length <= 0:
                break
            if offset >= seg.end_offset:
                continue
            if offset < seg.start_offset:
                break  # below the log start: the caller checks min_offset
            chunk = seg.read(offset - seg.start_offset, min(length, seg.end_offset - offset))
            if not chunk:
                break
            parts.append(chunk)
            offset += len(chunk)
            length -= len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def locate(self, offset: int, length: int) -> list[tuple[str, int, int]]:
        """Where bytes [offset, offset+length) lie: (segment path, position in it, bytes) per segment,
        clipped like ``read`` (below the log start or past its end: the caller checks the total)."""
        spans: list[tuple[str, int, int]] = []
        with self._lock:
            i = bisect.bisect_right(self._starts, offset) - 1
            for seg in self._segments[max(i, 0) :]:
                if length <= 0 or offset < seg.start_offset:
                    break
                take = min(length, seg.end_offset - offset)
                if take > 0:
                    spans.append((seg.path, offset - seg.start_offset, take))
                    offset += take
                    length -= take
        return spans

    def close(self) -> None:
        with self._lock:
            if self._pinned:
                HANDLES.unpin(self._pinned)
                self._pinned = ""
            for seg in self._segments:
                seg.close()
            self._segments.clear()
            self._starts.clear()
