"""The hand-assembled Pull response parses as the protobuf message it stands for."""

from __future__ import annotations

import os

import pytest

from broker.daemon.wire import pull_response_bytes
from proto import tidemark_pb2 as pb


@pytest.mark.parametrize("sizes", [[], [1], [127, 128], [300, 16_384, 2_097_153]])
def test_pull_response_bytes_equal_protobuf(sizes: list[int]) -> None:
    """Blobs of any length (1-, 2- and 3-byte varints) and every scalar field survive a parse."""
    blobs = [os.urandom(n) for n in sizes]
    fields = {"skip_first": 3, "count": 70_000, "next_offset": 2**40, "min_offset": 5, "max_offset": 2**33}
    parsed = pb.PullResponse.FromString(pull_response_bytes(blobs, **fields))
    assert list(parsed.batches) == blobs
    assert {k: getattr(parsed, k) for k in fields} == fields
