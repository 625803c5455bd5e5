"""The object-store interface every tiered backend implements (DESIGN §6).

Five operations, nothing more: a conditional ``put`` (create only; an existing key raises
``ObjectExists`` and is never overwritten), a ranged ``get``, ``list`` by prefix in key order,
``head`` and ``delete``. A put is atomic: readers see the whole object or nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class BackendError(Exception):
    """The backend failed (after its retries); ``op`` names the operation."""

    def __init__(self, op: str, message: str) -> None:
        super().__init__(f"{op}: {message}")
        self.op = op


class ObjectExists(BackendError):
    """A conditional put found the key already there."""

    def __init__(self, key: str) -> None:
        super().__init__("put", f"object {key!r} already exists")
        self.key = key


class ObjectMissing(BackendError):
    def __init__(self, op: str, key: str) -> None:
        super().__init__(op, f"object {key!r} does not exist")
        self.key = key


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size_bytes: int
    modified_s: float  # seconds since the epoch, as the backend reports it
    metadata: dict[str, str] = field(default_factory=dict)  # filled by head(), empty from list()


class Backend(Protocol):
    name: str

    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str]) -> None:
        """Create ``key`` atomically; raise ObjectExists when it is already there."""

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of the object (end None: to its end)."""
        raise NotImplementedError

    def list(self, prefix: str, start_after: str = "") -> list[ObjectInfo]:
        """Every object under ``prefix`` whose key sorts after ``start_after``, in key order."""
        raise NotImplementedError

    def head(self, key: str) -> ObjectInfo | None:
        """Size, time and metadata of ``key``; None when it does not exist."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error when it is already gone)."""

    def close(self) -> None: ...
