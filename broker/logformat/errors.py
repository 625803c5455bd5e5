"""The error raised when stored or received log bytes fail validation."""

from __future__ import annotations


class CorruptionError(Exception):
    """Stored bytes fail validation somewhere other than a repairable torn tail."""

    def __init__(self, message: str, *, path: str = "", offset: int = -1) -> None:
        where = f" ({path} at offset {offset})" if path and offset >= 0 else f" ({path})" if path else ""
        super().__init__(message + where)
        self.message = message
        self.path = path
        self.offset = offset
