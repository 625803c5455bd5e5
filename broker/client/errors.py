"""The client's exception: a failed call and its gRPC status code."""

from __future__ import annotations

import grpc


class BrokerError(Exception):
    """A call failed; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message
