"""Python client: ``from broker.client import BrokerClient, Message`` (DESIGN §8).

- ``client.py``: ``BrokerClient`` (connections, retries and redirects, idempotent sends, pulls,
  offsets, timers, admin) and ``BrokerError``;
- ``consumer.py``: ``Consumer``, a subscribe-mode group member (``BrokerClient.consumer``);
- ``producer.py``: ``Producer``, sends answered by futures, many calls in one request per shard
  (``BrokerClient.producer``);
- ``transactions_api.py``: ``Transaction`` (``BrokerClient.transaction`` / ``begin_transaction``),
  ``TransactionAborted``; ``checkback.py``: the stream that answers the master's check-backs;
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
from broker.client.producer import Producer
from broker.client.transactions_api import CheckQuestion, Transaction, TransactionAborted

__all__ = [
    "AlreadyExists",
    "BrokerClient",
    "BrokerError",
    "CheckQuestion",
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
    "Producer",
    "PullResult",
    "PulledMessage",
    "Receipt",
    "Receipts",
    "ResourceExhausted",
    "Transaction",
    "TransactionAborted",
    "Unauthenticated",
    "Unavailable",
]
