"""The store: one commit log, its views, and the parts between them (DESIGN §1-2).

``Store.open(config)`` recovers a data directory and returns the store built on it; ``store.py``
lists the parts (one concept per module).
"""

from broker.ports import BatchReceipt, IncomingBatch
from broker.store.reads import PullResult
from broker.store.store import Store

__all__ = ["BatchReceipt", "IncomingBatch", "PullResult", "Store"]
