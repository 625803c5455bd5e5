"""A ``SendRequest`` read from its wire bytes, each batch's records a view of them.

The protobuf parser copies every ``bytes`` field into its own memory, and reading the field copies
it again into a new ``bytes`` object: two copies of each 1 MiB batch before the append's checks
and ``writev`` read it once more (issue 18: together 12% of the event loop's time at 1 KiB
messages, 1,000 per send). The client's fast path sends pre-encoded batches, whose fields are a
handful of integers, a topic and the records; this reader walks them (protobuf encoding spec:
tag varint ``field << 3 | wire_type``, varints little-endian base 128, length-delimited fields
as a varint length and the bytes) and keeps ``records`` as a ``memoryview`` of the request.

It takes only what it fully understands and leaves the rest to ``SendRequest.FromString``: a
field number it does not know, a
wire type other than the field's, a varint longer than 10 bytes, a field running past its
message, a topic that is not UTF-8. So every request gets the answer the protobuf parser would
give it (scalars: the last occurrence wins; integers cut to their type's width as protobuf does).

A request with plain messages (field 4, the any-language API) is kept with its wire bytes
(``SendRequestView.wire``): the C twin of ``plain.encode`` reads the messages from those, with no
Python object per message. The C module's ``split_plain`` checks the messages as protobuf would
(every string UTF-8, every field of the right type) and hands protobuf the other fields alone:
the messages are parsed only if something reads them (``PlainMessages``: the Python path that
frames what the C one leaves to it). Parsing them all cost 0.35-1 ms a request of 1,000 x 1 KiB,
most of it the copy of every body into fresh memory; what ``split_plain`` does not vouch for is
parsed whole, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from google.protobuf.message import DecodeError

from broker.daemon import plain
from broker.errors import invalid
from broker.protowire import LEN, U32, NotFast, fields
from proto import tidemark_pb2 as pb

# Beyond these, the protobuf parser (in C) reads the request: a client sends each field once, and
# one batch per queue it writes to.
BATCH_FIELDS_MAX = 16
REQUEST_FIELDS_MAX = 4096


@dataclass(slots=True)
class SendBatchView:
    """A ``ProduceBatch`` with ``records`` a view of the request's bytes."""

    topic: str = ""
    queue_id: int = 0
    producer_id: int = 0
    base_sequence: int = 0
    record_count: int = 0
    records_crc: int = 0
    records: bytes | memoryview = b""
    delayed: bool = False


@dataclass(slots=True)
class SendRequestView:
    """The fields of a ``SendRequest``; with plain messages, parsed by protobuf (``wire`` set)."""

    batches: list[SendBatchView] = field(default_factory=list)
    ack: int = 0
    timeout_ms: int = 0
    producer_id: int = 0
    transaction: int = 0
    messages: Sequence[pb.PlainMessage] = ()
    wire_bytes: int = 0  # the request's size (logged with an unexpected failure)
    wire: bytes | None = None  # the request's bytes, when it has plain messages (plain.encode_native)
    begin: pb.BeginTransactionRequest | None = None  # a few small fields: the protobuf parser reads it
    commit: pb.EndTransactionRequest | None = None  # likewise


def begin_of(request: SendRequestView | pb.SendRequest) -> pb.BeginTransactionRequest | None:
    """``SendRequest.begin`` if the request has one."""
    if isinstance(request, SendRequestView):
        return request.begin
    return request.begin if request.HasField("begin") else None


def commit_of(request: SendRequestView | pb.SendRequest) -> pb.EndTransactionRequest | None:
    """``SendRequest.commit`` if the request has one."""
    if isinstance(request, SendRequestView):
        return request.commit
    return request.commit if request.HasField("commit") else None


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _int32(v: int) -> int:
    v &= U32
    return v - (1 << 32) if v >= 1 << 31 else v


def _batch(data: bytes, view: memoryview, start: int, end: int) -> SendBatchView:
    b = SendBatchView()
    for number, wire, a, z in fields(data, start, end, BATCH_FIELDS_MAX):
        if wire == LEN:
            if number == 7:
                b.records = view[a:z]
            elif number == 1:
                try:
                    b.topic = data[a:z].decode()
                except UnicodeDecodeError:
                    raise NotFast from None
            else:
                raise NotFast
        elif number == 2:
            b.queue_id = a & U32
        elif number == 3:
            b.producer_id = a
        elif number == 4:
            b.base_sequence = _signed64(a)
        elif number == 5:
            b.record_count = a & U32
        elif number == 6:
            b.records_crc = a & U32
        elif number == 8:
            b.delayed = a != 0
        else:
            raise NotFast
    return b


class _Plain(Exception):
    """The request has plain messages."""


class PlainMessages(Sequence[pb.PlainMessage]):
    """A request's plain messages, checked by ``split_plain`` and parsed by protobuf when first read."""

    def __init__(self, wire: bytes, count: int) -> None:
        self._wire = wire
        self._count = count
        self._parsed: Sequence[pb.PlainMessage] | None = None

    def _messages(self) -> Sequence[pb.PlainMessage]:
        if self._parsed is None:
            try:
                self._parsed = pb.SendRequest.FromString(self._wire).messages
            except DecodeError as exc:  # not expected: split_plain answers only for what protobuf takes
                raise invalid(f"the request cannot be decoded: {str(exc)[:200]}") from None
        return self._parsed

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> pb.PlainMessage: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[pb.PlainMessage]: ...
    def __getitem__(self, i: int | slice) -> pb.PlainMessage | Sequence[pb.PlainMessage]:
        return self._messages()[i]

    def __iter__(self) -> Iterator[pb.PlainMessage]:
        return iter(self._messages())


def _with_plain(data: bytes) -> SendRequestView:
    """A request with plain messages, its wire bytes kept: the messages checked by the C module and
    parsed when read, the other fields by protobuf (all of it by protobuf without the C module, or
    when the C module does not vouch for the messages)."""
    split = plain.native.split_plain(data) if plain.native is not None else None
    if split is None:
        parsed = pb.SendRequest.FromString(data)
        messages: Sequence[pb.PlainMessage] = parsed.messages
    else:
        rest, count = split
        parsed = pb.SendRequest.FromString(rest)
        messages = PlainMessages(data, count)
    return SendRequestView(
        batches=[SendBatchView(b.topic, b.queue_id, b.producer_id, b.base_sequence, b.record_count, b.records_crc,
                               b.records, b.delayed) for b in parsed.batches],
        ack=parsed.ack, timeout_ms=parsed.timeout_ms, producer_id=parsed.producer_id, transaction=parsed.transaction,
        messages=messages, wire_bytes=len(data), wire=data,
        begin=parsed.begin if parsed.HasField("begin") else None,
        commit=parsed.commit if parsed.HasField("commit") else None)


def parse_send(data: bytes) -> SendRequestView | pb.SendRequest:
    """The request in ``data``: a ``SendRequestView`` when this reader takes it or it has plain
    messages, else the protobuf parser's ``SendRequest`` (or its ``DecodeError``)."""
    try:
        view = memoryview(data)
        request = SendRequestView(wire_bytes=len(data))
        for number, wire, a, z in fields(data, 0, len(data), REQUEST_FIELDS_MAX):
            if wire == LEN:
                if number == 7 and request.begin is None:  # twice: protobuf merges them, and so it reads it
                    request.begin = pb.BeginTransactionRequest.FromString(data[a:z])
                    continue
                if number == 8 and request.commit is None:
                    request.commit = pb.EndTransactionRequest.FromString(data[a:z])
                    continue
                if number == 4:
                    raise _Plain
                if number != 1:
                    raise NotFast
                request.batches.append(_batch(data, view, a, z))
            elif number == 2:
                request.ack = _int32(a)
            elif number == 3:
                request.timeout_ms = a & U32
            elif number == 5:
                request.producer_id = a
            elif number == 6:
                request.transaction = a
            else:
                raise NotFast
        return request
    except _Plain:
        return _with_plain(data)
    except NotFast:
        return pb.SendRequest.FromString(data)
