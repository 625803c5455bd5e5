"""Python client: ``from broker.client import BrokerClient, Message``.

Sends are batched per queue and encoded once; each batch carries this client's random producer
id and a per-queue sequence, so a retried request (transient failure) lands exactly once.
Pulled batches decode lazily: ``pull()`` returns a sequence whose items are built on access.

The connection (addresses, retries, redirects) is ``core.ClientCore``; each area of the API is a
class of its own (``topics_api``; ``data_api``, which uses it; ``transactions_api``, which uses that; ``groups_api``), and ``BrokerClient``
is all of them.
"""

from __future__ import annotations

from broker.client.core import ACKS, ClientCore
from broker.client.groups_api import GroupsAPI
from broker.client.producer import BUFFER_BYTES, LINGER_MS, REQUEST_BYTES, Producer
from broker.client.transactions_api import TransactionsAPI

__all__ = ["ACKS", "BrokerClient", "ClientCore"]


class BrokerClient(TransactionsAPI, GroupsAPI):
    """A connection to a Tidemark pair (DESIGN §8): ``BrokerClient("host:7600")`` or a list of
    addresses (it finds and follows the master). Sends are idempotent (a random producer id and
    sequence numbers), reads see what is confirmed. Every failure raises a ``BrokerError``
    subclass carrying the gRPC code. Use it in a ``with`` block, or ``close()`` it."""

    def __enter__(self) -> BrokerClient:
        return self

    def producer(self, *, ack: str = "replica", linger_ms: int = LINGER_MS, request_bytes: int = REQUEST_BYTES,
                 buffer_bytes: int = BUFFER_BYTES, max_block_ms: int | None = None,
                 timeout_ms: int | None = None) -> Producer:
        """A producer on this connection: ``send()`` returns a future at once, and what many calls
        send to one shard (or the pair) goes in one request (``broker/client/producer.py``). Close
        it (or leave its ``with`` block) before the client."""
        return Producer(self, ack=ack, linger_ms=linger_ms, request_bytes=request_bytes, buffer_bytes=buffer_bytes,
                        max_block_ms=max_block_ms, timeout_ms=timeout_ms)
