"""The chaos run's history: every operation a client invoked, one JSON object a line.

Each client process appends to its own file (``<run>/history/<client>.jsonl``) and ``load`` merges
them by invoke time. An operation is written once, when it completed (or was given up on):

    {"client": "p1", "op": "send", "value": {...}, "outcome": "ok" | "fail" | "unknown",
     "invoke_ms": 1764000000123.4, "complete_ms": 1764000000130.9, "result": {...}, "error": "..."}

Times are the harness's wall clock in epoch ms (``time.time()`` of the client process; every
process runs on this host, so they share it; the daemons' clock hook does not touch it).
``outcome`` is ``ok`` when the call answered success, ``fail`` when it answered an error that
guarantees nothing happened (INVALID_ARGUMENT, ALREADY_EXISTS, NOT_FOUND, FAILED_PRECONDITION
before any write), ``unknown`` otherwise (deadline, UNAVAILABLE after the call was sent, a
connection lost): indeterminate outcomes are kept apart and never counted as failures.

Operations and their ``value`` / ``result`` (ids are unique strings, ``<client>-<n>``):

- ``send``: value ``{"topic": T, "msgs": [{"id": ID, "key": K | null, "kseq": int | null,
  "deliver_at_ms": int | null}, ...]}`` (one call, ack=replica; a keyed message's ``kseq`` counts
  up per key from 0, one producer owns a key); result ``{"receipts": [{"queue_id", "queue_offset",
  "commit_offset", "timer_offset"}, ...]}`` in the order of ``msgs``.
- ``recv`` (a subscribe-mode member got messages from one poll): value ``{"group", "topic",
  "queue_id", "msgs": [[queue_offset, ID, store_time_ms, deliver_at_ms | 0], ...]}``; outcome ok;
  ``complete_ms`` is when the poll returned.
- ``commit``: value ``{"group", "topic", "queue_id", "offset"}`` (one per queue committed).
- ``assign`` (a member took a queue): value ``{"group", "topic", "queue_id", "offset"}``, the offset
  it starts reading at (its committed offset, or the queue's start when none was committed).
- ``pop``: value ``{"group", "topic"}``; result ``{"msgs": [[queue_id, queue_offset, ID,
  delivery_count], ...]}``.
- ``ack``: value ``{"group", "topic", "msgs": [[queue_id, queue_offset, ID], ...]}``; result
  ``{"refused": [[queue_id, queue_offset], ...]}`` (messages whose lease had ended: not acked).
- ``create_topic``: value ``{"topic"}``.
- ``status`` (client ``sampler``, every ~100 ms per node): value ``{"node": "a" | "b"}``; result
  ``{"role", "epoch", "node_id", "fenced", "confirm_offset", "max_offset", "flushed_offset",
  "tiered_uploaded_offset"}`` (outcome fail/unknown when the node did not answer).
- ``fault`` (client ``nemesis``): value ``{"kind", "node", "phase": "start" | "end"}``; outcome ok.
- ``converge`` (client ``nemesis``, after each heal): result ``{"from", "below", "equal"}``: both
  logs compared below the common confirm offset; outcome fail when the slave was not back in sync
  within a minute.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUTCOMES = ("ok", "fail", "unknown")


def now_ms() -> float:
    return time.time() * 1000.0


class Recorder:
    """Appends one client's operations to its history file (thread-safe; flushed per line so a
    killed client loses at most the line it was writing)."""

    def __init__(self, run_dir: str | Path, client: str) -> None:
        self.client = client
        path = Path(run_dir) / "history"
        path.mkdir(parents=True, exist_ok=True)
        self._f = open(path / f"{client}.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def record(self, op: str, value: dict[str, Any], outcome: str, invoke_ms: float, *,
               result: dict[str, Any] | None = None, error: str = "", complete_ms: float | None = None) -> None:
        assert outcome in OUTCOMES, outcome
        entry: dict[str, Any] = {"client": self.client, "op": op, "value": value, "outcome": outcome,
                                 "invoke_ms": round(invoke_ms, 1),
                                 "complete_ms": round(now_ms() if complete_ms is None else complete_ms, 1)}
        if result is not None:
            entry["result"] = result
        if error:
            entry["error"] = error[:300]
        line = json.dumps(entry, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._f.close()


def load(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every operation of a run, ordered by invoke time (a torn last line of a killed client is skipped)."""
    ops = [op for path in sorted((Path(run_dir) / "history").glob("*.jsonl")) for op in client_ops(path)]
    ops.sort(key=lambda e: (e["invoke_ms"], e["complete_ms"]))
    return ops


def client_ops(path: Path) -> Iterator[dict[str, Any]]:
    """One client's operations so far, in the order written (a line still being written, or torn
    by a kill, is skipped)."""
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def write_json(path: str | Path, data: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    os.replace(tmp, path)
