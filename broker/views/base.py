"""What every view is (DESIGN §1): state derived from the log, persisted with its applied offset.

Recovery, the dispatcher, retention and snapshot bundles use views only through this class, so
none of them knows a view by name. A view applies batches in log order, each batch at or above its
``applied_offset``; ``end_round`` publishes a run of them; ``checkpoint`` persists
``(state, applied_offset)`` atomically; ``load`` takes the newest valid checkpoint at start.
"""

from __future__ import annotations

import abc
import os

from broker.logformat.batch import BatchHeader
from broker.storage.regular import open_regular

COPY_CHUNK_BYTES = 1 << 20


class View(abc.ABC):
    name: str
    applied_offset: int

    # -- recovery (broker/store/recovery.py) -----------------------------------------------------
    @abc.abstractmethod
    def load(self) -> bool:
        """Take the newest valid checkpoint; False when there is none (the view starts at 0).
        Raises ``CorruptionError``/``ValueError``/``KeyError``/``TypeError`` for a checkpoint that
        cannot be used."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget all state: the view is rebuilt by replaying the log from offset 0."""

    # -- applying (broker/store/dispatcher.py) ---------------------------------------------------
    @abc.abstractmethod
    def apply(self, header: BatchHeader, batch: memoryview) -> None:
        """Apply one batch whose ``base_offset`` is at or above ``applied_offset``."""

    @abc.abstractmethod
    def end_round(self, offset: int) -> None:
        """Every batch below ``offset`` is applied; make that visible to readers."""

    @abc.abstractmethod
    def checkpoint(self) -> None:
        """Persist ``(state, applied_offset)`` atomically."""

    def checkpoint_due(self) -> bool:
        """A checkpoint of its own is due although no record was applied (a clock of its own)."""
        return False

    # -- retention (broker/store/retention.py) ---------------------------------------------------
    def replay_floor(self) -> int | None:
        """Lowest commit offset a restart may replay this view from, if lower than its checkpoints."""
        return None

    def read_floor(self) -> int | None:
        """Records at or above this offset must stay readable (locally or in tiered storage)."""
        return None

    # -- snapshot bundles (replication/bundle.py) --------------------------------------------------
    @abc.abstractmethod
    def stage(self, data_dir: str, staging: str) -> None:
        """Copy the state of the last checkpoint into ``staging``, laid out as under ``data_dir``
        (called right after ``checkpoint``, with the dispatcher stopped)."""

    def close(self) -> None:  # noqa: B027 - most views hold nothing to close
        """Release files."""


def copy_prefix(src: str, data_dir: str, staging: str, length: int | None = None) -> None:
    """Copy the first ``length`` bytes (all when None) of ``src`` to the same place under ``staging``."""
    dst = os.path.join(staging, os.path.relpath(src, data_dir))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(open_regular(src, os.O_RDONLY), "rb") as fi, open(dst, "wb") as fo:
        remaining = os.fstat(fi.fileno()).st_size if length is None else length
        while remaining > 0:
            chunk = fi.read(min(COPY_CHUNK_BYTES, remaining))
            if not chunk:
                raise OSError(f"{src} is shorter than {length} bytes")
            fo.write(chunk)
            remaining -= len(chunk)
