"""The offsets of DESIGN §2 and the flusher: max ≥ flushed ≥ confirm ≥ applied.

``flushed_offset`` moves when an fsync returns (group commit: one fsync serves every waiter, and
the flusher runs at least every ``commitlog.flush_interval_ms``). ``confirm_offset`` is what the
registered ``ConfirmRule`` allows, never above ``flushed_offset`` and never backwards.
``applied_offset`` is the lowest applied offset of the views (the dispatcher publishes it).

Who waits where: acknowledgements (``wait_ack``) and reads of a write's effect (``wait_view``)
park in ``OffsetWaiters`` (broker/store/waiters.py) and are released only when their offset is
reached; the flusher waits on a condition of its own; the dispatcher and long-polls wait on
``cond``, notified whenever an offset moves. ``wake_all`` wakes every one of them (stop, close).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping

import structlog

from broker import metrics
from broker.config import Config
from broker.errors import BrokerError
from broker.invariant import invariant
from broker.ports import ConfirmRule
from broker.storage.commitlog import CommitLog
from broker.store.waiters import OffsetWaiters, Park, Steps, run, run_async

_OFFSET_MAX = metrics.OFFSET.labels("max")  # children looked up once: the flusher sets them every round
_OFFSET_CONFIRM = metrics.OFFSET.labels("confirm")
log = structlog.get_logger("store")


GIVE_UP_POLL_S = 0.05
# trailing metadata of a refusal after the append: the node answered (it is alive), the write may be stored
OUTCOME_UNKNOWN = (("tidemark-outcome", "unknown"),)


class AloneRule:
    """No replication: a master confirms what it flushed; a slave confirms nothing by itself."""

    def __init__(self, role: Callable[[], str]) -> None:
        self._role = role

    def confirm(self, flushed_offset: int) -> int:
        return flushed_offset if self._role() == "master" else 0

    def insync_replicas(self) -> int:
        return 0

    def replicas_acked(self, offset: int) -> int:
        return 0


class Watermarks:
    def __init__(self, config: Config, log_: CommitLog, stop: threading.Event, role: Callable[[], str], *,
                 flushed_offset: int, confirm_offset: int, applied_offset: int) -> None:
        self.config = config
        self.log = log_
        self.stop = stop
        self.cond = threading.Condition()
        self.flushed_offset = flushed_offset
        self.confirm_offset = confirm_offset
        self.applied_offset = applied_offset
        self.rule: ConfirmRule = AloneRule(role)
        self._flush_cond = threading.Condition()  # the flusher waits here for ``_flush_wanted``
        self._flush_wanted = False
        self._truncations = 0  # bumped by every truncation: an fsync that overlapped one publishes nothing
        self._flushed_waiters = OffsetWaiters()  # ack=flush
        self._confirm_waiters = OffsetWaiters()  # ack=replica
        self._view_waiters: dict[str, OffsetWaiters] = {}  # per view name: a write's effect visible

    def register_rule(self, rule: ConfirmRule) -> None:
        with self.cond:
            self.rule = rule
        self._confirm_waiters.wake(self.confirm_offset)  # their replica count is the new rule's now

    def wake_all(self) -> None:
        """Every waiter looks again (stop, close)."""
        with self.cond:
            self.cond.notify_all()
        with self._flush_cond:
            self._flush_cond.notify_all()
        for waiters in (self._flushed_waiters, self._confirm_waiters, *list(self._view_waiters.values())):
            waiters.wake_all()

    # -- group commit ---------------------------------------------------------------------------
    def want_flush(self) -> None:
        with self._flush_cond:
            self._flush_wanted = True
            self._flush_cond.notify()

    def sync_log(self) -> None:
        """fsync the log, then publish the flushed offset and what it confirms."""
        t0 = time.perf_counter()
        with self.cond:
            generation = self._truncations
        try:
            target = self.log.sync()
        except OSError as exc:  # after a failed fsync the page cache can no longer be trusted
            log.critical("fsync_failed", error=str(exc))
            os._exit(1)
        metrics.FSYNC_SECONDS.observe(time.perf_counter() - t0)
        with self.cond:
            # a truncation during the fsync makes ``target`` name bytes that may be gone (or
            # rewritten, not yet synced): publish nothing from it; the next sync counts
            if target > self.flushed_offset and generation == self._truncations:
                self.flushed_offset = target
                self._advance_confirm()
            self.cond.notify_all()
            flushed, confirm = self.flushed_offset, self.confirm_offset
        self._flushed_waiters.wake(flushed)
        self._confirm_waiters.wake(confirm)
        self.log.release_cache(flushed)  # after the wake: it is not on any acknowledgement's path

    def _advance_confirm(self) -> None:
        confirm = min(self.rule.confirm(self.flushed_offset), self.flushed_offset)
        self.confirm_offset = max(self.confirm_offset, confirm)
        invariant(self.confirm_offset <= self.flushed_offset,
                  f"confirm offset {self.confirm_offset} passed the flushed offset {self.flushed_offset}")

    def advance_confirm(self) -> None:
        """Recompute the confirm offset (replication calls this when a replica acknowledges)."""
        with self.cond:
            self._advance_confirm()
            self.cond.notify_all()
            confirm = self.confirm_offset
        self._confirm_waiters.wake(confirm)  # also when it did not move: a replica count may have

    def truncated(self, offset: int) -> None:
        """The log was cut at ``offset`` (above the confirm offset: nothing confirmed moves)."""
        with self.cond:
            self._truncations += 1
            self.flushed_offset = min(self.flushed_offset, offset)
            self.confirm_offset = min(self.confirm_offset, offset)

    def publish_applied(self, offset: int, views: Mapping[str, int] | None = None) -> None:
        """``offset``: the lowest applied offset of the views; ``views``: each one's, by name."""
        with self.cond:
            self.applied_offset = offset
            self.cond.notify_all()
        for name, applied in (views or {}).items():
            waiters = self._view_waiters.get(name)
            if waiters is not None:
                waiters.wake(applied)

    def view_steps(self, name: str, applied: Callable[[], int], offset: int, timeout_s: float) -> Steps[bool]:
        """Until the view ``name`` (its applied offset: ``applied()``) passed ``offset``; False after
        ``timeout_s`` or a stop."""
        waiters = self._view_waiters.setdefault(name, OffsetWaiters())
        yield Park(waiters, lambda: applied() >= offset or self.stop.is_set(), offset, timeout_s)
        return applied() >= offset

    def wait_view(self, name: str, applied: Callable[[], int], offset: int, timeout_s: float) -> bool:
        return run(self.view_steps(name, applied, offset, timeout_s))

    async def wait_view_async(self, name: str, applied: Callable[[], int], offset: int, timeout_s: float) -> bool:
        return await run_async(self.view_steps(name, applied, offset, timeout_s))

    def flush_loop(self) -> None:
        """The flusher thread: fsync whenever someone waits, and every flush interval."""
        interval_s = self.config["commitlog.flush_interval_ms"] / 1000.0
        while not self.stop.is_set():
            with self._flush_cond:
                self._flush_cond.wait_for(lambda: self._flush_wanted or self.stop.is_set(), interval_s)
                self._flush_wanted = False
            if self.log.max_offset > self.flushed_offset:
                self.sync_log()
            elif self.confirm_offset < self.flushed_offset:  # a replica may have left the in-sync set
                self.advance_confirm()
            _OFFSET_MAX.set(self.log.max_offset)
            _OFFSET_CONFIRM.set(self.confirm_offset)

    # -- acknowledgements -----------------------------------------------------------------------
    def ack_steps(self, offset: int, ack: str, timeout_ms: int, give_up: Callable[[], bool] | None = None) -> Steps[None]:
        """Until ``offset`` is acknowledged in mode ``ack`` (leader: at once; flush: fsynced here;
        replica: confirmed, with enough replicas past it). Gives up (UNAVAILABLE: the outcome is
        unknown) as soon as ``give_up`` says so, checked every ``GIVE_UP_POLL_S``: a master that
        lost its permit stops waiting for a slave that no longer follows it. DEADLINE_EXCEEDED after
        ``timeout_ms``."""
        if ack == "leader" or offset == 0:
            return
        deadline = time.monotonic() + timeout_ms / 1000.0
        waiters, done = self._ack_waiters(offset, ack)
        while True:
            left = deadline - time.monotonic()
            ok = yield Park(waiters, done, offset, min(left, GIVE_UP_POLL_S) if give_up is not None else left)
            if ok or left <= 0 or (give_up is not None and give_up()):
                break
        self._ack_outcome(ok, ack, timeout_ms, give_up)

    def wait_ack(self, offset: int, ack: str, timeout_ms: int, give_up: Callable[[], bool] | None = None) -> None:
        run(self.ack_steps(offset, ack, timeout_ms, give_up))

    def wait_flushed(self, offset: int, timeout_s: float) -> bool:
        """Ask for an fsync and wait until ``offset`` is durable here; False after ``timeout_s``."""
        if self.flushed_offset >= offset:
            return True
        waiters, done = self._ack_waiters(offset, "flush")
        return waiters.wait(done, offset, timeout_s)

    def _ack_waiters(self, offset: int, ack: str) -> tuple[OffsetWaiters, Callable[[], bool]]:
        """Where a wait for ``offset`` in mode ``ack`` parks, and its condition (asks for an fsync)."""
        need = self.config["replication.min_insync_replicas"] - 1  # replicas besides this node
        self.want_flush()
        if ack == "flush":
            return self._flushed_waiters, lambda: self.flushed_offset >= offset
        return self._confirm_waiters, lambda: self.confirm_offset >= offset and self.rule.replicas_acked(offset) >= need

    @staticmethod
    def _ack_outcome(ok: bool, ack: str, timeout_ms: int, give_up: Callable[[], bool] | None) -> None:
        if not ok and give_up is not None and give_up():
            raise BrokerError("UNAVAILABLE", "this node stopped being the master while the write waited for its "
                              "acknowledgement: not acknowledged, outcome unknown (a retried send is stored once)",
                              metadata=OUTCOME_UNKNOWN)
        if not ok:
            raise BrokerError("DEADLINE_EXCEEDED", f"not acknowledged ({ack}) within {timeout_ms} ms; the records may still be stored")

    def insync_replicas(self) -> int:
        """In-sync replicas besides this node."""
        return self.rule.insync_replicas()

    def check_replica_ack_possible(self) -> None:
        wanted = self.config["replication.min_insync_replicas"]
        have = 1 + self.insync_replicas()
        if wanted > have:
            raise BrokerError(
                "UNAVAILABLE",
                f"ack=replica needs {wanted} in-sync replicas (replication.min_insync_replicas); {have} available",
            )
