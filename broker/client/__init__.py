"""Python client: ``from broker.client import BrokerClient, Message`` (DESIGN §8).

- ``client.py``: ``BrokerClient`` (connections, retries and redirects, idempotent sends, pulls,
  offsets, timers, admin) and ``BrokerError``;
- ``consumer.py``: ``Consumer``, a subscribe-mode group member (``BrokerClient.consumer``);
- ``messages.py``: ``Message``, receipts, pulled messages (decoded lazily), record encoding.
"""

from broker.client.client import BrokerClient, BrokerError
from broker.client.consumer import Consumer
from broker.client.messages import Message, PoppedMessage, PoppedRun, PopResult, PulledMessage, PullResult, Receipt, Receipts

__all__ = [
    "BrokerClient",
    "BrokerError",
    "Consumer",
    "Message",
    "PopResult",
    "PoppedMessage",
    "PoppedRun",
    "PullResult",
    "PulledMessage",
    "Receipt",
    "Receipts",
]
