"""Append semantics of the store: idempotent sequences within and across requests."""

from __future__ import annotations

from pathlib import Path

import crc32c
import pytest

from broker import batch_format as bf
from broker.errors import BrokerError
from broker.store import IncomingBatch
from tests.storeutil import create_topic, open_store, read_all


def _batch(seq: int, bodies: list[bytes], pid: int = 11) -> IncomingBatch:
    records, _ = bf.encode_records([(b, b"", b"") for b in bodies])
    return IncomingBatch("t", 0, records, len(bodies), crc32c.crc32c(records), producer_id=pid, base_sequence=seq)


def test_sequences_within_one_request(tmp_path: Path) -> None:
    """Consecutive batches of one producer in one request are accepted; a repeated one is a duplicate."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    receipts, end = s.append([_batch(0, [b"a", b"b"]), _batch(2, [b"c"]), _batch(0, [b"a", b"b"])])
    s.wait_ack(end, "flush", 5000)
    assert [r.duplicate for r in receipts] == [False, False, True]
    assert receipts[2].commit_offset == receipts[0].commit_offset
    assert read_all(s, "t") == [b"a", b"b", b"c"]
    s.stop()


def test_rejected_request_leaves_no_sequence_behind(tmp_path: Path) -> None:
    """A request refused for an out-of-order batch records none of its batches."""
    s = open_store(str(tmp_path))
    create_topic(s, "t")
    with pytest.raises(BrokerError, match="out-of-order"):
        s.append([_batch(0, [b"x"]), _batch(5, [b"y"])])
    receipts, end = s.append([_batch(0, [b"x"])])
    s.wait_ack(end, "flush", 5000)
    assert not receipts[0].duplicate
    assert read_all(s, "t") == [b"x"]
    s.stop()
