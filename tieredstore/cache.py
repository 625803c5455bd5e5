"""A bounded LRU cache of object blocks for read-through (``tieredstore.read_cache_bytes``)."""

from __future__ import annotations

import threading
from collections import OrderedDict


class BlockCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str, block: int) -> bytes | None:
        with self._lock:
            data = self._blocks.get((key, block))
            if data is not None:
                self._blocks.move_to_end((key, block))
            return data

    def put(self, key: str, block: int, data: bytes) -> None:
        if len(data) > self.capacity_bytes:
            return
        with self._lock:
            old = self._blocks.pop((key, block), None)
            if old is not None:
                self.used_bytes -= len(old)
            self._blocks[(key, block)] = data
            self.used_bytes += len(data)
            while self.used_bytes > self.capacity_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self.used_bytes -= len(evicted)

    def drop(self, key: str) -> None:
        with self._lock:
            for k in [k for k in self._blocks if k[0] == key]:
                self.used_bytes -= len(self._blocks.pop(k))
