"""The producer's side of check-back (DESIGN §14): a ``TransactionChecks`` stream kept open to the
master on a connection of its own, answering the master's questions about this client's
transactions past their timeout with each one's ``check`` callback.

The stream names the transactional ids it answers for when it opens (again after a reconnect:
a failover, a restart); a question about an id without a callback (ended meanwhile) or a callback
that raises is answered ``unknown`` (asked again later, then aborted after ``check_max``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from broker.client.core import _redirect
from proto import tidemark_pb2 as pb

RECONNECT_S = (0.05, 2.0)  # backoff between attempts to (re)open the stream
DECISIONS = ("commit", "abort", "unknown")


@dataclass(frozen=True)
class CheckQuestion:
    """What the master asks: should this transaction commit?"""

    transactional_id: str
    producer_id: int
    attempt: int


class CheckBack:
    def __init__(self, client: Any) -> None:
        self._client = type(client)(list(client.addresses), **client._options)  # a connection of its own
        self._checks: dict[str, Callable[[CheckQuestion], str]] = {}
        self._lock = threading.Lock()
        self._outbox: queue.Queue[pb.TransactionCheckAnswer | None] = queue.Queue()
        self._stop = threading.Event()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="tidemark-checkback", daemon=True)
        self._thread.start()

    def register(self, tid: str, check: Callable[[CheckQuestion], str]) -> None:
        with self._lock:
            self._checks[tid] = check
        self._outbox.put(pb.TransactionCheckAnswer(transactional_ids=[tid]))

    def forget(self, tid: str) -> None:
        with self._lock:
            self._checks.pop(tid, None)

    def stop(self) -> None:
        self._stop.set()
        self._outbox.put(None)
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=2.0)
        self._client.close()

    def _run(self) -> None:
        delay = RECONNECT_S[0]
        while not self._stop.is_set():
            try:
                self._stream_once()
                delay = RECONNECT_S[0]
            except grpc.RpcError as exc:
                master = _redirect(exc)
                c = self._client
                if master and master != c.current_address:
                    if master not in c.addresses:
                        c.addresses.append(master)
                    c._connect(c.addresses.index(master))
                elif len(c.addresses) > 1:
                    c._rotate()
            self._stop.wait(delay)
            delay = min(delay * 2, RECONNECT_S[1])

    def _stream_once(self) -> None:
        outbox: queue.Queue[pb.TransactionCheckAnswer | None] = queue.Queue()
        self._outbox = outbox
        with self._lock:
            tids = list(self._checks)

        def answers() -> Iterator[pb.TransactionCheckAnswer]:
            yield pb.TransactionCheckAnswer(transactional_ids=tids)
            while True:
                item = outbox.get()
                if item is None:
                    return
                yield item

        c = self._client
        self._call = call = c._stub.TransactionChecks(answers(), metadata=c._metadata)
        try:
            for question in call:
                outbox.put(self._answer(question))
        finally:
            outbox.put(None)
            with contextlib.suppress(Exception):
                call.cancel()

    def _answer(self, q: pb.TransactionCheck) -> pb.TransactionCheckAnswer:
        with self._lock:
            check = self._checks.get(q.transactional_id)
        decision = "unknown"
        if check is not None:
            try:
                decision = check(CheckQuestion(q.transactional_id, q.producer_id, q.attempt))
            except Exception:  # the producer cannot tell now: ask again later
                decision = "unknown"
            if decision not in DECISIONS:
                decision = "unknown"
        return pb.TransactionCheckAnswer(transactional_id=q.transactional_id, producer_id=q.producer_id,
                                         decision=decision)
