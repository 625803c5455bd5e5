"""Bent protobuf messages, for the tests of the hand-written wire readers (send_wire, pull_wire):
each reader must answer every message as the protobuf parser does."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.message import DecodeError

from broker.daemon.wire import varint

# a field number 0, a group, a long varint, a tag of 6 bytes (upb refuses it), one of 5 bytes
ODD_TAILS = (b"\x00\x01", b"\x0b\x0c", b"\x08" + b"\x80" * 11 + b"\x01", b"\x90\x80\x80\x80\x80\x00\x01",
             b"\x90\x80\x80\x80\x00\x01")


def mutated(rng: random.Random, data: bytes, *, scalars: Sequence[int], unknown: Sequence[int],
            more: Callable[[random.Random], bytes] | None = None) -> bytes:
    """``data`` bent the ways a careless or hostile peer would: cut or flipped bytes, a field
    (``unknown`` numbers, any wire type) appended, a scalar (``scalars``) again with any width,
    odd tags and varints, or ``more``'s own addition."""
    kind = rng.randrange(7 if more else 6)
    if kind == 0 and data:
        return data[: rng.randrange(len(data))]
    if kind == 1 and data:
        b = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.getrandbits(8)
        return bytes(b)
    if kind == 2:
        number, wire = rng.choice(unknown), rng.choice((0, 1, 2, 5))
        value = {0: varint(rng.getrandbits(64)), 1: rng.randbytes(8), 2: varint(3) + b"abc", 5: rng.randbytes(4)}[wire]
        return data + varint(number << 3 | wire) + value
    if kind == 3:  # the last occurrence wins; integers are cut to their type's width
        return data + varint(rng.choice(scalars) << 3) + varint(rng.getrandbits(rng.choice((3, 40, 64))))
    if kind == 4:
        return data + rng.choice(ODD_TAILS)
    if kind == 6 and more is not None:
        return data + more(rng)
    return data


def agree(make: Callable[[random.Random], bytes], bend: Callable[[random.Random, bytes], bytes],
          reader: Callable[[bytes], Any], parser: Callable[[bytes], Any], fields: Callable[[Any], Any],
          fast_type: type, count: int = 3000) -> int:
    """Assert ``reader`` and ``parser`` agree on ``count`` messages (half of them bent); return how
    many the reader took itself (not its fallback to the parser)."""
    rng = random.Random(18)
    fast = 0
    for i in range(count):
        data = make(rng)
        if i % 2:
            data = bend(rng, data)
        expected = _outcome(parser, fields, data)
        assert _outcome(reader, fields, data) == expected, data[:80]
        fast += expected != "DecodeError" and isinstance(reader(data), fast_type)
    return fast


def _outcome(parse: Callable[[bytes], Any], fields: Callable[[Any], Any], data: bytes) -> Any:
    try:
        return fields(parse(data))
    except DecodeError:
        return "DecodeError"
