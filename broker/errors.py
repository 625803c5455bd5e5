"""Errors the broker core raises; the gRPC layer maps ``code`` to a status code of that name."""

from __future__ import annotations


class BrokerError(Exception):
    def __init__(self, code: str, message: str, *, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata  # sent as gRPC trailing metadata (e.g. the master's address)


class UnknownTopic(BrokerError):
    """NOT_FOUND for a topic this node does not know (``topic``: its name), so that a node of a
    cluster of shards can check with etcd before it lets the answer stand."""

    def __init__(self, topic: str, message: str) -> None:
        super().__init__("NOT_FOUND", message)
        self.topic = topic


# A request for a queue of another shard (docs/shards.md) is refused FAILED_PRECONDITION with the
# owner in trailing metadata: the client updates that route without asking anyone.
OWNER_SHARD_KEY = "tidemark-shard"
OWNER_MASTER_KEY = "tidemark-shard-master"
ROUTES_REVISION_KEY = "tidemark-routes-revision"
# A write refused UNAVAILABLE because its queue is moving between shards (nothing stored): clients
# retry it until their deadline, however many addresses they have (the move takes about a second)
MOVING = (("tidemark-retry", "moving"),)


def invalid(message: str) -> BrokerError:
    return BrokerError("INVALID_ARGUMENT", message)


def not_found(message: str) -> BrokerError:
    return BrokerError("NOT_FOUND", message)


NAME_SHOWN_MAX = 200  # a name echoed in an error; the whole message must fit gRPC's 8 KiB of metadata
MESSAGE_MAX = 1000


def shown(name: str) -> str:
    """``repr`` of a client-supplied name for an error message, at most ``NAME_SHOWN_MAX`` characters."""
    return repr(name) if len(name) <= NAME_SHOWN_MAX else repr(name[:NAME_SHOWN_MAX]) + f"… ({len(name)} characters)"
