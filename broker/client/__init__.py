"""Python client: ``from broker.client import BrokerClient, Message`` (DESIGN §8).

- ``client.py``: ``BrokerClient`` (connections, retries and redirects, idempotent sends, pulls,
  offsets, timers, admin) and ``BrokerError``;
- ``consumer.py``: ``Consumer``, a subscribe-mode group member (``BrokerClient.consumer``);
- ``messages.py``: ``Message``, receipts, pulled messages (decoded lazily), record encoding;
- ``errors.py``: ``BrokerError`` (every failed call; ``.code`` is the gRPC status code) and one
  subclass per common code (``NotFound``, ``InvalidArgument``, ``Unavailable`` ...).
"""

from broker.client.client import BrokerClient
from broker.client.consumer import Consumer
from broker.client.errors import (
    AlreadyExists,
    BrokerError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from broker.client.messages import Message, PoppedMessage, PoppedRun, PopResult, PulledMessage, PullResult, Receipt, Receipts

__all__ = [
    "AlreadyExists",
    "BrokerClient",
    "BrokerError",
    "Consumer",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "Message",
    "NotFound",
    "OutOfRange",
    "PermissionDenied",
    "PopResult",
    "PoppedMessage",
    "PoppedRun",
    "PullResult",
    "PulledMessage",
    "Receipt",
    "Receipts",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
]
