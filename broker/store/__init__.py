"""The store: one commit log, its views, and the machinery between them (DESIGN §1-2).

``Store`` (``store.py``) wires the parts; each part is one concept.
"""

from broker.store.store import BatchReceipt, IncomingBatch, PullResult, Store

__all__ = ["BatchReceipt", "IncomingBatch", "PullResult", "Store"]
