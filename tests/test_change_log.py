"""Topic creates and deletes in the log: one line for a lone change, one line a second in a storm."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from broker.logformat import system_records
from broker.views.change_log import ChangeLog
from tests.storeutil import create_topic, open_store


def test_a_lone_change_is_logged_at_once_and_a_storm_in_one_line_a_second() -> None:
    changes = ChangeLog(interval_s=3600.0)  # the window never ends by itself here: flush() ends it
    with capture_logs() as lines:
        changes.note(system_records.TOPIC_CREATE, "t", 10, 4)  # not enabled yet (recovery): nothing
        changes.enabled = True
        changes.note(system_records.TOPIC_CREATE, "orders", 100, 4)
        assert lines == [{"event": "metadata_changed", "log_level": "info", "change": system_records.TOPIC_CREATE,
                          "topic": "orders", "queues": 4, "offset": 100}]
        for i in range(1000):
            changes.note(system_records.TOPIC_CREATE, f"s{i}", 200 + i, 2)
        changes.note(system_records.TOPIC_DELETE, "orders", 1300)
        changes.note(system_records.TOPIC_DELETE, "s7", 1301)
        assert len(lines) == 1  # gathered within the second
        changes.flush()
        changes.flush()  # nothing new: nothing logged
    assert len(lines) == 3
    created, deleted = lines[1], lines[2]
    assert created["count"] == 1000 and created["topics"] == {f"s{i}": 2 for i in range(1000)}
    assert deleted["change"] == system_records.TOPIC_DELETE and deleted["topics"] == ["orders", "s7"]
    assert created["offset"] == deleted["offset"] == 1301


def test_a_storm_of_creates_is_logged_by_the_checkpoint_that_follows_it(tmp_path: Path) -> None:
    """In a real store: the first create is logged when applied, the next 50 (within the second)
    by the metadata view's checkpoint; every name is in the log once."""
    s = open_store(str(tmp_path / "d"))
    try:
        with capture_logs() as lines:
            for i in range(51):
                create_topic(s, f"t{i}", queues=2)
            first = [line for line in lines if line["event"] == "metadata_changed"]
            with s.dispatcher.lock:
                s.dispatcher.checkpoint_views()
        logged = [line for line in lines if line["event"] == "metadata_changed"]
        assert first[0]["topic"] == "t0" and len(logged) <= 10  # a line a second at most (3 unless the machine crawls)
        names = [n for line in logged for n in (line["topics"] if "topics" in line else [line["topic"]])]
        assert sorted(names) == sorted(f"t{i}" for i in range(51))
    finally:
        s.stop()
