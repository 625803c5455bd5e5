"""Always-on assertions and the error types that corruption raises.

Python's ``assert`` vanishes under ``-O``; these do not. ``invariant`` stands where a broken
assumption would otherwise spread corruption: a queue file's entries (``views/consume_queue.py``:
whole entries, consecutive queue offsets, a checkpointed size), an append landing where the log
ended (``store/appender.py``: client and replicated appends, and the log's end after a divergence
cut), the confirm offset never moving back nor past the flushed offset (``store/watermarks.py``),
and the Spark connector's own reads (``spark_connector``).
"""

from __future__ import annotations

from broker.logformat.errors import CorruptionError

__all__ = ["CorruptionError", "InvariantError", "StartupRefused", "invariant"]


class InvariantError(AssertionError):
    """A condition the code relies on does not hold: a bug, never bad user input."""


class StartupRefused(Exception):
    """The daemon must not start; the message says why and what the operator can do."""


def invariant(condition: bool, message: str) -> None:
    """Raise InvariantError when ``condition`` is false."""
    if not condition:
        raise InvariantError(message)
