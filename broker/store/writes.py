"""The one write step: append, wait for the ack mode, refuse if no longer master, wait until applied.

Every writer of the master goes through it: client sends, metadata changes (topics, consumer
offsets, a DLQ topic), pop leases and acks, timer deliveries and cancels, and the records still to
come (transactions). After the append, a write is acknowledged only if

1. its ack mode holds (``leader``: appended; ``flush``: fsynced here; ``replica``: confirmed, with
   ``replication.min_insync_replicas``); while the write permit is strict (the failsafe with etcd
   down for every node, DESIGN §11) every mode waits for a replica as well;
2. this node is still the master with a valid permit (``Store.check_still_master_after_append``):
   a wait gives up as soon as it is not, and a write acknowledged by nobody is refused
   UNAVAILABLE with the outcome unknown (it may be stored; a retried send is stored once);
3. when the caller reads its own write (``applied``: a pop's lease, a created topic), that view
   has applied it (DEADLINE_EXCEEDED otherwise: written, not yet visible).

The waits are one generator (``steps``) driven in a thread (``write``, ``acknowledged``) or on the
event loop (``write_async``, ``acknowledged_async``): the rule exists once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.config import Config
from broker.errors import BrokerError
from broker.logformat import txn_records
from broker.ports import BatchReceipt, IncomingBatch
from broker.store.appender import Appender, TxnBuild
from broker.store.permit import WritePermit
from broker.store.waiters import Steps, run, run_async
from broker.store.watermarks import Watermarks
from broker.views import View

Changes = list[tuple[str, dict[str, Any]]]
TxnRecord = txn_records.Record


class WriteStep:
    def __init__(self, config: Config, appender: Appender, watermarks: Watermarks, permit: WritePermit,
                 lost_mastership: Callable[[], bool], check_still_master_after_append: Callable[[], None]) -> None:
        self.config = config
        self.appender = appender
        self.watermarks = watermarks
        self.permit = permit
        self.lost_mastership = lost_mastership
        self.check_after_append = check_still_master_after_append

    # -- what follows an append -------------------------------------------------------------------
    def steps(self, end: int, ack: str, timeout_ms: int | None = None, applied: View | None = None,
              what: str = "the write") -> Steps[None]:
        """The waits after an append that ends at ``end`` (the module docstring's rules 1-3)."""
        timeout_ms = self._timeout(timeout_ms)
        used = self.permit.effective_ack(ack)
        yield from self.watermarks.ack_steps(end, used, timeout_ms, give_up=self.lost_mastership)
        if self.permit.strict and used != "replica":  # the failsafe began while we waited
            yield from self.watermarks.ack_steps(end, "replica", timeout_ms, give_up=self.lost_mastership)
        self.check_after_append()
        if applied is not None:
            seen = yield from self.watermarks.view_steps(applied.name, lambda: applied.applied_offset, end,
                                                         timeout_ms / 1000.0)
            if not seen:
                raise BrokerError("DEADLINE_EXCEEDED", f"{what} is stored but not applied within {timeout_ms} ms")

    def acknowledged(self, end: int, ack: str, *, timeout_ms: int | None = None, applied: View | None = None,
                     what: str = "the write") -> None:
        run(self.steps(end, ack, timeout_ms, applied, what))

    async def acknowledged_async(self, end: int, ack: str, *, timeout_ms: int | None = None,
                                 applied: View | None = None, what: str = "the write") -> None:
        await run_async(self.steps(end, ack, timeout_ms, applied, what))

    # -- append and acknowledge ---------------------------------------------------------------------
    def write(self, batches: list[IncomingBatch], ack: str, *, internal: bool = False, timeout_ms: int | None = None,
              applied: View | None = None, not_before_ms: int = 0, what: str = "the write") -> list[BatchReceipt]:
        receipts, end = self.appender.append(batches, internal=internal, not_before_ms=not_before_ms)
        self.acknowledged(end, ack, timeout_ms=timeout_ms, applied=applied, what=what)
        return receipts

    def txn_steps(self, build: TxnBuild, applied: View | None,
                  ack: Callable[[list[TxnRecord]], str] | None, timeout_ms: int | None = None
                  ) -> Steps[tuple[list[TxnRecord], int]]:
        """``__txn`` records decided under the append lock (``Appender.append_txn``: one short
        write), acknowledged as ack=replica (or as ``ack(records)`` says) and applied by ``applied``
        (if given): a transaction's end is answered only once a promoted slave would know it, and
        a reader sees what it decided. Driven by ``run`` (a thread) or ``run_async`` (the event loop)."""
        records, end = self.appender.append_txn(build)
        if end:
            mode = ack(records) if ack is not None else "replica"
            yield from self.steps(end, mode, timeout_ms, applied, "the transaction record")
        return records, end

    def write_system(self, changes: Changes, *, ack: str = "replica", timeout_ms: int | None = None,
                     applied: View | None = None) -> int:
        """Metadata records (``__metadata``) in one batch; returns where they end."""
        end = self.appender.append_system(changes)
        self.acknowledged(end, ack, timeout_ms=timeout_ms, applied=applied, what=changes[0][0])
        return end

    async def write_system_async(self, changes: Changes, *, applied: View | None = None) -> int:
        self.watermarks.check_replica_ack_possible()
        end = self.appender.append_system(changes)
        await self.acknowledged_async(end, "replica", applied=applied, what=changes[0][0])
        return end

    def _timeout(self, timeout_ms: int | None) -> int:
        top = self.config["limits.send_timeout_ms"]
        return min(timeout_ms, top) if timeout_ms else top
