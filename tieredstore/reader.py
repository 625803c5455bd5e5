"""Read-through: log bytes below the local log start, fetched from the backend (a ``ColdReader``, broker/ports.py).

Objects are read in blocks of ``BLOCK_BYTES`` (ranged gets) kept in a bounded LRU cache, so a
consumer reading sequentially fetches each block once. Every batch handed back is verified
(header and body CRC32C, its offset) before any reader sees it.
"""

from __future__ import annotations

import threading
import time

import structlog

from broker.errors import BrokerError
from broker.invariant import CorruptionError
from broker.logformat.scan import Mode, scan_bytes
from broker.store import Store
from tieredstore import metrics
from tieredstore.backend import Backend, BackendError, ObjectMissing
from tieredstore.cache import BlockCache
from tieredstore.index import ObjectIndex

log = structlog.get_logger("tieredstore.reader")
BLOCK_BYTES = 4 << 20
REFRESH_S = 5.0  # how stale the object list may get before min_offset() lists again


class ColdReader:
    def __init__(self, store: Store, backend: Backend, index: ObjectIndex, cache: BlockCache) -> None:
        self.store = store
        self.backend = backend
        self.index = index
        self.cache = cache
        self._refreshing = threading.Lock()

    def _refresh(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.index.refreshed_at < REFRESH_S:
            return
        if not self._refreshing.acquire(blocking=force):
            return  # someone else lists right now: use what we have
        try:
            self.index.refresh()
        except BackendError as exc:
            metrics.BACKEND_ERRORS.labels(exc.op).inc()
            log.warning("tiered_list_failed", error=str(exc))
        finally:
            self._refreshing.release()

    def min_offset(self) -> int:
        self._refresh()
        local = self.store.log.min_offset
        return min(local, self.index.contiguous_from(local))

    def read(self, offset: int, length: int) -> bytes:
        parts: list[bytes] = []
        pos, end = offset, offset + length
        refreshed = False
        while pos < end:
            obj = self.index.find(pos)
            if obj is None:
                if refreshed:
                    break
                self._refresh(force=True)
                refreshed = True
                continue
            block = (pos - obj.start) // BLOCK_BYTES
            try:
                data = self._block(obj.key, block, obj.size_bytes)
            except ObjectMissing:  # deleted by tiered retention since we listed
                self.index.remove(obj)
                continue
            at = pos - obj.start - block * BLOCK_BYTES
            take = min(len(data) - at, end - pos)
            if take <= 0:
                raise CorruptionError(f"object {obj.key} is shorter than its name says", path=obj.key)
            parts.append(data[at : at + take])
            pos += take
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        _verify(out, offset)
        return out

    def _block(self, key: str, block: int, size_bytes: int) -> bytes:
        data = self.cache.get(key, block)
        if data is not None:
            metrics.CACHE_HITS.inc()
            return data
        start = block * BLOCK_BYTES
        try:
            data = self.backend.get(key, start, min(size_bytes, start + BLOCK_BYTES))
        except ObjectMissing:
            raise
        except BackendError as exc:
            metrics.BACKEND_ERRORS.labels(exc.op).inc()
            raise BrokerError("UNAVAILABLE", f"tiered storage read failed: {exc}") from exc
        metrics.READ_BYTES.inc(len(data))
        self.cache.put(key, block, data)
        return data


def _verify(data: bytes, offset: int) -> None:
    """Whole batches from ``offset``, each with valid CRCs (the paired check after a read); a short
    read ends quietly: the caller sees the length and reports the range as missing."""
    for _ in scan_bytes(data, offset, mode=Mode.PREFIX, verify_body=True, path="tiered storage"):
        pass
