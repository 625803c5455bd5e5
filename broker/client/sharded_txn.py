"""A transaction in a cluster of shards (docs/shards.md "Transactions across shards"): sends to
queues of any shards and consumer offsets, visible together on every shard or not at all.

The transaction begins on its **coordinator shard** (its transactional id's slot, as a group's;
a node of another shard refuses naming it): that begin fences an older instance of the id. Before
its first send to another shard, the producer begins a **participant** transaction there
(``BeginTransactionRequest.coordinator``) and has the coordinator record it
(``AddTransactionParticipant``, replicated); the shard's messages go into that one. The commit is
one call to the coordinator naming every participant with the messages sent to it: the
coordinator asks each to prepare, decides, answers once its decision is replicated, and delivers
it to each participant (retried across failovers of either side until each has it).

Every transaction here is counted (no check-back over shards): a send is answered at the ack mode
it asks for; a participant whose log lacks messages its producer counted aborts the whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from broker.client.core import ROUTE_HOPS_MAX, SEND_RETRYABLE, _Producer, _request
from broker.client.data_api import DataAPI, PartOf, _by_shard, _grouped, _outcome, _receipts, _sent
from broker.client.errors import BrokerError, FailedPrecondition, TransactionAborted
from broker.client.messages import Message, Receipt, SendGroup
from broker.client.txn_base import TransactionBase
from broker.logformat.txn_records import TXN_PID_BIT
from proto import tidemark_pb2 as pb


@dataclass
class _Part:
    """The transaction on one shard: its producer id there, sequences, messages answered."""

    pid: int
    producer: _Producer
    messages_sent: int = 0
    offsets: list[pb.CommittedOffset] = field(default_factory=list)


class ShardedTransaction(TransactionBase):
    """``send`` to any topics, ``commit_offsets``, then ``commit`` or ``abort``; the same API as a
    one-pair ``Transaction``. Not for several threads at once."""

    def __init__(self, client: DataAPI, begin: pb.BeginTransactionRequest) -> None:
        self.client = client
        self.transactional_id = begin.transactional_id
        self.timeout_ms = begin.timeout_ms
        self.producer_id = 0
        self.epoch = 0
        self.state = "open"
        self.counted = True  # over shards every transaction is
        self.coordinator = ""  # the coordinator's shard, once begun
        self._begin = begin
        self._parts: dict[str, _Part] = {}  # shard -> its part (the coordinator's own among them)
        self._offsets: dict[tuple[str, str, int], int] = {}
        self._broken: BrokerError | None = None

    # -- begin ----------------------------------------------------------------------------------
    def _begin_now(self) -> None:
        """Begin on the coordinator shard (the first call goes to any node; a refusal names it)."""
        try:
            answer = self._begin_on(self.transactional_id, self._begin)
        except BrokerError as exc:
            if exc.code in SEND_RETRYABLE:
                self._broken = exc  # it may have begun (and fenced): abort begins again to end it
            raise
        if not answer.producer_id & TXN_PID_BIT or not answer.shard:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, "the coordinator answered no transaction "
                                     "over shards (a version without them?); nothing of it is visible")
        self.producer_id = answer.producer_id
        self.epoch = answer.epoch
        self.timeout_ms = answer.timeout_ms
        self.coordinator = answer.shard
        self._parts[answer.shard] = _Part(answer.producer_id, _Producer(producer_id=answer.producer_id))

    def _part(self, shard: str) -> _Part:
        """The transaction on ``shard``: begun there (a participant) and recorded by the coordinator
        before anything is sent there."""
        part = self._parts.get(shard)
        if part is not None:
            return part
        answer = self.client._shard_core(shard)._call("BeginTransaction", self._participant_begin())
        return self._joined(shard, answer.producer_id)

    def _participant_begin(self, group: str = "") -> pb.BeginTransactionRequest:
        return _request(pb.BeginTransactionRequest, transactional_id=self.transactional_id, timeout_ms=self.timeout_ms,
                        count_messages=True, begin_id=self._begin.begin_id, coordinator=self.coordinator,
                        coordinator_epoch=self.epoch, group=group)

    def _begin_on(self, name: str, req: pb.BeginTransactionRequest) -> pb.BeginTransactionResponse:
        """``req`` on the shard coordinating ``name`` (a transactional id or a group): the first
        call goes to any node, whose refusal names that shard."""
        answer: pb.BeginTransactionResponse = self.client._coordinated(
            name, lambda core: core._call("BeginTransaction", req))
        return answer

    def _group_part(self, group: str) -> _Part:
        """The part on the shard coordinating ``group`` (where its offsets are kept): the
        coordinator's own, or a participant begun there (the same begin id joins one begun for
        sends). The first call goes to any node; a refusal names the group's shard."""
        answer = self._begin_on(group, self._participant_begin(group))
        if not answer.producer_id:  # the coordinator shard itself
            return self._parts[self.coordinator]
        return self._joined(answer.shard, answer.producer_id)

    def _joined(self, shard: str, pid: int) -> _Part:
        """Participant ``pid`` on ``shard``, recorded by the coordinator before anything is sent there."""
        part = self._parts.get(shard)
        if part is not None and part.pid == pid:
            return part
        party = pb.TransactionParticipant(shard=shard, producer_id=pid)
        add = pb.AddTransactionParticipantRequest(transactional_id=self.transactional_id,
                                                  producer_id=self.producer_id, participant=party)
        self._on_coordinator("AddTransactionParticipant", add)
        part = self._parts[shard] = _Part(pid, _Producer(producer_id=pid))
        return part

    def _on_coordinator(self, method: str, request: object) -> object:
        return self.client._shard_core(self.coordinator)._call(method, request)

    # -- sends ----------------------------------------------------------------------------------
    def send(self, topic: str, messages: Sequence[Message], ack: str | None = None,
             timeout_ms: int | None = None, *, commit: bool = False) -> Sequence[Receipt]:
        """Messages of the transaction, each queue's to its shard; ``commit=True`` commits after."""
        self._check_open()
        self._check_unbroken()
        if not self.coordinator:
            self._begin_now()
        receipts = self._send_routed(topic, messages, ack or "leader", timeout_ms)
        if commit:
            self.commit()
        return receipts

    def _send_routed(self, topic: str, messages: Sequence[Message], ack: str,
                     timeout_ms: int | None) -> Sequence[Receipt]:
        """Each shard's part to its shard, side by side (the first on this thread): a participant
        begun and recorded there first if new. A part refused for a queue another shard owns now
        stored nothing: routes are asked for again and those queues sent there."""
        client = self.client
        if not messages:
            return _receipts(topic, 0, [])
        queues = client._queue_count(topic)
        by_queue, delayed = _grouped(messages, queues, client._sticky_queue(topic, queues))
        done: list[SendGroup] = []
        for hop in range(ROUTE_HOPS_MAX + 1):
            parts = _by_shard(by_queue, delayed, lambda q: client._shard_of(topic, q) or self.coordinator)

            def send(shard: str | None, parts: dict[str | None, PartOf] = parts) -> list[SendGroup]:
                assert shard is not None
                return self._send_part(topic, messages, ack, timeout_ms, shard, parts[shard])
            first, *others = parts
            futures = [(shard, client._submit(_outcome, send, shard)) for shard in others]
            outcomes = [(first, _outcome(send, first)), *((shard, f.result()) for shard, f in futures)]
            refused: BrokerError | None = None
            failed: list[BrokerError] = []
            for shard, outcome in outcomes:
                if isinstance(outcome, BrokerError):
                    if outcome.owner is not None and hop < ROUTE_HOPS_MAX:  # not stored: routes changed
                        refused = outcome
                    else:
                        failed.append(outcome)
                    continue
                done.extend(outcome)
                _sent(by_queue, delayed, parts[shard])
            if failed:  # the sequences cannot go on: no other send; a definite failure wins (commit refused)
                self._broken = next((f for f in failed if f.code not in SEND_RETRYABLE), failed[0])
                raise self._broken
            if refused is None:
                return _receipts(topic, len(messages), done)
            client._learn_routes([topic])
        raise AssertionError("unreachable")

    def _send_part(self, topic: str, messages: Sequence[Message], ack: str, timeout_ms: int | None, shard: str,
                   grouped: PartOf) -> list[SendGroup]:
        """One shard's part of a send, in its transaction there."""
        mine, mine_delayed = grouped
        try:
            part = self._part(shard)
        except BrokerError as exc:  # not sent: the other parts' messages must not commit without these
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, f"the transaction could not join shard "
                                     f"{shard!r} ({exc}); nothing was sent there: abort it") from exc
        count = sum(len(i) for i in mine.values()) + sum(len(i) for i in mine_delayed.values())
        try:
            groups = self.client._send_batches(part.producer, topic, messages, self.client._shard_core(shard), mine,
                                               mine_delayed, ack=ack, timeout_ms=timeout_ms, transaction=part.pid,
                                               begin=None, begun=None, commit=None, ended=None)
        except BrokerError as exc:
            if exc.owner is None and exc.code in SEND_RETRYABLE:  # maybe stored: counted, so a commit needs them
                part.messages_sent += count
            raise
        part.messages_sent += count
        return groups

    def commit_offsets(self, group: str, topic: str, offsets: Mapping[int, int]) -> None:
        """Consumer offsets (``{queue_id: next offset}``) stored only if the transaction commits."""
        self._check_open()
        for queue_id, offset in offsets.items():
            self._offsets[(group, topic, queue_id)] = offset

    # -- end ------------------------------------------------------------------------------------
    def commit(self) -> None:
        """Commit on every shard: answered once the coordinator's decision is replicated (each
        participant has it then, or gets it shortly: delivery is retried). ``TransactionAborted``
        if a participant could not prepare, or the transaction was aborted meanwhile."""
        self._check_open()
        self._check_unbroken(committing=True)
        if not self.coordinator:
            self._begin_now()
        for part in self._parts.values():
            part.offsets.clear()
        group_parts: dict[str, _Part] = {}
        for (g, t, q), o in self._offsets.items():  # each group's offsets with its coordinator shard's part
            part = group_parts.get(g) or group_parts.setdefault(g, self._group_part(g))
            part.offsets.append(_request(pb.CommittedOffset, group=g, topic=t, queue_id=q, offset=o))
        participants = [pb.TransactionParticipant(shard=shard, producer_id=part.pid, messages_sent=part.messages_sent,
                                                  offsets=part.offsets)
                        for shard, part in self._parts.items() if shard != self.coordinator]
        own = self._parts[self.coordinator]
        req = pb.EndTransactionRequest(transactional_id=self.transactional_id, producer_id=self.producer_id,
                                       commit=True, offsets=own.offsets, messages_sent=own.messages_sent,
                                       participants=participants)
        answer = self._on_coordinator("EndTransaction", req)
        assert isinstance(answer, pb.EndTransactionResponse)
        self.state = "committed" if answer.outcome == pb.TRANSACTION_OUTCOME_COMMITTED else "aborted"
        if self.state != "committed":
            raise TransactionAborted(answer.reason, f"transaction {self.transactional_id!r} was aborted "
                                     f"({answer.reason}): none of it is visible on any shard")

    def abort(self) -> None:
        """Abort on every shard (the coordinator delivers it to each participant)."""
        if self.state != "open":
            return
        if not self.coordinator:
            if self._broken is None:
                self.state = "aborted"  # never begun: nothing to end
                return
            self._begin_now()  # a beginning call's outcome is unknown: the same begin id joins it
        req = pb.EndTransactionRequest(transactional_id=self.transactional_id, producer_id=self.producer_id,
                                       commit=False)
        answer = self._on_coordinator("EndTransaction", req)
        assert isinstance(answer, pb.EndTransactionResponse)
        self.state = "committed" if answer.outcome == pb.TRANSACTION_OUTCOME_COMMITTED else "aborted"
        if self.state == "committed":
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION, f"transaction {self.transactional_id!r} "
                                     "had committed (a call whose answer was lost committed it): it is visible")
