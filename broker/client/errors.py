"""The client's exceptions: a failed call and its gRPC status code.

Every failure of a call is a ``BrokerError`` (``code``: the ``grpc.StatusCode``, ``details``: the
server's one-line message); the common codes have their own subclass, so a caller can write
``except NotFound:`` or ``except BrokerError as e: if e.code == grpc.StatusCode.NOT_FOUND``. No
``grpc.RpcError`` leaves the client.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from broker.errors import OWNER_MASTER_KEY, OWNER_SHARD_KEY, ROUTES_REVISION_KEY


@dataclass(frozen=True)
class Owner:
    """Who writes a queue that a node of another shard refused (docs/shards.md)."""

    shard: str
    master: str  # its client address, '' while it has none
    revision: int  # the etcd revision of the refusing node's copy


class BrokerError(Exception):
    """A call failed; ``code`` is the gRPC status code, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str, owner: Owner | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message
        self.owner = owner  # a refusal for another shard's queue: its owner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}, {self.details!r})"


class InvalidArgument(BrokerError):
    """The request was malformed or out of range; nothing changed."""


class NotFound(BrokerError):
    """An unknown topic, group, timer or similar."""


class AlreadyExists(BrokerError):
    """A topic of that name exists."""


class FailedPrecondition(BrokerError):
    """Not possible in the current state (a write to a slave, a fenced master, a stale lease)."""



class TransactionAborted(FailedPrecondition):
    """A commit found the transaction aborted (its timeout, an operator, a check-back answer, a
    participant shard that could not prepare)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)
        self.reason = reason

class OutOfRange(BrokerError):
    """An offset beyond the end of a queue, or removed by retention."""


class ResourceExhausted(BrokerError):
    """A limit was reached (disk space, open files, request size); retry later or with less."""


class PermissionDenied(BrokerError):
    """The token's role does not allow this call."""


class Unauthenticated(BrokerError):
    """No token, or an unknown one, where one is required."""


class Unavailable(BrokerError):
    """No node answered in time, or none is master yet; safe to retry."""


class DeadlineExceeded(BrokerError):
    """The call's deadline passed; a write may or may not have been stored (retry is idempotent)."""


BY_CODE: dict[grpc.StatusCode, type[BrokerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRange,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def error_for(code: grpc.StatusCode, message: str, owner: Owner | None = None) -> BrokerError:
    """The exception for ``code``: its subclass if it has one, else ``BrokerError``."""
    return BY_CODE.get(code, BrokerError)(code, message, owner)


def owner_of(exc: grpc.RpcError) -> Owner | None:
    """The owner named by a refusal for another shard's queue (None: another failure)."""
    try:
        trailing = dict(exc.trailing_metadata() or ())  # type: ignore[attr-defined]
    except Exception:  # not every RpcError carries metadata
        return None
    shard = trailing.get(OWNER_SHARD_KEY)
    if not shard:
        return None
    try:
        revision = int(trailing.get(ROUTES_REVISION_KEY, 0))
    except ValueError:
        revision = 0
    return Owner(str(shard), str(trailing.get(OWNER_MASTER_KEY, "")), revision)


def from_rpc_error(exc: grpc.RpcError) -> BrokerError:
    code = exc.code()  # type: ignore[attr-defined]
    return error_for(code, exc.details() or "", owner_of(exc) if code == grpc.StatusCode.FAILED_PRECONDITION else None)
