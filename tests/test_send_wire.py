"""The Send request reader (broker/daemon/send_wire.py) answers what the protobuf parser answers."""

from __future__ import annotations

import random
from typing import Any

import pytest
from google.protobuf.message import DecodeError

from broker.daemon.send_wire import SendRequestView, begin_of, commit_of, parse_send
from broker.daemon.wire import varint as _varint
from proto import tidemark_pb2 as pb
from tests.wirefuzz import agree, mutated

BATCH_FIELDS = ("topic", "queue_id", "producer_id", "base_sequence", "record_count", "records_crc", "delayed")


def _fields(request: Any) -> dict[str, Any]:
    return {
        "ack": int(request.ack), "timeout_ms": request.timeout_ms, "producer_id": request.producer_id,
        "transaction": request.transaction,
        "begin": begin.SerializeToString() if (begin := begin_of(request)) is not None else None,
        "commit": commit.SerializeToString() if (commit := commit_of(request)) is not None else None,
        "messages": [m.SerializeToString() for m in request.messages],
        "batches": [{**{f: getattr(b, f) for f in BATCH_FIELDS}, "records": bytes(b.records)} for b in request.batches],
    }


def _request(rng: random.Random) -> pb.SendRequest:
    r = pb.SendRequest(ack=rng.choice((0, 1, 2, 3, 7, -1)), timeout_ms=rng.choice((0, 5, 2**32 - 1)),
                       producer_id=rng.choice((0, 9, 2**64 - 1)))
    for _ in range(rng.randrange(4)):
        r.batches.add(topic=rng.choice(("", "t", "ordrés", "x" * 200)), queue_id=rng.choice((0, 3, 2**32 - 1)),
                      producer_id=rng.choice((0, 2**63)), base_sequence=rng.choice((-1, 0, 2**63 - 1, -(2**63))),
                      record_count=rng.randrange(2000), records_crc=rng.getrandbits(32),
                      records=rng.randbytes(rng.choice((0, 1, 300, 70_000))), delayed=rng.random() < 0.3)
    if rng.random() < 0.1:
        r.messages.add(topic="t", body=b"plain")
    if rng.random() < 0.3:  # a send that begins a transaction
        r.begin.CopyFrom(pb.BeginTransactionRequest(transactional_id=rng.choice(("", "tx", "ordrés")),
                                                    timeout_ms=rng.choice((0, 5_000)), count_messages=rng.random() < 0.5))
    if rng.random() < 0.3:  # a send that commits its transaction
        r.commit.CopyFrom(pb.EndTransactionRequest(transactional_id=rng.choice(("", "tx")), producer_id=rng.choice((0, 2**63 + 5)),
                                                   commit=rng.random() < 0.9, messages_sent=rng.choice((0, 1000))))
    return r


def _batch_bent(rng: random.Random) -> bytes:
    """A batch with its fields repeated, bad UTF-8 or long varints."""
    inner = (_varint(1 << 3 | 2) + _varint(2) + rng.choice((b"ok", b"\xff\xfe", b"\xed\xa0"))
             + _varint(2 << 3) + b"\xff" * 9 + b"\x01"
             + _varint(4 << 3) + b"\xff" * rng.choice((9, 10)) + b"\x01"
             + _varint(7 << 3 | 2) + _varint(1) + b"a" + _varint(7 << 3 | 2) + _varint(2) + b"bc")
    return _varint(1 << 3 | 2) + _varint(len(inner)) + inner


def test_the_reader_and_protobuf_agree_on_every_request() -> None:
    fast = agree(lambda rng: _request(rng).SerializeToString(),
                 lambda rng, data: mutated(rng, data, scalars=(2,), unknown=(6, 9, 100, 1, 2, 4), more=_batch_bent),
                 parse_send, pb.SendRequest.FromString, _fields, SendRequestView)
    assert fast > 1000  # most requests took the reader, not the fallback


def test_a_beginning_send_takes_the_reader() -> None:
    begin = pb.BeginTransactionRequest(transactional_id="tx", timeout_ms=9, count_messages=True)
    data = pb.SendRequest(batches=[pb.ProduceBatch(topic="t", record_count=1, records=b"r")], begin=begin)
    parsed = parse_send(data.SerializeToString())
    assert isinstance(parsed, SendRequestView) and parsed.begin == begin
    twice = data.SerializeToString() + pb.SendRequest(begin=pb.BeginTransactionRequest(timeout_ms=3)).SerializeToString()
    merged = parse_send(twice)
    assert isinstance(merged, pb.SendRequest) and merged.begin.transactional_id == "tx" and merged.begin.timeout_ms == 3


def test_a_committing_send_takes_the_reader() -> None:
    commit = pb.EndTransactionRequest(transactional_id="tx", producer_id=2**63 + 7, commit=True, messages_sent=12)
    data = pb.SendRequest(batches=[pb.ProduceBatch(topic="t", record_count=1, records=b"r")], transaction=2**63 + 7,
                          commit=commit)
    parsed = parse_send(data.SerializeToString())
    assert isinstance(parsed, SendRequestView) and parsed.commit == commit and parsed.transaction == 2**63 + 7
    twice = data.SerializeToString() + pb.SendRequest(commit=pb.EndTransactionRequest(messages_sent=3)).SerializeToString()
    merged = parse_send(twice)
    assert isinstance(merged, pb.SendRequest) and merged.commit.transactional_id == "tx" and merged.commit.messages_sent == 3


def test_records_are_a_view_of_the_request() -> None:
    data = pb.SendRequest(batches=[pb.ProduceBatch(topic="t", record_count=1, records=b"r" * 4096)]).SerializeToString()
    parsed = parse_send(data)
    assert isinstance(parsed, SendRequestView)
    records = parsed.batches[0].records
    assert isinstance(records, memoryview) and records.obj is data and bytes(records) == b"r" * 4096


def test_plain_messages_go_to_the_protobuf_parser_and_keep_their_wire_bytes() -> None:
    """Protobuf reads (and checks) a request with plain messages; its bytes are kept for the C path."""
    batch = pb.ProduceBatch(topic="b", queue_id=2, producer_id=7, base_sequence=3, record_count=1, records=b"r",
                            records_crc=9, delayed=True)
    data = pb.SendRequest(batches=[batch], messages=[pb.PlainMessage(topic="t", body=b"b")], ack=pb.ACK_REPLICA,
                          timeout_ms=5, commit=pb.EndTransactionRequest(transactional_id="x")).SerializeToString()
    parsed = parse_send(data)
    assert isinstance(parsed, SendRequestView) and parsed.wire is data and parsed.messages[0].body == b"b"
    assert (parsed.ack, parsed.timeout_ms, parsed.begin, parsed.commit.transactional_id) == (pb.ACK_REPLICA, 5, None, "x")
    b = parsed.batches[0]
    assert (b.topic, b.queue_id, b.producer_id, b.base_sequence, b.record_count, bytes(b.records), b.records_crc,
            b.delayed) == ("b", 2, 7, 3, 1, b"r", 9, True)
    with pytest.raises(DecodeError):  # a string that is not UTF-8: protobuf's refusal, as before
        parse_send(data + b"\x22\x03\x0a\x01\xff")


def test_a_request_of_many_fields_goes_to_the_protobuf_parser() -> None:
    """Millions of repeated scalars are a valid request; read in Python they would hold the event loop."""
    many = pb.SendRequest(ack=pb.ACK_FLUSH).SerializeToString() * 100_000
    parsed = parse_send(many)
    assert isinstance(parsed, pb.SendRequest) and parsed.ack == pb.ACK_FLUSH
    batch = pb.SendRequest(batches=[pb.ProduceBatch(topic="t", record_count=1, records=b"r")]).SerializeToString()
    assert isinstance(parse_send(batch * 100), SendRequestView)
    assert isinstance(parse_send(batch * 5000), pb.SendRequest)
