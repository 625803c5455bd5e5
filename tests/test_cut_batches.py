"""Cut batches (docs/formats/commitlog.md, "Cut batches"): a pop's run answered with only its
records, every record read back as the log holds it, and a batch that does not check sent whole."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable

import crc32c
import pytest
from structlog.testing import capture_logs

from broker.client import BrokerClient, Message
from broker.client.messages import _walk
from broker.daemon import wire
from broker.logformat import batch as bf
from broker.logformat.cut import cut_run
from broker.logformat.scan import Mode, scan_bytes
from tests.procs import DaemonProcess

TOPIC = b"orders"


def _batches(sizes: list[int], *, sequence: bool = True, first_offset: int = 8192) -> tuple[bytes, list[tuple[int, int, bytes]]]:
    """Adjacent batches of ``sizes`` records, as a log holds them, and every record's
    (commit offset, queue offset, body) in order."""
    blob = b""
    records_out: list[tuple[int, int, bytes]] = []
    queue_offset = 40
    for n in sizes:
        bodies = [b"b%d-" % (queue_offset + i) + b"x" * ((queue_offset + i) % 13) for i in range(n)]
        records, positions = bf.encode_records([(body, b"k", bf.encode_props({"i": str(i)})) for i, body in enumerate(bodies)])
        base = first_offset + len(blob)
        head = bf.build_header(batch_bytes=bf.HEADER_BYTES + len(TOPIC) + len(records), record_count=n, base_offset=base,
                               base_queue_offset=queue_offset, store_time_ms=77, producer_id=5 if sequence else 0,
                               base_sequence=100 + queue_offset if sequence else -1, epoch=3, queue_id=2,
                               topic_raw=TOPIC, body_crc=crc32c.crc32c(records), flags=bf.FLAG_TRANSACTIONAL)
        records_out += [(base + len(head) + p, queue_offset + i, b) for i, (p, b) in enumerate(zip(positions, bodies, strict=True))]
        blob += head + records
        queue_offset += n
    return blob, records_out


def _read(blobs: list[bytes], skip: int, count: int) -> list[tuple[int, int, bytes]]:
    """Every record a reader finds: (commit offset, queue offset, body), checking both CRCs."""
    out: list[tuple[int, int, bytes]] = []
    for blob in blobs:
        pos = 0
        for h, _ in scan_bytes(blob, mode=Mode.STRICT, verify_body=True, check_offsets=False):
            assert h.flags == bf.FLAG_TRANSACTIONAL and h.store_time_ms == 77 and h.epoch == 3 and h.topic == "orders"
            for i, (at, _, _, body) in enumerate(bf.iter_records(memoryview(blob)[pos:pos + h.batch_bytes], h)):
                if h.base_sequence >= 0:
                    assert h.base_sequence == 100 + h.base_queue_offset
                out.append((h.base_offset + at, h.base_queue_offset + i, bytes(body)))
            pos += h.batch_bytes
    return out[skip:skip + count]


def _joined(blobs: list[tuple[bytes | memoryview, ...]]) -> list[bytes]:
    return [b"".join(pieces) for pieces in blobs]


@pytest.mark.parametrize("sequence", [True, False])
def test_every_run_reads_back_as_the_log_holds_it(sequence: bool) -> None:
    """Every (skip, count) over three batches held in two blobs: the cut run holds exactly the
    run's records, each with its commit offset, queue offset and body; nothing more is sent."""
    sizes = [5, 7, 4]
    blob, records = _batches(sizes, sequence=sequence)
    second = bf.peek_batch_bytes(blob, 0)
    blobs = [blob[:second], blob[second:]]
    total = sum(sizes)
    for skip in range(sizes[0]):
        for count in range(1, total - skip + 1):
            cut, skip_after, why = cut_run(blobs, skip, count)
            assert skip_after == 0 and why is None
            got = _read(_joined(cut), 0, 1 << 30)
            assert got == records[skip:skip + count], (skip, count)
            # the same records as the client's walk of the whole batches finds
            assert [b for _, _, b in got] == [bytes(b) for b in _walk(blobs, skip, count, bodies=True)]
            whole = sum(len(b) for b in blobs)
            if skip or count < total:
                assert sum(len(b) for b in _joined(cut)) < whole
            else:
                assert _joined(cut) == blobs  # nothing to cut: the batches as read


def test_a_batch_that_does_not_check_is_sent_whole() -> None:
    """A flipped byte in the records or the header, or a length past the blob: every batch as
    read, with the run's skip, so the reader finds what is wrong (never a CRC over changed bytes)."""
    blob, _ = _batches([6, 6])
    first = bf.peek_batch_bytes(blob, 0)
    for where in (first - 3, 20, first + 30, len(blob) - 1):
        bad = bytearray(blob)
        bad[where] ^= 0x40
        cut, skip, why = cut_run([bytes(bad)], 2, 7)
        assert skip == 2 and _joined(cut) == [bytes(bad)] and why
    cut, skip, why = cut_run([blob[:-1]], 1, 11)  # the second batch truncated
    assert skip == 1 and _joined(cut) == [blob[:-1]] and why
    cut, skip, why = cut_run([blob], 3, 20)  # more records named than held
    assert skip == 3 and _joined(cut) == [blob] and why == "11 records fewer than the answer names"


def test_native_and_python_spans_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C span of records equals the Python twin's on good and damaged framings."""
    rng = random.Random(11)
    cases = []
    for i in range(400):
        n = rng.randrange(1, 9)
        records, _ = bf.encode_records([(b"x" * rng.randrange(40), b"k" * rng.randrange(3), b"") for _ in range(n)])
        batch = bytearray(bf.HEADER_BYTES + len(TOPIC)) + records
        if i % 2:
            batch[rng.randrange(bf.HEADER_BYTES + len(TOPIC), len(batch))] = rng.randrange(256)
        start = bf.HEADER_BYTES + len(TOPIC)
        cases.append((bytes(batch), start, len(batch), rng.randrange(n + 1), rng.randrange(n + 2)))
    cases += [(b"", 0, 0, 0, 0), (b"abc", 5, 3, 0, 1), (b"abc", 0, 9, 0, 1), (b"abc", 0, 3, -1, 1),
              (b"x" * 64, 0, 64, 2**62, 2**62), (b"x" * 64, 0, 64, 0, 2**63 - 1)]  # never an overflow in C
    native = importlib.import_module("broker.logformat._framing")
    assert bf.native is native
    native_results = [bf.record_span(*c) for c in cases]
    monkeypatch.setattr(bf, "native", None)
    python_results = [bf.record_span(*c) for c in cases]
    assert native_results == python_results
    assert sum(r is not None for r in python_results) > 150 and None in python_results


def test_pulls_and_pops_answer_only_their_records(spawn: Callable[..., DaemonProcess]) -> None:
    """Pulls of 150 and pops of 300 from batches of 1,000: each answer carries little more than its
    messages' bytes (not the whole batch), and every message, offset and commit offset is right."""
    d = spawn("node")
    body = b"y" * 1000
    per_message = len(body) + 40  # a record's head, the index in its body; two cut heads at most per answer
    with BrokerClient(d.address) as c:
        for topic in ("pulled", "popped"):
            c.create_topic(topic, queues=1)
        sent = [Message(body + b"%05d" % i) for i in range(2000)]
        receipts = [r for k in range(2) for r in c.send("pulled", sent[k * 1000:(k + 1) * 1000], ack="flush")]
        for k in range(2):
            c.send("popped", sent[k * 1000:(k + 1) * 1000], ack="flush")
        offset, pulled = 0, []
        while offset < 2000:
            r = c.pull("pulled", 0, offset, max_messages=150)
            blobs, skip = r.raw_batches()
            assert skip == 0 and sum(len(b) for b in blobs) < len(r) * per_message + 2 * 200
            pulled += [(m.queue_offset, m.commit_offset, m.body) for m in r]
            offset = r.next_offset
        assert pulled == [(x.queue_offset, x.commit_offset, m.body) for x, m in zip(receipts, sent, strict=True)]
        seen: list[bytes] = []
        offsets: list[int] = []
        while True:
            got = c.pop("g", "popped", max_messages=300, invisible_ms=60_000, max_wait_ms=0, start="earliest")
            if not got:
                break
            answered = sum(len(b) for r in got._runs for b in r.batches)
            assert answered < len(got) * per_message + 2 * 200, answered
            seen += got.bodies()
            offsets += [m.queue_offset for m in got]
            assert [m.body for m in got] == got.bodies()
            assert c.ack("g", got) == {}
        assert seen == [m.body for m in sent] and offsets == list(range(2000))


def test_an_answer_sent_uncut_is_logged_at_most_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged batch is answered as read and named in the log, once a minute however often it is read."""
    blob, _ = _batches([4])
    bad = bytearray(blob)
    bad[-1] ^= 1
    monkeypatch.setattr(wire, "_uncut_logged", [0.0])
    with capture_logs() as logs:
        for _ in range(3):
            blobs, skip = wire.cut_answer([bytes(bad)], 1, 2, "orders", 2)
            assert skip == 1 and _joined(blobs) == [bytes(bad)]
        assert wire.cut_answer([blob], 1, 2, "orders", 2)[1] == 0
    assert [(e["event"], e["topic"], e["queue_id"]) for e in logs] == [("answer_sent_uncut", "orders", 2)]
    assert "CRCs" in logs[0]["why"]
