"""Python client: ``from broker.client import BrokerClient, Message`` (DESIGN §8).

- ``client.py``: ``BrokerClient`` (connections, retries and redirects, idempotent sends, pulls,
  offsets, timers, admin) and ``BrokerError``;
- ``messages.py``: ``Message``, receipts, pulled messages (decoded lazily), record encoding.
"""

from broker.client.client import BrokerClient, BrokerError
from broker.client.messages import Message, PulledMessage, PullResult, Receipt, Receipts

__all__ = ["BrokerClient", "BrokerError", "Message", "PullResult", "PulledMessage", "Receipt", "Receipts"]
