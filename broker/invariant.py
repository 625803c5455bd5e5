"""Always-on assertions and the error types that corruption raises.

Python's ``assert`` vanishes under ``-O``; these do not. Use ``invariant`` at the points where a
broken assumption would otherwise spread corruption (record encode/decode, checkpoint load,
replication append).
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
