"""A gRPC server in the test process, for tests that script a node's answers exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc


@contextlib.contextmanager
def serving(register: Callable[[grpc.Server], None]) -> Iterator[str]:
    """A server on a free loopback port with what ``register`` adds to it; its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    register(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
