"""What a one-pair ``Transaction`` and a ``ShardedTransaction`` share: the state checks and the
``with`` block (commit on leaving, abort on an exception)."""

from __future__ import annotations

import contextlib
from typing import Self

import grpc

from broker.client.core import SEND_RETRYABLE
from broker.client.errors import BrokerError, FailedPrecondition


class TransactionBase:
    transactional_id: str
    state: str  # open, committed, aborted
    counted: bool
    _broken: BrokerError | None  # a send that failed: no other is taken

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def _check_unbroken(self, committing: bool = False) -> None:
        if self._broken is None:
            return
        if committing and self.counted and self._broken.code in SEND_RETRYABLE:
            return  # the count decides: committed only if every message it counts is in the log
        raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"a send of this transaction failed ({self._broken}); abort it") from self._broken

    def _check_open(self) -> None:
        if self.state != "open":
            raise ValueError(f"transaction {self.transactional_id!r} is {self.state}")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self.state != "open":
            return
        if kind is None:
            self.commit()
        else:
            # the exception that ended the block is what the caller sees (``state``: "committed" if a
            # committing call whose answer was lost had committed it)
            with contextlib.suppress(BrokerError):
                self.abort()
