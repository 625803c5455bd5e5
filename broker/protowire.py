"""Protobuf's wire format read by hand, for the two messages whose bulk bytes we keep as views of
the received bytes: the server's ``SendRequest`` (broker/daemon/send_wire.py) and the client's
``PullResponse`` (broker/client/pull_wire.py).

The encoding (protobuf's spec): a field is a tag varint ``number << 3 | wire_type``; varints are
little-endian base 128, at most 10 bytes; a length-delimited field is a varint length and its
bytes. A reader raises ``NotFast`` for anything it does not fully understand, and its caller then
hands the whole message to the protobuf parser, so every message gets the parser's answer.
"""

from __future__ import annotations

from collections.abc import Iterator

VARINT, LEN = 0, 2
U64 = (1 << 64) - 1
U32 = (1 << 32) - 1


class NotFast(Exception):
    """Something the hand reader leaves to the protobuf parser."""


def read_varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``pos`` (cut to 64 bits, as protobuf does) and the position after it."""
    value = shift = 0
    while shift < 70:
        if pos >= end:
            raise NotFast
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & U64, pos
        shift += 7
    raise NotFast  # more than 10 bytes


def fields(data: bytes, pos: int, end: int, most: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value or start, end) of each field between ``pos`` and ``end``;
    more than ``most`` fields go to the protobuf parser (a message of millions of repeated scalars
    is valid, and would take seconds here)."""
    count = 0
    while pos < end:
        count += 1
        if count > most:
            raise NotFast
        tag_at = pos
        tag, pos = read_varint(data, pos, end)
        if pos - tag_at > 5 or tag > U32:  # upb refuses a tag longer than 5 bytes or above 32 bits
            raise NotFast
        number, wire = tag >> 3, tag & 7
        if wire == VARINT:
            value, pos = read_varint(data, pos, end)
            yield number, wire, value, pos
        elif wire == LEN:
            size, pos = read_varint(data, pos, end)
            if size > end - pos:
                raise NotFast
            yield number, wire, pos, pos + size
            pos += size
        else:
            raise NotFast
