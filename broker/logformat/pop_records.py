"""Records of the ``__pop`` system topic: pop-mode lease changes as JSON bodies, one per call.

Each record's key is the change type, its body a JSON object; offsets are lists of runs
``[start, count]`` (queue offsets). Types (spec: docs/formats/pop-records.md):

- ``pop.lease``  ``{"g", "t", "until", "tag", "queues": [{"q", "from"?, "runs", "dead", "gone"}]}``:
  one pop call. ``from`` starts the group's state of a queue (its first pop); ``runs`` are leased
  until ``until`` (epoch ms) under ``tag``; ``dead`` went to the DLQ; ``gone`` were removed by
  retention before they could be delivered again. Both end for good.
- ``pop.ack``    ``{"g", "acks": [[topic, queue, runs], ...]}``: leases ended for good.
- ``pop.nack``   ``{"g", "until", "nacks": [[topic, queue, runs], ...]}``: visible again at ``until``.
- ``pop.invisible`` ``{"g", "t", "q", "o", "until", "tag"}``: one lease moved to a new deadline
  under a new tag (the old receipt handle stops working).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from broker.logformat.system_records import POP_TOPIC

__all__ = ["POP_TOPIC", "from_runs", "to_runs"]
LEASE = "pop.lease"
ACK = "pop.ack"
NACK = "pop.nack"
INVISIBLE = "pop.invisible"
TYPES = (LEASE, ACK, NACK, INVISIBLE)

Runs = list[list[int]]


def to_runs(offsets: np.ndarray | list[int]) -> Runs:
    """Sorted distinct offsets as ``[[start, count], ...]``."""
    arr = np.asarray(offsets, dtype=np.int64)
    if arr.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(arr) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [arr.size]))
    return [[int(arr[s]), int(e - s)] for s, e in zip(starts, ends, strict=True)]


def from_runs(runs: Sequence[Sequence[int]]) -> np.ndarray:
    """The offsets of ``runs`` as one int64 array."""
    if not runs:
        return np.empty(0, dtype=np.int64)
    return np.concatenate([np.arange(int(s), int(s) + int(n), dtype=np.int64) for s, n in runs])
