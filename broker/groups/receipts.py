"""Receipt handles of pop mode: what a consumer hands back to ack, nack or extend one lease.

A handle is ``base64url(version u8 | cluster u64 | epoch u32 | tag u64 | queue u16 | offset u64)``
followed by ``.`` and the topic name (split on the first ``.``, which base64url never produces).
``cluster`` is a hash of the cluster id, so a handle from another cluster is refused;
``tag`` is the random 64-bit tag of the lease (one per pop call), which the lease view must still
hold for the offset: a handle whose lease ended, or a forged one, names a tag that is not there.
Spec: docs/formats/pop-records.md.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from typing import NamedTuple

VERSION = 1
_PACKED = struct.Struct(">BQIQHQ")
HANDLE_CHARS_MAX = 400


class Handle(NamedTuple):
    cluster: int
    epoch: int
    tag: int
    topic: str
    queue_id: int
    offset: int


def cluster_hash(cluster_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(cluster_id.encode(), digest_size=8).digest(), "big")


def encode(h: Handle) -> str:
    raw = _PACKED.pack(VERSION, h.cluster, h.epoch, h.tag, h.queue_id, h.offset)
    return base64.urlsafe_b64encode(raw).decode().rstrip("=") + "." + h.topic


def decode(text: str) -> Handle:
    """Raise ValueError for anything that is not a well-formed handle."""
    if len(text) > HANDLE_CHARS_MAX or "." not in text:
        raise ValueError("not a receipt handle")
    packed, topic = text.split(".", 1)
    try:
        raw = base64.urlsafe_b64decode(packed + "=" * (-len(packed) % 4))
    except (binascii.Error, ValueError):
        raise ValueError("not a receipt handle") from None
    if len(raw) != _PACKED.size or not topic:
        raise ValueError("not a receipt handle")
    version, cluster, epoch, tag, queue_id, offset = _PACKED.unpack(raw)
    if version != VERSION:
        raise ValueError(f"receipt handle version {version} is not known here")
    return Handle(cluster, epoch, tag, topic, queue_id, offset)
