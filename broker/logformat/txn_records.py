"""Records of the ``__txn`` system topic: transactions begun and ended (DESIGN §14).

Each record's key is its kind, its body a JSON object (as ``__metadata``'s):

- ``txn.begin`` ``{"tid": str, "epoch": int, "timeout_ms": int, "check": bool, "counted"?: bool,
  "pid"?: int, "begin_id"?: int}``: a transaction of the transactional id ``tid`` begins
  (``begin_id``: the producer's id for the call that began it, so that a retry joins it; ``counted``: its producer
  gives, when it commits, how many messages it sent, and its sends are acknowledged at the ack mode
  they ask for). Its producer id is ``pid``: ``TXN_PID_BIT | 15 random bits << 48 | <the batch's
  offset, low 48 bits>`` (``new_pid``), or, for a record without it (written before it), ``TXN_PID_BIT
  | <this record's commit offset>``. Never one a client picks (clients pick 63-bit ids).
- ``txn.end`` ``{"tid": str, "pid": int, "commit": bool, "reason": str, "offsets": [[group, topic,
  queue, offset], ...]}``: the decision, one per transaction on this node. ``reason``: ``client``,
  ``timeout``, ``fenced`` (a newer begin of the same id), ``operator``, ``check``, ``incomplete`` (a
  counted commit whose count the log did not hold: aborted instead). ``offsets``: consumer
  offsets committed with the transaction (applied by the metadata view only when it commits).

A transaction's messages are batches of their own queues whose header has ``FLAG_TRANSACTIONAL``
and the transaction's producer id. Spec: docs/formats/txn-records.md.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from broker.logformat import batch as bf
from broker.logformat.system_records import TXN_TOPIC

__all__ = ["BEGIN", "END", "TXN_PID_BIT", "TXN_TOPIC", "Begin", "Delivered", "End", "Participant", "Prepare",
           "Record", "is_txn_pid", "new_pid", "records"]

BEGIN = "txn.begin"
END = "txn.end"
PARTICIPANT = "txn.participant"
PREPARE = "txn.prepare"
DELIVERED = "txn.delivered"
TXN_PID_BIT = 1 << 63
OFFSET_BITS_MASK = (1 << 48) - 1
REASONS = ("client", "timeout", "fenced", "operator", "check", "incomplete", "lost", "coordinator", "participant")
OffsetRow = tuple[str, str, int, int]  # group, topic, queue, offset
TIDS_MAX = 10_000  # transactional ids whose latest epoch is remembered (an open one's always)


def is_txn_pid(pid: int) -> bool:
    return bool(pid & TXN_PID_BIT)


@dataclass(frozen=True, slots=True)
class Begin:
    pid: int
    tid: str
    epoch: int
    timeout_ms: int
    check: bool
    at_ms: int  # the batch's store time
    offset: int  # the record's commit offset
    counted: bool = False  # the commit carries the producer's count of messages sent
    begin_id: int = 0  # the producer's id for the call that began it (a retry joins this one); 0: none
    coordinator: str = ""  # a participant transaction: the shard that decides it ('' for any other)


@dataclass(frozen=True, slots=True)
class Party:
    """A participant of a transaction over shards: its shard, its transaction there, the messages
    the producer counted there and the consumer offsets committed there with it."""

    shard: str
    pid: int
    messages: int = 0
    offsets: tuple[OffsetRow, ...] = ()

    def to_json(self) -> list[Any]:
        return [self.shard, self.pid, self.messages, [list(o) for o in self.offsets]]

    @classmethod
    def from_json(cls, row: list[Any]) -> Party:
        shard, pid, messages, offsets = row
        return cls(str(shard), int(pid), int(messages), tuple((str(g), str(t), int(q), int(o)) for g, t, q, o in offsets))


@dataclass(frozen=True, slots=True)
class End:
    pid: int
    tid: str
    commit: bool
    reason: str
    at_ms: int
    offset: int
    offsets: list[tuple[str, str, int, int]] = field(default_factory=list)
    participants: tuple[Party, ...] = ()  # a coordinator's decision: delivered to each of them


@dataclass(frozen=True, slots=True)
class Participant:
    pid: int
    tid: str
    party: Party
    offset: int


@dataclass(frozen=True, slots=True)
class Prepare:
    pid: int
    tid: str
    offset: int


@dataclass(frozen=True, slots=True)
class Delivered:
    pid: int
    tid: str
    offset: int


Record = Begin | End | Participant | Prepare | Delivered


def new_pid(batch_offset: int) -> int:
    """A transaction's producer id, for a begin in the ``__txn`` batch at ``batch_offset``: unique in
    the log's history (one begin per batch), and unlikely (2^-15) to meet again a producer id that
    a master answered before it lost it with its log's tail (a failover, a power cut) when another
    begin lands at the same offset: a producer still holding the lost one must not join it."""
    return TXN_PID_BIT | (random.getrandbits(15) << 48) | (batch_offset & OFFSET_BITS_MASK)


def encode_begin(tid: str, epoch: int, timeout_ms: int, check: bool, counted: bool = False,
                 pid: int = 0, begin_id: int = 0, coordinator: str = "") -> tuple[bytes, bytes]:
    body: dict[str, Any] = {"tid": tid, "epoch": epoch, "timeout_ms": timeout_ms, "check": check}
    if coordinator:
        body["coordinator"] = coordinator
    if counted:
        body["counted"] = True
    if pid:
        body["pid"] = pid
    if begin_id:
        body["begin_id"] = begin_id
    return BEGIN.encode(), json.dumps(body, separators=(",", ":")).encode()


def encode_end(tid: str, pid: int, commit: bool, reason: str,
               offsets: list[tuple[str, str, int, int]] | None = None,
               participants: tuple[Party, ...] = ()) -> tuple[bytes, bytes]:
    body: dict[str, Any] = {"tid": tid, "pid": pid, "commit": commit, "reason": reason}
    if offsets:
        body["offsets"] = [list(o) for o in offsets]
    if participants:
        body["participants"] = [p.to_json() for p in participants]
    return END.encode(), json.dumps(body, separators=(",", ":")).encode()


def encode_participant(tid: str, pid: int, party: Party) -> tuple[bytes, bytes]:
    body = {"tid": tid, "pid": pid, "party": party.to_json()}
    return PARTICIPANT.encode(), json.dumps(body, separators=(",", ":")).encode()


def encode_prepare(tid: str, pid: int) -> tuple[bytes, bytes]:
    return PREPARE.encode(), json.dumps({"tid": tid, "pid": pid}, separators=(",", ":")).encode()


def encode_delivered(tid: str, pid: int) -> tuple[bytes, bytes]:
    return DELIVERED.encode(), json.dumps({"tid": tid, "pid": pid}, separators=(",", ":")).encode()


# Each ``__txn`` batch is read by the append side, the transactions view and the metadata view (and
# on a master by the write that appended it): decoded once, kept for the next readers. Keyed by
# where it lies, when it was stored and its records' CRC (a log cut and written again differs).
_DECODED: dict[tuple[int, int, int], tuple[Record, ...]] = {}
DECODED_MAX = 256


def records(header: bf.BatchHeader, batch: memoryview) -> tuple[Record, ...]:
    """The records of one ``__txn`` batch, in order (a record of an unknown kind is skipped)."""
    key = (header.base_offset, header.store_time_ms, header.body_crc)
    decoded = _DECODED.get(key)
    if decoded is None:
        decoded = tuple(_decode(header, batch))
        if len(_DECODED) >= DECODED_MAX:
            _DECODED.clear()
        _DECODED[key] = decoded
    return decoded


def _decode(header: bf.BatchHeader, batch: memoryview) -> Iterator[Record]:
    for pos, key, _, body in bf.iter_records(batch, header):
        kind = bytes(key)
        offset = header.base_offset + pos
        if kind == b"txn.begin":
            f = json.loads(bytes(body))
            pid = int(f["pid"]) if "pid" in f else TXN_PID_BIT | offset
            yield Begin(pid, str(f["tid"]), int(f["epoch"]), int(f["timeout_ms"]), bool(f["check"]),
                        header.store_time_ms, offset, bool(f.get("counted", False)), int(f.get("begin_id", 0)),
                        str(f.get("coordinator", "")))
        elif kind == b"txn.end":
            f = json.loads(bytes(body))
            yield End(int(f["pid"]), str(f["tid"]), bool(f["commit"]), str(f["reason"]), header.store_time_ms, offset,
                      [(str(g), str(t), int(q), int(o)) for g, t, q, o in f.get("offsets", ())],
                      tuple(Party.from_json(p) for p in f.get("participants", ())))
        elif kind == b"txn.participant":
            f = json.loads(bytes(body))
            yield Participant(int(f["pid"]), str(f["tid"]), Party.from_json(f["party"]), offset)
        elif kind == b"txn.prepare":
            f = json.loads(bytes(body))
            yield Prepare(int(f["pid"]), str(f["tid"]), offset)
        elif kind == b"txn.delivered":
            f = json.loads(bytes(body))
            yield Delivered(int(f["pid"]), str(f["tid"]), offset)
