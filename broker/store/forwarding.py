"""Timers of queues that moved to another shard (docs/shards.md "Moving a queue"): the firing round
hands over the due timers whose queue is sealed here; this thread delivers them to the queue's
shard (``TxnPeers.forward_timers``: stored there once, each under its own producer id), then marks
them ``forwarded`` in this log. A forward that fails leaves them pending: the firing round's sweep
hands them over again, and the queue's shard answers a repeat as the duplicate it is. Its own
thread, so that a shard that does not answer never delays the timers firing here.
"""

from __future__ import annotations

import queue as queue_
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import crc32c
import structlog

from broker.errors import BrokerError
from broker.logformat import batch as bf
from broker.logformat import timer_props as tr
from broker.ports import IncomingBatch, Placement, TxnPeers
from broker.storage.failpoints import failpoint
from broker.threads import NamedThread

log = structlog.get_logger("timer.forwarding")
FORWARD_TIMEOUT_S = 5.0
FORWARD_TIMERS_MAX = 1000  # timers per ForwardTimers call
FORWARD_BYTES_MAX = 4 << 20  # and their keys, bodies and properties (gRPC refuses a request past its limit)
RETRY_AFTER_S = 1.0  # a queue whose forward failed is tried again this much later (the sweep's pace)


@dataclass(frozen=True)
class Due:
    """One due timer of a queue that moved: its offset here, due time, and the delivery's record."""

    offset: int
    at: int
    key: bytes
    body: bytes
    props: bytes  # as a delivery carries them (``timer_props.delivery_props``)


class TimerForwarder:
    def __init__(self, append_events: Callable[[list[IncomingBatch]], None], done: Callable[[list[int], bool], None],
                 placement: Callable[[], Placement | None], peers: Callable[[], TxnPeers | None]) -> None:
        """``append_events``: stores the ``forwarded`` events (acknowledged); ``done(offsets, forwarded)``:
        tells the firing service which timers left its hands (forwarded, or to be handed over again)."""
        self._append_events = append_events
        self._done = done
        self._placement = placement
        self._peers = peers
        self._queue: queue_.Queue[tuple[str, int, list[Due]] | None] = queue_.Queue()
        self._thread: threading.Thread | None = None
        self._failed: dict[tuple[str, int], float] = {}  # queue -> when its forward last failed (monotonic)

    def available(self) -> bool:
        return self._placement() is not None and self._peers() is not None

    def resting(self, topic: str, queue: int) -> bool:
        """A queue whose forward failed a moment ago: not handed over yet."""
        failed = self._failed.get((topic, queue))
        return failed is not None and time.monotonic() - failed < RETRY_AFTER_S

    def submit(self, topic: str, queue: int, timers: list[Due]) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = NamedThread(target=self._run, name="timer-forwarding", daemon=True)
            self._thread.start()
        self._queue.put((topic, queue, timers))

    def stop(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(FORWARD_TIMEOUT_S + 5)
        self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            topic, queue, timers = item
            chunks = list(_chunks(timers))
            for i, chunk in enumerate(chunks):
                try:
                    if not self._forward(topic, queue, chunk):
                        self._done([t.offset for c in chunks[i:] for t in c], False)
                        break
                except Exception as exc:  # a bug must not end the thread silently: the timers stay pending
                    self._failed[(topic, queue)] = time.monotonic()
                    error = exc.message if isinstance(exc, BrokerError) else f"{type(exc).__name__}: {exc}"
                    log.warning("timers_not_forwarded", topic=topic, queue=queue, count=sum(len(c) for c in chunks[i:]),
                                error=error[:200], note="kept pending here; handed over again in a moment")
                    self._done([t.offset for c in chunks[i:] for t in c], False)
                    break
                self._done([t.offset for t in chunk], True)

    def _forward(self, topic: str, queue: int, timers: list[Due]) -> bool:
        placement, peers = self._placement(), self._peers()
        if placement is None or peers is None:
            return False
        owners = placement.owners(topic)
        if owners is None or not 0 <= queue < len(owners):
            return False  # deleted meanwhile: the firing round drops them once the log deletes the topic
        owner = owners[queue][0]
        if owner == placement.shard:
            return False  # moved back here: they fire here once the queue starts again
        stored = peers.forward_timers(owner, placement.shard, topic, queue,
                                      [(t.offset, t.key, t.body, t.props) for t in timers], FORWARD_TIMEOUT_S)
        failpoint("timer_after_forward")
        target = tr.target_props(topic, queue)
        events = [(b"", b"", tr.event_props(tr.FORWARDED, t.offset, t.at, target)) for t in timers]
        raw, _ = bf.encode_records(events)
        self._append_events([IncomingBatch(tr.TIMER_TOPIC, 0, raw, len(events), crc32c.crc32c(raw))])
        self._failed.pop((topic, queue), None)
        log.info("timers_forwarded", topic=topic, queue=queue, to_shard=owner, count=len(timers), stored=stored)
        return True


def _chunks(timers: list[Due]) -> Iterator[list[Due]]:
    """``timers`` in order, in calls of at most ``FORWARD_TIMERS_MAX`` timers and about
    ``FORWARD_BYTES_MAX`` bytes (one timer alone may pass it: the request limit is far above)."""
    chunk: list[Due] = []
    size = 0
    for t in timers:
        weight = len(t.key) + len(t.body) + len(t.props) + 32
        if chunk and (len(chunk) >= FORWARD_TIMERS_MAX or size + weight > FORWARD_BYTES_MAX):
            yield chunk
            chunk, size = [], 0
        chunk.append(t)
        size += weight
    if chunk:
        yield chunk
