"""The client's API, transactions (DESIGN §14): sends over several topics and queues and consumer
offsets that become visible together, or not at all.

``c.transaction(tid)`` is a context manager (commit on leaving, abort on an exception);
``c.begin_transaction(tid, check=...)`` returns the ``Transaction`` to end by hand, and keeps a
check-back stream open (``checkback.py``) so the master can ask ``check`` about it past its timeout.
A transaction's sends use its own producer id and sequences: a retried send is stored once.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from broker.client.checkback import CheckBack, CheckQuestion
from broker.client.core import SEND_RETRYABLE, _Producer, _request
from broker.client.data_api import DataAPI
from broker.client.errors import BrokerError, FailedPrecondition, TransactionAborted
from broker.client.messages import Message, Receipt
from broker.client.sharded_txn import ShardedTransaction
from broker.client.txn_base import TransactionBase
from broker.logformat.txn_records import TXN_PID_BIT
from proto import tidemark_pb2 as pb

__all__ = ["CheckQuestion", "Transaction", "TransactionAborted", "TransactionsAPI"]


@dataclass(frozen=True)
class TransactionInfo:
    transactional_id: str
    producer_id: int
    state: str  # open, committed, aborted
    age_ms: int
    write_age_ms: int
    timeout_ms: int
    queues: list[tuple[str, int, int]]  # (topic, queue, first offset)
    reason: str

    @classmethod
    def of(cls, t: pb.TransactionInfo) -> TransactionInfo:
        return cls(t.transactional_id, t.producer_id, t.state, t.age_ms, t.write_age_ms, t.timeout_ms,
                   [(q.topic, q.queue_id, q.first_offset) for q in t.queues], t.reason)

    def as_dict(self) -> dict[str, Any]:
        return {"transactional_id": self.transactional_id, "producer_id": f"{self.producer_id:#x}",
                "state": self.state, "age_ms": self.age_ms, "write_age_ms": self.write_age_ms,
                "timeout_ms": self.timeout_ms, "topics": sorted({t for t, _, _ in self.queues}),
                "queues": [{"topic": t, "queue_id": q, "first_offset": o} for t, q, o in self.queues],
                "reason": self.reason}


class Transaction(TransactionBase):
    """One transaction: ``send`` to any topics and queues, ``commit_offsets``, then ``commit`` or
    ``abort``. Not for several threads at once.

    It begins on the master with its first send (``SendRequest.begin``: one call, as Kafka's
    producer begins a transaction locally), or at ``commit`` if nothing was sent: that is when its
    transactional id's older open transaction is fenced, and when ``producer_id`` and ``epoch``
    are known (0 before)."""

    def __init__(self, client: TransactionsAPI, begin: pb.BeginTransactionRequest) -> None:
        self.client = client
        self.transactional_id = begin.transactional_id
        self.producer_id = 0
        self.epoch = 0
        self.timeout_ms = begin.timeout_ms
        self.counted = begin.count_messages
        self.state = "open"
        self.messages_sent = 0
        self._begin: pb.BeginTransactionRequest | None = begin  # until the master has begun it
        self._producer = _Producer(producer_id=0)
        self._offsets: dict[tuple[str, str, int], int] = {}
        self._broken: BrokerError | None = None
        self._reason = ""  # why it ended

    def send(self, topic: str, messages: Sequence[Message], ack: str | None = None,
             timeout_ms: int | None = None, *, commit: bool = False) -> Sequence[Receipt]:
        """Messages of the transaction (invisible to read_committed readers until it commits).

        A transaction begun without ``check`` is counted: its sends are answered at ``ack``
        (default ``leader``: appended on the master) and the commit, replicated, covers them all;
        a commit on a master whose log lacks some of them (a failover lost them) aborts instead
        (``TransactionAborted``, reason ``incomplete``). A check-back transaction's sends are
        answered as ack=replica whatever ``ack`` asks. After a send that failed no other is taken;
        a counted transaction can still commit if the failure left the send's outcome unknown (its
        messages are counted: the commit succeeds only if the log holds them all, else it aborts,
        reason ``incomplete``), any other only abort.

        ``commit=True``: this send is the transaction's last and commits it, in one call and one
        replication round (``SendRequest.commit``); answered as ``commit()`` is, and raising what
        it raises. A retry whose first attempt committed answers committed, with no receipts. With
        consumer offsets to commit, the send and the commit are two calls."""
        self._check_open()
        self._check_unbroken()
        if commit and self._offsets:  # a send's commit takes no offsets
            receipts = self.send(topic, messages, ack, timeout_ms)
            self.commit()
            return receipts
        ending = (pb.EndTransactionRequest(transactional_id=self.transactional_id, producer_id=self.producer_id,
                                           commit=True, messages_sent=self.messages_sent + len(messages))
                  if commit else None)
        try:
            # a beginning send names transaction 1<<63: a node that does not know SendRequest.begin
            # refuses it ("not open") instead of storing plain messages
            receipts = self.client._send_as(self._producer, topic, messages,
                                            ack or ("leader" if self.counted else "replica"), timeout_ms,
                                            transaction=self.producer_id or TXN_PID_BIT, begin=self._begin,
                                            begun=self._begun if self._begin is not None else None,
                                            commit=ending, ended=self._ended if commit else None)
        except BrokerError as exc:
            self._broken = exc  # the sequences cannot go on: no other send
            if exc.code in SEND_RETRYABLE:  # maybe stored: counted, so a commit needs them in the log
                self.messages_sent += len(messages)
            raise
        finally:
            if self.state != "open":
                self.client._checkback_forget(self.transactional_id, self.producer_id)
        self.messages_sent += len(messages)
        if commit and self.state == "open":  # a node without SendRequest.commit stored the send only
            self.commit()
        elif commit and self.state != "committed":
            raise TransactionAborted(self._reason, f"transaction {self.transactional_id!r} was aborted "
                                     f"({self._reason}) before this commit: none of it is visible")
        return receipts

    def _ended(self, answer: pb.EndTransactionResponse) -> None:
        if answer.outcome not in (pb.TRANSACTION_OUTCOME_COMMITTED, pb.TRANSACTION_OUTCOME_ABORTED):
            return  # no outcome: a node that does not know SendRequest.commit (send then commits by itself)
        self.state = "committed" if answer.outcome == pb.TRANSACTION_OUTCOME_COMMITTED else "aborted"
        self._reason = answer.reason

    def _begin_now(self) -> None:
        """Begin on the master with a call of its own (nothing sent yet, or fencing asked for)."""
        assert self._begin is not None
        try:
            self._begun(self.client._call("BeginTransaction", self._begin))
        except BrokerError as exc:
            if exc.code in SEND_RETRYABLE:
                self._broken = exc  # it may have begun (and fenced): abort begins again to end it
            raise

    def _begun(self, answer: pb.BeginTransactionResponse) -> None:
        if not answer.producer_id & TXN_PID_BIT:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "the node answered no transaction "
                                     "(a version without SendRequest.begin?); nothing of it is visible")
        self.producer_id = self._producer.producer_id = answer.producer_id
        self.epoch = answer.epoch
        self.timeout_ms = answer.timeout_ms
        self.counted = answer.counted
        self._begin = None

    def commit_offsets(self, group: str, topic: str, offsets: Mapping[int, int]) -> None:
        """Consumer offsets (``{queue_id: next offset}``) stored only if the transaction commits."""
        self._check_open()
        for queue_id, offset in offsets.items():
            self._offsets[(group, topic, queue_id)] = offset

    def commit(self) -> None:
        """Commit: answered once the decision is replicated (ack=replica) and visible.
        ``TransactionAborted`` if it was aborted meanwhile (its timeout, an operator, fencing)."""
        self._check_open()
        self._check_unbroken(committing=True)
        offsets = [_request(pb.CommittedOffset, group=g, topic=t, queue_id=q, offset=o)
                   for (g, t, q), o in self._offsets.items()]
        if self._begin is not None:  # nothing sent: begun here (its offsets still commit with it)
            self._begin_now()
        outcome = self._end(True, offsets)
        if outcome.outcome != pb.TRANSACTION_OUTCOME_COMMITTED:
            raise TransactionAborted(outcome.reason, f"transaction {self.transactional_id!r} was aborted "
                                     f"({outcome.reason}) before this commit: none of it is visible")

    def abort(self) -> None:
        """Abort: none of its messages or offsets ever becomes visible. ``FailedPrecondition`` if
        it had committed (a committing call whose answer was lost committed it)."""
        if self.state != "open":
            return
        unknown = self._broken is not None and self._broken.code in SEND_RETRYABLE
        if self._begin is not None and not unknown:  # never begun on the master: nothing to end
            self.state = "aborted"
            self.client._checkback_forget(self.transactional_id, 0)
            return
        if self._begin is not None:  # a beginning call's outcome is unknown: it may have begun, id unknown
            self._begin_now()  # the same begin id: joins what it began (or begins one, to end it)
        if self._end(False, []).outcome == pb.TRANSACTION_OUTCOME_COMMITTED:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, f"transaction {self.transactional_id!r} "
                                     "had committed (a call whose answer was lost committed it): it is visible")

    def _end(self, commit: bool, offsets: list[pb.CommittedOffset]) -> pb.EndTransactionResponse:
        req = pb.EndTransactionRequest(transactional_id=self.transactional_id, producer_id=self.producer_id,
                                       commit=commit, offsets=offsets, messages_sent=self.messages_sent)
        try:
            response = self.client._call("EndTransaction", req)  # a retried end answers the first outcome
        finally:
            self.client._checkback_forget(self.transactional_id, self.producer_id)
        self._ended(response)
        return response


class TransactionsAPI(DataAPI):
    """Transactions (DESIGN §14)."""

    _checkback: CheckBack | None = None
    _checkback_lock = threading.Lock()

    def begin_transaction(self, transactional_id: str, timeout_ms: int = 0,
                          check: Callable[[CheckQuestion], str] | None = None,
                          fence: bool = False) -> Transaction | ShardedTransaction:
        """Open a transaction (an older instance's open one with this id is aborted, fenced, when
        this one reaches the master: with its first send, or its commit if it sent nothing).
        ``timeout_ms``: aborted this long after its first write (0: the server's default). ``check``:
        past the timeout the master asks it ``"commit"``, ``"abort"`` or ``"unknown"`` (ask again).
        ``fence``: begin on the master now (one call), so the older instance's open transaction is
        aborted before this returns: a consume-transform-produce loop's first transaction, before
        it reads its committed input offsets (as Kafka's ``initTransactions``)."""
        # begin_id: a retry of the call that begins it joins what its first attempt began
        req = _request(pb.BeginTransactionRequest, transactional_id=transactional_id, timeout_ms=timeout_ms,
                       check_back=check is not None, count_messages=check is None,
                       begin_id=secrets.randbits(63) + 1)
        if self.sharded:  # over shards (docs/shards.md): a coordinator shard and participants, counted
            if check is not None:
                raise ValueError("a transaction in a cluster of shards has no check-back (check): it is counted")
            sharded = ShardedTransaction(self, req)
            if fence:
                sharded._begin_now()
            return sharded
        if check is not None:
            self._checkback_start().register(transactional_id, check)
        tx = Transaction(self, req)
        if fence:
            tx._begin_now()
        return tx

    @contextlib.contextmanager
    def transaction(self, transactional_id: str, timeout_ms: int = 0) -> Iterator[Transaction | ShardedTransaction]:
        """``with c.transaction(tid) as tx:`` commits on leaving the block, aborts on an exception."""
        with self.begin_transaction(transactional_id, timeout_ms) as tx:
            yield tx

    def list_transactions(self) -> list[dict[str, Any]]:
        """The open transactions, oldest first; in a cluster of shards those of every shard (a
        transaction over shards once per shard it spans), each with its ``shard``."""
        if not self.sharded:
            response = self._call("ListTransactions", pb.ListTransactionsRequest())
            return [TransactionInfo.of(t).as_dict() for t in response.transactions]
        self._learn_routes([])
        listed: list[dict[str, Any]] = []
        for shard in self._routes.shards():
            response = self._shard_core(shard)._call("ListTransactions", pb.ListTransactionsRequest())
            listed.extend({**TransactionInfo.of(t).as_dict(), "shard": shard} for t in response.transactions)
        return sorted(listed, key=lambda t: -t["age_ms"])

    def describe_transaction(self, transactional_id: str) -> dict[str, Any]:
        """A transactional id's latest transaction: open, or how it ended (over shards: as its
        coordinator shard knows it)."""
        request = _request(pb.DescribeTransactionRequest, transactional_id=transactional_id)
        response = self._coordinated(transactional_id, lambda core: core._call("DescribeTransaction", request))
        return TransactionInfo.of(response.transaction).as_dict()

    def abort_transaction(self, transactional_id: str) -> dict[str, Any]:
        """An operator's abort of the id's open transaction (admin role); over shards on its
        coordinator shard, which delivers the abort to every participant."""
        request = _request(pb.AbortTransactionRequest, transactional_id=transactional_id)
        response = self._coordinated(transactional_id, lambda core: core._call("AbortTransaction", request))
        return TransactionInfo.of(response.transaction).as_dict()

    def _checkback_start(self) -> CheckBack:
        with self._checkback_lock:
            if self._checkback is None:
                self._checkback = CheckBack(self)
            return self._checkback

    def _checkback_forget(self, tid: str, pid: int) -> None:
        if self._checkback is not None:
            self._checkback.forget(tid)

    def close(self) -> None:
        if self._checkback is not None:
            self._checkback.stop()
        super().close()
