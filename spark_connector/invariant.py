"""Always-on assertions for the connector (``assert`` vanishes under ``python -O``)."""

from __future__ import annotations


class InvariantError(AssertionError):
    """A condition the connector relies on does not hold: a bug, never bad user input."""


def invariant(condition: bool, message: str) -> None:
    """Raise InvariantError when ``condition`` is false."""
    if not condition:
        raise InvariantError(message)
