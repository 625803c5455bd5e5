"""Check-back streams (DESIGN §14): producers that answer for their transactions past the timeout.

A producer that began a transaction with ``check_back`` keeps a ``TransactionChecks`` stream
open and names the transactional ids it answers for. The sweeper (a thread) asks through
``ask``; the stream's coroutine (on the server's event loop) sends the question and hands the
answers to the transaction service. Bounded: streams (``STREAMS_MAX``), ids per stream
(``IDS_PER_STREAM_MAX``) and questions waiting per stream (``QUEUED_MAX``; beyond it a question
is dropped and asked again at the next interval).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from broker import metrics
from broker.errors import BrokerError

STREAMS_MAX = 1000
IDS_PER_STREAM_MAX = 10_000
QUEUED_MAX = 1000


@dataclass(frozen=True)
class Question:
    tid: str
    pid: int
    attempt: int


@dataclass(eq=False)
class CheckStream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Question | None]
    tids: set[str] = field(default_factory=set)


class CheckStreams:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: set[CheckStream] = set()
        self._by_tid: dict[str, list[CheckStream]] = {}

    def open(self) -> CheckStream:
        """A new stream (on the running loop); RESOURCE_EXHAUSTED beyond ``STREAMS_MAX``."""
        stream = CheckStream(asyncio.get_running_loop(), asyncio.Queue(QUEUED_MAX))
        with self._lock:
            if len(self._streams) >= STREAMS_MAX:
                raise BrokerError("RESOURCE_EXHAUSTED", f"{STREAMS_MAX} check-back streams are open on this node")
            self._streams.add(stream)
        return stream

    def register(self, stream: CheckStream, tids: list[str]) -> None:
        with self._lock:
            if len(stream.tids) + len(tids) > IDS_PER_STREAM_MAX:
                raise BrokerError("RESOURCE_EXHAUSTED", f"a check-back stream answers for at most "
                                  f"{IDS_PER_STREAM_MAX} transactional ids")
            for tid in tids:
                if tid not in stream.tids:
                    stream.tids.add(tid)
                    self._by_tid.setdefault(tid, []).append(stream)

    def close(self, stream: CheckStream) -> None:
        with self._lock:
            self._streams.discard(stream)
            for tid in stream.tids:
                streams = self._by_tid.get(tid, [])
                if stream in streams:
                    streams.remove(stream)
                if not streams:
                    self._by_tid.pop(tid, None)

    def connected(self, tid: str) -> bool:
        with self._lock:
            return bool(self._by_tid.get(tid))

    def ask(self, tid: str, pid: int, attempt: int) -> bool:
        """Send a question to the newest stream that answers for ``tid`` (from any thread);
        False when none does."""
        with self._lock:
            streams = self._by_tid.get(tid)
            stream = streams[-1] if streams else None
        if stream is None:
            return False
        question = Question(tid, pid, attempt)

        def put() -> None:
            if not stream.queue.full():
                stream.queue.put_nowait(question)

        try:
            stream.loop.call_soon_threadsafe(put)
        except RuntimeError:  # the loop closed: the server is stopping
            return False
        metrics.TXN_CHECKS.inc()
        return True
