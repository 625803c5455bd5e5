"""Errors the broker core raises; the gRPC layer maps ``code`` to a status code of that name."""

from __future__ import annotations


class BrokerError(Exception):
    def __init__(self, code: str, message: str, *, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata  # sent as gRPC trailing metadata (e.g. the master's address)


def invalid(message: str) -> BrokerError:
    return BrokerError("INVALID_ARGUMENT", message)


def not_found(message: str) -> BrokerError:
    return BrokerError("NOT_FOUND", message)
