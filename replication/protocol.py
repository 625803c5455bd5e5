"""Constants and conversions shared by both sides of the replication stream. Spec: docs/formats/replication.md."""

from __future__ import annotations

import grpc

from broker.logformat.scan import batch_boundary
from broker.store import Store
from proto import tidemark_pb2 as pb

PROTOCOL_VERSION = 1
HEARTBEAT_S = 0.1  # an idle master still sends its confirm offset this often


class Refused(Exception):
    """A stream the master will not serve (or no longer can): it ends with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def epochs_to_pb(entries: list[tuple[int, int]]) -> list[pb.EpochEntry]:
    return [pb.EpochEntry(epoch=e, start_offset=o) for e, o in entries]


def epochs_from_pb(entries: list[pb.EpochEntry]) -> list[tuple[int, int]]:
    return [(int(e.epoch), int(e.start_offset)) for e in entries]


def read_whole_batches(store: Store, offset: int, max_bytes: int) -> bytes:
    """Log bytes from ``offset`` cut at a batch boundary: at most ``max_bytes`` unless the first
    batch alone is bigger (then exactly that batch)."""
    end = store.log.max_offset
    if offset >= end:
        return b""
    data = store.log.read(offset, min(max_bytes, end - offset))
    n = batch_boundary(data, offset, len(data))
    return store.log.read(offset, n) if n > len(data) else data[:n]
