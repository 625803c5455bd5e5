"""Subscribe mode, client side (DESIGN §12): ``BrokerClient.consumer(group, topics)``.

A background thread heartbeats to the master with the queues this member holds (in a cluster of
shards, to the master of the shard coordinating the group; pulls go to each queue's shard); the master
answers with the queues it may hold. New queues are taken at once (from the committed offset, or
``auto_offset_reset`` when none is committed); a queue to release is released inside the next
``poll()`` (or ``commit()``/``close()``), after committing the position of what earlier polls
returned — so the messages a member received and processed are committed before another member
gets the queue, and cooperative members never receive a message twice. A member that has not
polled for ``max_poll_interval_ms`` leaves the group (its queues must not stall), and one whose
heartbeats failed for a whole session drops what it holds (the master gave it away) and rejoins.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from broker.client.errors import BrokerError
from broker.client.messages import PulledMessage
from proto import tidemark_pb2 as pb


class BrokerClient(Protocol):
    """What a consumer uses of ``broker.client.BrokerClient`` (which imports this module)."""

    timeout_s: float

    def clone(self) -> BrokerClient: ...
    def pull(self, topic: str, queue_id: int, offset: int, max_messages: int = ..., max_wait_ms: int = ...,
             max_bytes: int = ..., *, isolation: str = ...) -> Any: ...
    def committed_offset(self, group: str, topic: str, queue_id: int) -> int | None: ...
    def commit_offsets(self, group: str, offsets: Any) -> None: ...
    def queue_bounds(self, topic: str, queue_id: int) -> dict[str, Any]: ...
    def pull_future(self, topic: str, queue_id: int, offset: int, max_messages: int, max_wait_ms: int,
                    isolation: str = ...) -> Any: ...
    def _call(self, method: str, request: Any, *, retry: bool = ..., timeout_s: float | None = ...) -> Any: ...
    def _coordinated(self, group: str, call: Callable[[Any], Any], timeout_s: float | None = ...) -> Any: ...
    def close(self) -> None: ...

QueueKey = tuple[str, int]


def _heartbeat(request: pb.HeartbeatRequest, timeout_s: float, core: Any) -> pb.HeartbeatResponse:
    return core._call("Heartbeat", request, timeout_s=timeout_s)


RESETS = ("latest", "earliest")
IDLE_WAIT_MS = 1000  # a poll that found nothing long-polls one queue up to this long, then looks again
WAKE_CHECK_S = 0.02  # while it waits, how often it looks for a change of assignment
FAILURE_BACKOFF_S = 0.2
LEAVE_TIMEOUT_S = 5.0  # leaving the group at close, hops included (the session expires anyway)


class Consumer:
    """A subscribe-mode member of a consumer group (DESIGN §12): ``poll()`` returns messages of the
    queues the master assigned to it, ``commit()`` stores its positions. Made by
    ``BrokerClient.consumer(...)``; use it in a ``with`` block (leaving commits and leaves the group)."""

    def __init__(self, client: BrokerClient, group: str, topics: Sequence[str], *, session_timeout_ms: int = 10_000,
                 auto_offset_reset: str = "latest", max_poll_interval_ms: int = 300_000, max_messages: int = 1000,
                 client_id: str | None = None, on_assigned: Callable[[set[QueueKey]], None] | None = None,
                 on_revoked: Callable[[set[QueueKey]], None] | None = None,
                 isolation: str = "read_committed") -> None:
        """``on_assigned``/``on_revoked``: called with the queues taken (from the heartbeat thread) or
        about to be released (after their positions are committed, before the master hears of it;
        from the thread that polls). ``isolation``: transactions' messages once committed, or as written."""
        if auto_offset_reset not in RESETS:
            raise ValueError(f"auto_offset_reset must be one of {RESETS}, got {auto_offset_reset!r}")
        if not topics:
            raise ValueError("a consumer subscribes to at least one topic")
        self.group = group
        self.topics = list(topics)
        self.session_timeout_ms = session_timeout_ms
        self.auto_offset_reset = auto_offset_reset
        self.max_poll_interval_ms = max_poll_interval_ms
        self.max_messages = max_messages
        self.isolation = isolation
        self.client_id = client_id or f"{socket.gethostname()}/{os.getpid()}"
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self.member_id = ""
        self.generation = 0
        self._client = client
        self._hb = client.clone()  # heartbeats on a channel of their own: a long pull never delays them
        self._lock = threading.Lock()
        self._positions: dict[QueueKey, int | None] = {}  # held queues -> next offset to return (None: unknown yet)
        self._committed: dict[QueueKey, int] = {}
        self._revoke: set[QueueKey] = set()  # to release inside the next poll
        self._heartbeat_now = threading.Event()
        self._reassigned = threading.Event()  # wakes a poll that waits: queues to take or to release
        self._closed = threading.Event()
        self._last_poll = time.monotonic()
        self._next = 0  # round-robin over held queues
        self.error: BaseException | None = None  # the last heartbeat failure, for callers who look
        self._joined = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{group}", daemon=True)
        self._thread.start()

    # -- public ------------------------------------------------------------------------------------
    @property
    def assignment(self) -> set[QueueKey]:
        """The queues this member holds now."""
        with self._lock:
            return set(self._positions)

    def wait_assignment(self, timeout_s: float) -> bool:
        """Wait until the first heartbeat was answered (True) or ``timeout_s`` passed."""
        return self._joined.wait(timeout_s)

    def poll(self, timeout_ms: int = 1000) -> list[PulledMessage]:
        """Messages from the queues assigned to this member (an empty list after ``timeout_ms``)."""
        deadline = time.monotonic() + timeout_ms / 1000.0
        while True:
            self._last_poll = time.monotonic()
            self._apply_revocations()
            out = self._fetch_once()
            left_ms = int((deadline - time.monotonic()) * 1000)
            if out or left_ms <= 0 or self._closed.is_set():
                return out
            self._idle_wait(min(left_ms, IDLE_WAIT_MS))

    def commit(self) -> None:
        """Commit the position after everything ``poll`` returned, for every queue held."""
        self._apply_revocations()
        with self._lock:
            todo = {q: p for q, p in self._positions.items() if p is not None and self._committed.get(q) != p}
        self._commit(todo)

    def close(self) -> None:
        """Commit, leave the group (its queues move at once), stop heartbeating."""
        if self._closed.is_set():
            return
        try:
            self.commit()
        finally:
            self._closed.set()
            self._heartbeat_now.set()
            if self.member_id:  # the master also ends the heartbeat parked for us
                with contextlib.suppress(Exception):  # leaving is a courtesy: the session expires anyway
                    leave = pb.HeartbeatRequest(group=self.group, member_id=self.member_id, leave=True)
                    self._hb._coordinated(self.group, lambda core: core._call("Heartbeat", leave, retry=False,
                                                                              timeout_s=LEAVE_TIMEOUT_S),
                                          LEAVE_TIMEOUT_S)
            self._thread.join(self._hb.timeout_s)
            self._hb.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- fetching (the caller's thread) -------------------------------------------------------------
    def _fetch_once(self) -> list[PulledMessage]:
        with self._lock:
            queues = sorted(q for q in self._positions if q not in self._revoke)
        if not queues:
            return []
        for i in range(len(queues)):
            q = queues[(self._next + i) % len(queues)]
            msgs = self._pull(q, 0)
            if msgs:
                self._next = (self._next + i + 1) % len(queues)
                return msgs
        return []

    def _idle_wait(self, wait_ms: int) -> None:
        """Until a message may be there (a long-poll on one held queue answers) or the assignment
        changes (the heartbeat thread sets ``_reassigned``), at most ``wait_ms``."""
        with self._lock:
            queues = sorted(q for q in self._positions if q not in self._revoke)
            position = self._positions.get(queues[(self._next + 1) % len(queues)]) if queues else None
        self._reassigned.clear()
        if position is None:
            self._reassigned.wait(wait_ms / 1000.0)
            return
        self._next = (self._next + 1) % len(queues)
        q = queues[self._next]
        fut = self._client.pull_future(q[0], q[1], position, max_messages=1, max_wait_ms=wait_ms,
                                       isolation=self.isolation)
        try:
            while not fut.done() and not self._reassigned.wait(WAKE_CHECK_S):
                pass
        finally:
            fut.cancel()

    def _pull(self, q: QueueKey, wait_ms: int, *, keep: bool = True) -> list[PulledMessage]:
        position = self._position(q)
        if position is None:
            return []
        try:
            result = self._client.pull(q[0], q[1], position, max_messages=self.max_messages, max_wait_ms=wait_ms,
                                       isolation=self.isolation)
        except BrokerError as exc:
            if exc.code.name == "OUT_OF_RANGE" and "retention" in exc.details:
                with self._lock:  # removed by retention: go on from the earliest message still stored
                    if q in self._positions:
                        self._positions[q] = None
                return []
            raise
        if not keep or (not len(result) and result.next_offset == position):
            return list(result) if len(result) else []
        with self._lock:
            if self._positions.get(q) != position:  # released meanwhile
                return []
            self._positions[q] = result.next_offset
        return list(result)

    def _position(self, q: QueueKey) -> int | None:
        with self._lock:
            if q not in self._positions:
                return None
            known = self._positions[q]
        if known is not None:
            return known
        committed = self._client.committed_offset(self.group, q[0], q[1])
        if committed is None:
            bounds = self._client.queue_bounds(q[0], q[1])  # from the queue's own shard
            committed = bounds["max_offset"] if self.auto_offset_reset == "latest" else bounds["min_offset"]
            if self.auto_offset_reset == "latest" and self.isolation == "read_committed":  # the LSO, not the end
                committed = self._client.pull(q[0], q[1], bounds["min_offset"], max_messages=1,
                                              isolation=self.isolation).max_offset
        with self._lock:
            if q in self._positions and self._positions[q] is None:
                self._positions[q] = committed
                self._committed.setdefault(q, committed)
            return self._positions.get(q)

    def _apply_revocations(self) -> None:
        with self._lock:
            revoke = {q for q in self._revoke if q in self._positions}
            if not revoke:
                return
            todo = {q: p for q in revoke if (p := self._positions[q]) is not None and self._committed.get(q) != p}
        self._commit(todo)
        if self._on_revoked is not None:
            self._on_revoked(revoke)
        with self._lock:
            for q in revoke:
                self._positions.pop(q, None)
                self._committed.pop(q, None)
            self._revoke -= revoke
        self._heartbeat_now.set()  # tell the master at once: the queues can move

    def _commit(self, todo: dict[QueueKey, int]) -> None:
        if not todo:
            return
        self._client.commit_offsets(self.group, todo)
        with self._lock:
            for q, p in todo.items():
                if q in self._positions:
                    self._committed[q] = p

    # -- heartbeats (the background thread) ---------------------------------------------------------
    def _run(self) -> None:
        last_ok = time.monotonic()
        wait_ms = 0
        while not self._closed.is_set():
            if time.monotonic() - self._last_poll > self.max_poll_interval_ms / 1000.0:
                self._drop_all()  # the caller stopped polling: let the others have the queues
                self._last_poll = time.monotonic()
            with self._lock:
                owned = sorted(self._positions)
            request = pb.HeartbeatRequest(group=self.group, member_id=self.member_id, topics=self.topics,
                                          owned=[pb.QueueRef(topic=t, queue_id=q) for t, q in owned],
                                          session_timeout_ms=self.session_timeout_ms, max_wait_ms=wait_ms,
                                          client_id=self.client_id)
            try:
                parked_s = self.session_timeout_ms / 1000.0 + wait_ms / 1000.0
                resp = self._hb._coordinated(self.group, functools.partial(_heartbeat, request, parked_s), parked_s)
            except BrokerError as exc:
                self.error = exc
                if self._closed.is_set():
                    return
                if time.monotonic() - last_ok > self.session_timeout_ms / 1000.0:
                    self._drop_all()  # the master gave our queues away by now
                    self.member_id = ""
                self._closed.wait(FAILURE_BACKOFF_S)
                wait_ms = 0
                continue
            except Exception as exc:  # the thread must not die silently: keep trying
                self.error = exc
                self._closed.wait(FAILURE_BACKOFF_S)
                continue
            last_ok = time.monotonic()
            self.error = None
            self.member_id = resp.member_id
            self.generation = resp.generation
            interval_ms = resp.heartbeat_interval_ms or 1000
            assigned = {(r.topic, r.queue_id) for r in resp.assigned}
            with self._lock:
                new = assigned - set(self._positions)
                if new and self._on_assigned is not None:
                    self._on_assigned(new)
                for q in new:
                    self._positions[q] = None  # its position is looked up by the next poll
                self._revoke = set(self._positions) - assigned
                changed = bool(assigned - set(owned))
            self._joined.set()
            if self._revoke or changed:
                self._reassigned.set()
            if self._revoke:  # released by the next poll, which wakes us; until then, keep the session
                self._heartbeat_now.wait(interval_ms / 1000.0)
                self._heartbeat_now.clear()
                wait_ms = 0
            elif changed:
                wait_ms = 0  # report the new queues at once
            else:
                wait_ms = interval_ms  # settled: the master answers when something changes

    def _drop_all(self) -> None:
        with self._lock:
            self._positions.clear()
            self._committed.clear()
            self._revoke.clear()
