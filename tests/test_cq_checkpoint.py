"""The consume-queue checkpoint's JSON, assembled from remembered fragments, says exactly what the
view holds at each checkpoint: after growth, a truncation, a re-created topic and a deletion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from broker.views.consume_queue import ENTRY_BYTES, CheckpointJson, QueueFile, TopicInfo


def queue(tmp_path: Path, rel: str, entries: int, next_offset: int) -> QueueFile:
    return QueueFile(str(tmp_path / rel), exists=False, rel=rel, known=(entries * ENTRY_BYTES, next_offset))


def expected(applied: int, topics: dict[str, TopicInfo], files: list[QueueFile], last_ms: int) -> dict[str, Any]:
    """What the checkpoint held before the fragments: one json.dumps of the whole state."""
    return {"applied_offset": applied,
            "topics": {n: {"id": t.topic_id, "queues": t.queues} for n, t in topics.items()},
            "files": {qf.rel: qf.entries * ENTRY_BYTES for qf in files},
            "next": {qf.rel: qf.next_queue_offset for qf in files},
            "last_store_time_ms": last_ms, "sealed": []}


def test_each_checkpoint_says_what_the_view_holds_now(tmp_path: Path) -> None:
    enc = CheckpointJson()
    topics = {"a": TopicInfo(10, 2), "b-1.x_y": TopicInfo(11, 1), "__metadata": TopicInfo(0, 1)}
    files = [queue(tmp_path, "a.10/0.cq", 3, 7), queue(tmp_path, "b-1.x_y.11/0.cq", 1, 1)]

    def check(applied: int, last_ms: int) -> None:
        got = json.loads(enc.state(applied, list(topics.items()), files, last_ms, []))
        assert got == expected(applied, topics, files, last_ms)

    check(100, 5)
    check(100, 5)  # every fragment reused
    files[0].entries, files[0].next_queue_offset = 5, 12  # the queue grew
    check(200, 6)
    files[0].entries, files[0].next_queue_offset = 2, 4  # cut back (a divergence)
    check(150, 6)
    topics["a"] = TopicInfo(20, 4)  # deleted and created again under a new id
    files[0] = queue(tmp_path, "a.20/0.cq", 1, 1)
    check(300, 7)
    del topics["b-1.x_y"]
    files.pop(1)
    check(400, 8)
    assert json.loads(enc.state(0, [], [], 0, [])) == expected(0, {}, [], 0)
