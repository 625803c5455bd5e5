"""Receipt handles of pop mode: what a consumer hands back to ack, nack or extend one lease.

A handle is ``<lease>.<offset>.<topic>`` for one message, or ``<lease>.<offset>+<count>.<topic>``
for a run of ``count`` adjacent messages leased together (a pop answered in runs): ``lease`` is ``base64url(version u8 | cluster u64 |
epoch u32 | tag u64 | queue u16)`` without padding (the same for every message one pop call took
from one queue, so encoding is one string format per message and decoding one base64 per lease),
``offset`` (and ``count``) the queue offset in lower-case hex; a message's own handle in a run is
the run's with its offset and no count. ``cluster`` is a hash of the cluster id, so a handle
from another cluster is refused; ``tag`` is the random 63-bit tag of the lease (one per pop call),
which the lease view must still hold for the offset: a handle whose lease ended, or a forged one,
names a tag that is not there. Spec: docs/formats/pop-records.md.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from typing import NamedTuple

VERSION = 1
_PACKED = struct.Struct(">BQIQH")
HANDLE_CHARS_MAX = 400


class Handle(NamedTuple):
    cluster: int
    epoch: int
    tag: int
    topic: str
    queue_id: int
    offset: int
    length: int = 1  # a run of adjacent messages of one lease


def cluster_hash(cluster_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(cluster_id.encode(), digest_size=8).digest(), "big")


def lease_prefix(cluster: int, epoch: int, tag: int, queue_id: int) -> str:
    """The part of a handle shared by every message of one lease on one queue."""
    return base64.urlsafe_b64encode(_PACKED.pack(VERSION, cluster, epoch, tag, queue_id)).decode().rstrip("=")


def encode(h: Handle) -> str:
    return run_handle(lease_prefix(h.cluster, h.epoch, h.tag, h.queue_id), h.offset, h.length, h.topic)


def run_handle(lease: str, offset: int, count: int, topic: str) -> str:
    """The handle of ``count`` adjacent messages from ``offset`` (one message: ``count`` 1)."""
    run = f"+{count:x}" if count != 1 else ""
    return f"{lease}.{offset:x}{run}.{topic}"


def lease_of(handle: str) -> str:
    """The lease part of a handle (the same for every message of its run)."""
    return handle.split(".", 1)[0]


class Decoder:
    """Decodes the handles of one call; the lease part is decoded once per distinct lease."""

    def __init__(self) -> None:
        self._leases: dict[str, tuple[int, int, int, int]] = {}

    def decode(self, text: str) -> Handle:
        """Raise ValueError for anything that is not a well-formed handle."""
        parts = text.split(".", 2) if len(text) <= HANDLE_CHARS_MAX else ()
        if len(parts) != 3 or not parts[2]:
            raise ValueError("not a receipt handle")
        lease = self._leases.get(parts[0])
        if lease is None:
            lease = self._leases[parts[0]] = _decode_lease(parts[0])
        where, plus, run = parts[1].partition("+")
        offset = _hex(where)
        count = _hex(run) if plus else 1
        if not 0 <= offset < 1 << 63 or not 0 < count < 1 << 32:
            raise ValueError("not a receipt handle")
        return Handle(lease[0], lease[1], lease[2], parts[2], lease[3], offset, count)


def _hex(text: str) -> int:
    try:
        value = int(text, 16)
    except ValueError:
        raise ValueError("not a receipt handle") from None
    if text != f"{value:x}":
        raise ValueError("not a receipt handle")
    return value


def decode(text: str) -> Handle:
    return Decoder().decode(text)


def _decode_lease(packed: str) -> tuple[int, int, int, int]:
    try:
        raw = base64.urlsafe_b64decode(packed + "=" * (-len(packed) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not a receipt handle") from None
    if len(raw) != _PACKED.size:
        raise ValueError("not a receipt handle")
    version, cluster, epoch, tag, queue_id = _PACKED.unpack(raw)
    if version != VERSION:
        raise ValueError(f"receipt handle version {version} is not known here")
    return cluster, epoch, tag, queue_id
