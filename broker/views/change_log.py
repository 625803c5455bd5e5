"""Topic creates and deletes in the daemon's log: at most one line a second for each kind.

A node that applies a storm of creates (many services creating their topics at once) logged one
line per topic. Rendering and writing those lines cost about a fifth of the create rate
(interleaved runs with 32 creates in flight: 738-781 creates/s with a line each, 868-1,009 without),
and at 1,000 lines a second journald's default rate limit (10,000 messages in 30 s) would start
dropping the daemon's lines, the important ones with them.

So a change that comes after a quiet second is logged at once, in the same shape as before
(``change=topic.create topic=t queues=4 offset=...``). Changes that follow within the second are
gathered and logged together, ``count=N topics={name: queues, ...}`` (deletes: a list of names),
by the next change once the second has passed, or by ``flush``: the metadata view flushes at its
checkpoint (which follows any applied change within ``checkpoint.interval_ms``) and at close.
"""

from __future__ import annotations

import time

import structlog

log = structlog.get_logger("metadata")
INTERVAL_S = 1.0


class ChangeLog:
    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.enabled = False  # set when the store starts: changes replayed by recovery are not logged again
        self.interval_s = interval_s
        self._pending: dict[str, dict[str, int | None]] = {}  # change -> topic -> queues (None: a delete)
        self._offset = 0  # of the newest change gathered
        self._logged_at = -interval_s  # monotonic time of the last line

    def note(self, change: str, topic: str, offset: int, queues: int | None = None) -> None:
        if not self.enabled:
            return
        self._pending.setdefault(change, {})[topic] = queues
        self._offset = offset
        if time.monotonic() - self._logged_at >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        """Log what was gathered (nothing when nothing was)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for change, topics in pending.items():
            if len(topics) == 1:
                [(topic, queues)] = topics.items()
                extra = {} if queues is None else {"queues": queues}
                log.info("metadata_changed", change=change, topic=topic, **extra, offset=self._offset)
            elif all(q is None for q in topics.values()):
                log.info("metadata_changed", change=change, count=len(topics), topics=list(topics), offset=self._offset)
            else:
                log.info("metadata_changed", change=change, count=len(topics), topics=topics, offset=self._offset)
        self._logged_at = time.monotonic()
