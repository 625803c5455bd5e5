"""The consume queue's searches (where is queue offset q, which entry was stored at time t or at
commit offset c) answer as a search over every entry does, on either side of the window read at
once (``SEARCH_WINDOW_ENTRIES``), and a file cut short under a reader is corruption, not a wrong
answer."""

from __future__ import annotations

import bisect
import random
from pathlib import Path

import pytest

from broker.invariant import CorruptionError
from broker.views.consume_queue import ENTRY, ENTRY_BYTES, SEARCH_WINDOW_ENTRIES, QueueFile


def _queue_file(path: Path, count: int, rng: random.Random) -> tuple[QueueFile, list[tuple[int, int, int, int, int]]]:
    """A file of ``count`` entries: batches of 1-50 records, gaps between their commit offsets, store
    times that repeat (several batches in one millisecond) and rise."""
    entries = []
    queue_offset, commit, stored = 0, rng.randrange(1000), 1_700_000_000_000
    for _ in range(count):
        records, size = rng.randint(1, 50), rng.randint(100, 5000)
        entries.append((queue_offset, commit, size, records, stored))
        queue_offset += records
        commit += size + rng.randrange(3) * 777  # other queues' batches between
        stored += rng.choice((0, 0, 1, 5))
    path.write_bytes(b"".join(ENTRY.pack(*e) for e in entries))
    qf = QueueFile(str(path), exists=True)
    assert qf.entries == count and qf.next_queue_offset == queue_offset
    return qf, entries


@pytest.mark.parametrize("count", [0, 1, 2, SEARCH_WINDOW_ENTRIES - 1, SEARCH_WINDOW_ENTRIES,
                                   SEARCH_WINDOW_ENTRIES + 1, 1000, 20_000])
def test_every_search_answers_as_a_search_over_every_entry(tmp_path: Path, count: int) -> None:
    rng = random.Random(count)
    qf, entries = _queue_file(tmp_path / "0.cq", count, rng)
    firsts = [e[0] for e in entries]
    commits = [e[1] for e in entries]
    times = [e[4] for e in entries]
    end = qf.next_queue_offset
    probes = {0, 1, end - 1, end, end + 1, *firsts[:3], *firsts[-3:], *(rng.randrange(end + 2) for _ in range(300))}
    for q in sorted(p for p in probes if p >= 0):
        want = count if q >= end else max(0, bisect.bisect_right(firsts, q) - 1)
        assert qf.locate(q) == want, q
    for t in {times[0] - 1, *times[:3], *times[-3:], times[-1] + 1, *rng.sample(times, min(count, 200))} if times else {0}:
        assert qf.first_at_time(t) == bisect.bisect_right(times, t - 1), t
    for c in {0, *commits[:3], *commits[-3:], *(rng.randrange(commits[-1] + 10) for _ in range(200))} if commits else {5}:
        assert qf.first_at_commit(c) == bisect.bisect_right(commits, c - 1), c


def test_a_file_cut_short_under_a_reader_is_corruption(tmp_path: Path) -> None:
    count = SEARCH_WINDOW_ENTRIES * 4
    qf, entries = _queue_file(tmp_path / "0.cq", count, random.Random(7))
    with open(tmp_path / "0.cq", "r+b") as f:  # the published entries say more than the file holds
        f.truncate((count - 10) * ENTRY_BYTES + 5)
    with pytest.raises(CorruptionError, match="truncated"):
        qf.first_at_commit(entries[-1][1] + 1)  # the window at the end runs past the file's end
    with pytest.raises(CorruptionError, match="truncated"):
        qf.locate(entries[-20][0])  # the last entry first


def test_a_queue_without_entries_is_searched_without_its_file(tmp_path: Path) -> None:
    """A queue's file is made with its first entry: before it, every search answers 0 and opens
    nothing (the chaos run found describe_topic refused NOT_FOUND "queue file 1.cq is gone" for a
    queue whose file did not exist yet, when the search opened it unasked)."""
    qf = QueueFile(str(tmp_path / "never" / "1.cq"), exists=False)
    assert (qf.locate(0), qf.locate(5), qf.first_at_time(123), qf.first_at_commit(10)) == (0, 0, 0, 0)
    assert not (tmp_path / "never").exists()
