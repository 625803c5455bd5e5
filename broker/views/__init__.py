"""Views: state derived by applying commit-log records in order, each with its own checkpoint.

Every view has an ``applied_offset`` (all records below it are applied), ``apply(header,
batch)`` for one batch at or above it, ``end_round(offset)`` after a run of batches, and
``checkpoint()`` that persists ``(state, applied_offset)`` atomically.
"""

from broker.views.base import View
from broker.views.consume_queue import ConsumeQueueView
from broker.views.metadata import MetadataView
from broker.views.producer_state import ProducerStateView

__all__ = ["ConsumeQueueView", "MetadataView", "ProducerStateView", "View"]
