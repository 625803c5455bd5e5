"""The interface every view implements (see ``broker.views``)."""

from __future__ import annotations

from typing import Protocol

from broker.logformat.batch import BatchHeader


class View(Protocol):
    name: str
    applied_offset: int

    def apply(self, header: BatchHeader, batch: memoryview) -> None:
        """Apply one batch whose ``base_offset`` is at or above ``applied_offset``."""

    def end_round(self, offset: int) -> None:
        """Every batch below ``offset`` is applied; make that visible to readers."""

    def checkpoint(self) -> None:
        """Persist ``(state, applied_offset)`` atomically."""

    def close(self) -> None: ...
