"""Always-on assertions and the error types that corruption raises.

Python's ``assert`` vanishes under ``-O``; these do not. Use ``invariant`` at the points where a
broken assumption would otherwise spread corruption (record encode/decode, checkpoint load,
replication append).
"""

from __future__ import annotations


class InvariantError(AssertionError):
    """A condition the code relies on does not hold: a bug, never bad user input."""


class CorruptionError(Exception):
    """Stored bytes fail validation somewhere other than a repairable torn tail."""

    def __init__(self, message: str, *, path: str = "", offset: int = -1) -> None:
        where = f" ({path} at offset {offset})" if path and offset >= 0 else f" ({path})" if path else ""
        super().__init__(message + where)
        self.path = path
        self.offset = offset


class StartupRefused(Exception):
    """The daemon must not start; the message says why and what the operator can do."""


def invariant(condition: bool, message: str) -> None:
    """Raise InvariantError when ``condition`` is false."""
    if not condition:
        raise InvariantError(message)
