"""The master's transaction timeouts: a thread that sweeps open transactions (``TxnService.sweep``).

On a slave it sleeps (a promoted slave starts sweeping what it inherited: transactions whose
timeout passed are checked back or aborted within one interval). Attempts at check-back are kept
in memory: a new master asks again from the first.
"""

from __future__ import annotations

import threading

import structlog

from broker.errors import BrokerError
from broker.store import Store
from broker.threads import NamedThread
from broker.txn.checks import CheckStreams
from broker.txn.service import TxnService

log = structlog.get_logger("txn")
SWEEP_INTERVAL_S = 0.2


class TxnSweeper:
    def __init__(self, store: Store, service: TxnService, checks: CheckStreams) -> None:
        self.store = store
        self.service = service
        self.checks = checks
        self.attempts: dict[int, tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread = NamedThread(target=self._run, name="txn-sweeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            if self.store.closing:
                return
            if self.store.role != "master":
                self.attempts.clear()
                continue
            try:
                self.service.sweep(lambda t, attempt: self.checks.ask(t.tid, t.pid, attempt), self.attempts)
            except BrokerError as exc:  # not writable now (fenced, a full disk, lost the permit): next time
                log.debug("txn_sweep_refused", error=exc.message[:200])
            except Exception as exc:  # a sweep must never end the thread: timeouts would stop
                log.error("txn_sweep_failed", error=f"{type(exc).__name__}: {exc}"[:300])
