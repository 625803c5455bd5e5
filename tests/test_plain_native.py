"""The C twins of broker/daemon/plain.py (broker/logformat/_plainwire.c) against the Python path,
which stays the reference: on random and bent requests and logs, whatever the C path answers is
what the Python path answers, and it answers the common case itself."""

from __future__ import annotations

import functools
import itertools
import random
import struct
from collections.abc import Callable, Iterator
from typing import Any

import crc32c
import pytest
from google.protobuf.message import DecodeError

from broker.daemon import plain
from broker.daemon.rpc.pops import _popped_wire, _runs_wire
from broker.daemon.send_wire import PlainMessages, SendRequestView, parse_send
from broker.daemon.wire import varint
from broker.errors import BrokerError
from broker.groups import receipts
from broker.groups.pops import LeasedRun, as_messages
from broker.logformat import batch as bf
from broker.logformat.cut import cut_run
from broker.ports import BatchReceipt
from proto import tidemark_pb2 as pb
from tests.wirefuzz import mutated

pytestmark = pytest.mark.skipif(plain.native is None, reason="needs the C module (make test fails in test_install)")

TOPICS = {"a": 4, "b": 1, "wide": 1024}
NAMES = ("", "x", "é", "_x", "__", "__deliver_at_ms", "k" * 300)


def _queues_of(topic: str) -> int | None:
    return TOPICS.get(topic)


def _message(rng: random.Random, idempotent: bool, sequences: dict[tuple[str, int], int]) -> pb.PlainMessage:
    m = pb.PlainMessage(topic=rng.choice(("a", "a", "b", "wide")), body=rng.randbytes(rng.randrange(40)))
    if rng.random() < 0.5:
        m.key = rng.choice(("k1", "κλειδί", str(rng.randrange(1000))))
    if rng.random() < 0.4 or idempotent:
        m.queue_id = rng.randrange(TOPICS[m.topic])
    if rng.random() < 0.3:
        for _ in range(rng.randrange(4)):
            m.properties[rng.choice(NAMES[:4])] = rng.choice(("", "v", "ü" * 40))
    if idempotent:
        key = (m.topic, m.queue_id)
        sequences[key] = sequences.get(key, rng.randrange(3)) + 1
        m.sequence = sequences[key]
    return m


def _bend(rng: random.Random, m: pb.PlainMessage) -> None:
    """One thing the broker refuses, or leaves to the timer path, in ``m``."""
    kind = rng.randrange(9)
    if kind == 0:
        m.topic = rng.choice(("nope", "__timer"))
    elif kind == 1:
        m.queue_id = 2000
    elif kind == 2:
        m.key = "z" * 70_000
    elif kind == 3:
        m.properties[rng.choice(NAMES[3:])] = "v"
    elif kind == 4:
        m.properties["big"] = "ü" * 40_000
    elif kind == 5:
        m.deliver_at_ms = rng.choice((-1, 1, 1 << 40))
    elif kind == 6:
        m.sequence = rng.choice((-1, m.sequence + 1, 0))
    elif kind == 7:
        m.ClearField("queue_id")
    else:
        m.ClearField("sequence")


def _request(rng: random.Random) -> tuple[bytes, int]:
    idempotent = rng.random() < 0.3
    sequences: dict[tuple[str, int], int] = {}
    messages = [_message(rng, idempotent, sequences) for _ in range(rng.randrange(1, 30))]
    if rng.random() < 0.4:
        _bend(rng, rng.choice(messages))
    batches = [pb.ProduceBatch(topic="a", record_count=1, records=b"r")] if rng.random() < 0.2 else []
    return pb.SendRequest(messages=messages, batches=batches).SerializeToString(), (77 if idempotent else 0)


def _bent_requests(rng: random.Random, count: int,
                   more: Callable[[random.Random, bytes], bytes] | None = None) -> Iterator[tuple[bytes, int]]:
    """``count`` random requests (and their producer ids): a third of them ``mutated``, another third
    bent by ``more`` if given."""
    for i in range(count):
        data, producer_id = _request(rng)
        if i % 3 == 0:
            data = mutated(rng, data, scalars=(2, 3, 5, 6), unknown=(9, 15, 4))
        elif i % 3 == 1 and more is not None:
            data = more(rng, data)
        yield data, producer_id


def _records(b: Any) -> list[tuple[bytes, dict[str, str], bytes]]:
    """A batch's records with their properties as a map (protobuf's map order is its own)."""
    data = bytes(b.records)
    blob = b"\0" * bf.HEADER_BYTES + data
    header = bf.BatchHeader(len(blob), b.record_count, 0, 0, 0, 0, 0, 0, 0, "", 0)
    return [(bytes(k), bf.decode_props(p), bytes(body)) for _, k, p, body in bf.iter_records(blob, header)]


def _encoded(e: plain.Encoded) -> list[Any]:
    return [(b.topic, b.queue_id, b.record_count, b.producer_id, b.base_sequence, b.timer_target, _records(b))
            for b in e.batches]


def _python(fn: Callable[[], plain.Encoded], rotation: int) -> Any:
    plain._rotation = itertools.count(rotation)
    try:
        return fn()
    except BrokerError as exc:
        return exc.code


def test_the_c_encoder_frames_what_the_python_one_does() -> None:
    rng = random.Random(40)
    taken = valid = 0
    for data, producer_id in _bent_requests(rng, 4000):
        try:
            request = pb.SendRequest.FromString(data)
        except DecodeError:
            continue  # protobuf refuses it before either path sees it
        rotation = rng.randrange(100)
        expected = _python(functools.partial(plain.encode, request.messages, producer_id, _queues_of), rotation)
        plain._rotation = itertools.count(rotation)
        native = plain.encode_native(data, producer_id, _queues_of)
        if isinstance(expected, str):
            assert native is None, (expected, request)  # a refusal is always the Python path's own
            continue
        valid += 1
        if native is None:
            continue
        taken += 1
        assert _encoded(native) == _encoded(expected), request
        for b in native.batches:
            assert b.body_crc == crc32c.crc32c(b.records)
            bf.record_positions(b.records, b.record_count)
        receipts = [BatchReceipt(commit_offset=rng.randrange(1 << 40), base_queue_offset=rng.randrange(1 << 30),
                                 record_count=b.record_count, duplicate=rng.random() < 0.2) for b in expected.batches]
        # the two paths group alike: the same receipts fit both
        wire = plain.receipts_wire(native, receipts)
        assert wire is not None
        reference = pb.SendResponse(message_receipts=plain.receipts(expected, receipts, request.messages))
        assert pb.SendResponse.FromString(wire) == reference
    assert valid > 2000 and taken > 0.9 * valid, (taken, valid)


def test_the_c_key_hash_is_the_libraries_crc32c() -> None:
    """A keyed message's queue is ``crc32c(key) % queues`` on every path (our client, plain.encode,
    the C encoder): the C encoder's own CRC32C must be the library's for every key."""
    rng = random.Random(41)
    keys = [rng.randbytes(rng.randrange(300)) for _ in range(5000)]
    keys += [b"", b"\xff" * 0xFFFF, "κλειδί".encode(), bytes(range(256))]
    assert [plain.native.key_crc32c(k) for k in keys] == [crc32c.crc32c(k) for k in keys]


def _not_utf8(rng: random.Random, data: bytes) -> bytes:
    """A request whose topic, key, property name or value (one of them) is not UTF-8: a marker
    string of the same length put in and replaced by bytes protobuf refuses in a string."""
    m = pb.PlainMessage(topic="a", body=b"b")
    where = rng.randrange(4)
    if where == 0:
        m.topic = "MARK"
    elif where == 1:
        m.key = "MARK"
    else:
        m.properties.update({"MARK": "v"} if where == 2 else {"n": "MARK"})
    bad = rng.choice((b"\xff\xfeAB", b"A\xc0\x80B", b"\xed\xa0\x80A", b"AB\xe2\x82"))
    return data + pb.SendRequest(messages=[m]).SerializeToString().replace(b"MARK", bad)


def _padded_len(n: int, width: int) -> bytes:
    """``n`` as a varint of ``width`` bytes (padded with continuation bytes): upb takes a length of
    at most 5 bytes."""
    out = bytearray()
    for _ in range(width - 1):
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _padded(rng: random.Random, data: bytes) -> bytes:
    """A plain message whose one length prefix (of the message itself, its topic, key, body, a map
    entry or its name) is padded to 2-10 bytes."""
    width = rng.randrange(2, 11)
    where = rng.randrange(6)

    def field(number: int, value: bytes, pad: bool) -> bytes:
        return bytes([number << 3 | 2]) + (_padded_len(len(value), width) if pad else varint(len(value))) + value

    entry = field(1, b"n", where == 4) + field(2, b"v", False)
    message = field(1, b"a", where == 0) + field(3, b"k", where == 1) + field(4, b"body", where == 2) + \
        field(5, entry, where == 3)
    return data + field(4, message, where == 5)


def test_split_plain_vouches_only_for_what_protobuf_takes() -> None:
    """``split_plain``: whatever it answers, protobuf parses the whole request alike (its count of
    messages, its other fields); what protobuf refuses (cut, flipped, not UTF-8), it leaves to it."""
    rng = random.Random(41)
    vouched = refused = 0
    def odd(rng: random.Random, data: bytes) -> bytes:
        return _not_utf8(rng, data) if rng.random() < 0.5 else _padded(rng, data)

    for data, _ in _bent_requests(rng, 4000, odd):
        split = plain.native.split_plain(data)
        try:
            whole = pb.SendRequest.FromString(data)
        except DecodeError:
            refused += 1
            if split is not None:  # vouched for the messages only: protobuf refuses the rest alike
                with pytest.raises(DecodeError):
                    pb.SendRequest.FromString(split[0])
            continue
        if split is None:
            continue
        vouched += 1
        rest, count = split
        assert count == len(whole.messages)
        whole.ClearField("messages")
        assert pb.SendRequest.FromString(rest) == whole
    assert vouched > 2000 and refused > 300, (vouched, refused)


def test_a_plain_send_is_parsed_only_when_read() -> None:
    """The daemon's reader keeps a plain request's messages unparsed (``PlainMessages``) and parses
    them when something reads them; a request it cannot vouch for is parsed whole."""
    request = pb.SendRequest(ack=pb.ACK_FLUSH, timeout_ms=9, producer_id=5,
                             messages=[pb.PlainMessage(topic="a", key=str(i), body=b"x" * i) for i in range(50)])
    view = parse_send(request.SerializeToString())
    assert isinstance(view, SendRequestView) and isinstance(view.messages, PlainMessages)
    assert (view.ack, view.timeout_ms, view.producer_id, len(view.messages)) == (pb.ACK_FLUSH, 9, 5, 50)
    assert view.messages._parsed is None  # nothing read them yet
    assert [m.key for m in view.messages] == [str(i) for i in range(50)] and view.messages[7].body == b"x" * 7
    odd = request.SerializeToString() + b"\x22\x02\x48\x01"  # a message with field 9: left to protobuf
    view = parse_send(odd)
    assert isinstance(view, SendRequestView) and not isinstance(view.messages, PlainMessages)
    assert len(view.messages) == 51


def test_what_the_c_encoder_leaves_to_python() -> None:
    def native(*messages: pb.PlainMessage, producer_id: int = 0) -> plain.Encoded | None:
        return plain.encode_native(pb.SendRequest(messages=messages).SerializeToString(), producer_id, _queues_of)

    assert native(pb.PlainMessage(topic="a", body=b"x")) is not None
    assert native(pb.PlainMessage(topic="a", body=b"x", deliver_at_ms=5)) is None  # a timer message
    assert native(pb.PlainMessage(topic="nope")) is None  # NOT_FOUND is Python's to say
    assert native(pb.PlainMessage(topic="__timer")) is None
    assert native(pb.PlainMessage(topic="a", properties={"__x": "1"})) is None
    assert native(pb.PlainMessage(topic="a", queue_id=4)) is None
    assert native(pb.PlainMessage(topic="a", key="k" * 70_000)) is None
    assert native(*[pb.PlainMessage(topic=f"t{i}") for i in range(20)]) is None  # many topics
    assert native(pb.PlainMessage(topic="a", queue_id=1, sequence=4), pb.PlainMessage(topic="a", queue_id=1, sequence=6),
                  producer_id=9) is None  # a gap in the sequences
    done = native(pb.PlainMessage(topic="a", queue_id=1, sequence=4), pb.PlainMessage(topic="a", queue_id=1, sequence=5),
                  producer_id=9)
    assert done is not None and [(b.producer_id, b.base_sequence, b.record_count) for b in done.batches] == [(9, 4, 2)]
    # a property given twice on the wire: protobuf's map keeps the last; Python's path says so
    entry = pb.PlainMessage(topic="a", properties={"n": "1"}).SerializeToString()
    twice = entry + pb.PlainMessage(properties={"n": "2"}).SerializeToString()
    wire = struct.pack("B", 4 << 3 | 2) + bytes([len(twice)]) + twice
    assert plain.encode_native(wire, 0, _queues_of) is None
    assert dict(pb.SendRequest.FromString(wire).messages[0].properties) == {"n": "2"}
    # an entry with a field of its own is no property to protobuf (upb keeps it as unknown)
    odd = b"\x0a\x01a" + b"\x2a\x08\x0a\x01n\x12\x01v\x18\x01"
    wire = struct.pack("B", 4 << 3 | 2) + bytes([len(odd)]) + odd
    assert dict(pb.SendRequest.FromString(wire).messages[0].properties) == {}
    assert plain.encode_native(wire, 0, _queues_of) is None
    # sequences at the ends of int64 (a send that is not idempotent ignores them)
    done = native(pb.PlainMessage(topic="a", queue_id=0, sequence=-(1 << 63)), pb.PlainMessage(topic="a", queue_id=0,
                                                                                                  sequence=(1 << 63) - 1))
    assert done is not None and [(b.base_sequence, b.record_count) for b in done.batches] == [(-1, 2)]


def _batch(base_offset: int, base_queue_offset: int, items: list[tuple[bytes, bytes, bytes]], topic: bytes = b"t") -> bytes:
    records, _ = bf.encode_records(items)
    return bf.HEADER.pack(bf.HEADER_BYTES + len(topic) + len(records), 0, bf.MAGIC, bf.VERSION, 0, len(items),
                          base_offset, base_queue_offset, 1_700_000_000_123, 0, -1, 1, 3, len(topic), 0,
                          crc32c.crc32c(records)) + topic + records


def _key(rng: random.Random) -> bytes:
    return b"\xfe" if rng.random() < 0.01 else rng.choice((b"", b"k", "ключ".encode()))  # rarely not UTF-8


def _props(rng: random.Random) -> bytes:
    pick = rng.random()
    if pick < 0.5:
        return b""
    names = ("a", "é", "__deliver_at_ms", "__timer_offset", "__topic", "__queue", "__event", "b")
    values = ("", "v", "12", "0", "9" * 19, "9" * 20, "12a", "١٢")
    pairs = [(rng.choice(names).encode(), rng.choice(values).encode()) for _ in range(rng.randrange(1, 5))]
    raw = b"".join(struct.pack("<H", len(n)) + n + struct.pack("<H", len(v)) + v for n, v in pairs)
    if pick > 0.97:
        return raw[:-1]  # properties that do not fill their length
    if pick > 0.94:
        return raw + struct.pack("<H", 1) + b"\xff" + struct.pack("<H", 0)  # a name that is not UTF-8
    return raw


def test_the_c_decoder_answers_what_the_python_one_does() -> None:
    rng = random.Random(41)
    taken = 0
    for _ in range(1500):
        blobs, total = [], 0
        for _ in range(rng.randrange(1, 4)):
            run = b""
            for _ in range(rng.randrange(1, 4)):
                n = rng.randrange(1, 8)
                items = [(rng.randbytes(rng.randrange(12)), _key(rng), _props(rng)) for _ in range(n)]
                run += _batch(rng.randrange(1 << 40), rng.randrange(1 << 40), items)
                total += n
            blobs.append(run)
        skip = rng.randrange(3)
        count = rng.randrange(max(1, total - skip + 2))
        if rng.random() < 0.05:
            blobs[-1] = blobs[-1][: -rng.randrange(1, 20)]  # a cut batch
        try:
            expected: Any = pb.PullResponse(messages=plain.decode(blobs, skip, count))
        except Exception as exc:  # the Python path's own failure on a cut batch
            expected = type(exc)
        wire = plain.decode_wire(blobs, skip, count)
        if wire is None:
            continue
        taken += 1
        assert pb.PullResponse.FromString(wire) == expected
    assert taken > 700, taken


def test_an_empty_or_odd_pull_answer() -> None:
    assert plain.decode_wire([], 0, 5) == b""
    blob = _batch(10, 20, [(b"x", b"", b"")])
    assert plain.decode_wire([blob], 0, 0) == b""  # no message asked for
    assert plain.decode_wire([bytearray(blob)], 0, 1) is None  # type: ignore[list-item]  # Python's to read
    got = pb.PullResponse.FromString(plain.decode_wire([blob], 0, 1) or b"-").messages[0]
    assert (got.queue_offset, got.commit_offset, got.body) == (20, 10 + bf.HEADER_BYTES + 1, b"x")
    head = pb.PullResponse(next_offset=21, count=1).SerializeToString()
    answer = pb.PullResponse.FromString(plain.decode_wire([blob], 0, 1, head) or b"-")
    assert (answer.next_offset, answer.count, answer.messages[0].body) == (21, 1, b"x")


def test_a_large_decode_lets_go_of_the_lock_and_answers_alike() -> None:
    """From 4 MiB of batches the C walk runs without the interpreter lock: same answer."""
    items = [(bytes([i % 251]) * 1024, b"k%d" % i, bf.encode_props({"p": str(i)})) for i in range(3000)]
    blobs = [_batch(1 << 30, 7, items), _batch(2 << 30, 3007, items)]
    assert sum(map(len, blobs)) > 4 << 20
    expected = pb.PullResponse(messages=plain.decode(blobs, 5, 5990))
    assert pb.PullResponse.FromString(plain.decode_wire(blobs, 5, 5990) or b"-") == expected


def test_the_c_popped_answer_is_what_python_builds() -> None:
    """PopResponse.messages of leased runs, with records or decoded (``decode``), as the Python path
    builds them: per message its handle, the run's queue and delivery count, the batch's offset;
    and PopResponse.runs written by hand as protobuf writes them."""
    rng = random.Random(42)
    taken = 0
    for _ in range(400):
        runs = []
        for q in range(rng.randrange(1, 4)):
            blobs, total, base = [], 0, rng.randrange(1 << 30)
            for _ in range(rng.randrange(1, 3)):
                n = rng.randrange(1, 6)
                items = [(rng.randbytes(rng.randrange(9)), _key(rng), _props(rng)) for _ in range(n)]
                blobs.append(_batch(rng.randrange(1 << 40), base + total, items))
                total += n
            skip = rng.randrange(total)
            count = rng.randrange(1, total - skip + 1)
            prefix = receipts.lease_prefix(0, 3, rng.randrange(1, 1 << 62), q)
            runs.append(LeasedRun(q, base + skip, count, rng.randrange(1, 4),
                                  receipts.run_handle(prefix, base + skip, count, "orders"), blobs, skip))
        cuts = [cut_run(r.batches, r.skip_first, r.count) for r in runs]  # only the runs' records (test_cut_batches)
        as_runs = pb.PopResponse(runs=[pb.PoppedRun(queue_id=r.queue_id, first_offset=r.first_offset, count=r.count,
                                                    delivery_count=r.delivery_count, receipt_handle=r.receipt_handle,
                                                    batches=[b"".join(pieces) for pieces in blobs], skip_first=skip)
                                       for r, (blobs, skip, _) in zip(runs, cuts, strict=True)])
        assert pb.PopResponse.FromString(_runs_wire("orders", runs)) == as_runs  # joined in once, as protobuf writes them
        records = _popped_wire(runs, False)
        assert records is not None  # records need no decoding: always taken
        assert pb.PopResponse.FromString(records) == pb.PopResponse(messages=as_messages(runs))
        decoded = _popped_wire(runs, True)
        if decoded is None:
            continue
        taken += 1
        assert pb.PopResponse.FromString(decoded) == pb.PopResponse(messages=plain.decode_popped(runs, as_messages(runs)))
    assert taken > 150, taken
