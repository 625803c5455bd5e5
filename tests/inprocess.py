"""A gRPC server in the test process, for tests that script a node's answers exactly."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

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


class Forwarding(grpc.GenericRpcHandler):
    """Forwards every unary call to the daemon at ``target``, as it answers. The calls of
    ``method`` (a suffix such as ``/Send``) are numbered from 1 as they arrive; those in ``refused``
    are refused UNAVAILABLE with ``refusal`` before they reach the daemon, those in ``lost`` are
    answered by it but the answer is replaced by UNAVAILABLE (an answer lost on the way)."""

    def __init__(self, target: str, method: str, *, refused: range = range(0), lost: range = range(0),
                 refusal: str = "refused by the test's proxy") -> None:
        self.channel = grpc.insecure_channel(target)
        self.method, self.refused, self.lost, self.refusal = method, refused, lost, refusal
        self.calls = 0  # calls of ``method`` so far
        self.lock = threading.Lock()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method  # type: ignore[attr-defined]
        forward = self.channel.unary_unary(method)

        def handle(request: bytes, context: grpc.ServicerContext) -> Any:
            number = 0
            if method.endswith(self.method):
                with self.lock:
                    self.calls += 1
                    number = self.calls
            if number in self.refused:
                context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal)
            try:
                answer = forward(request, timeout=context.time_remaining())
            except grpc.RpcError as exc:  # the daemon's answer, as it gave it
                context.set_trailing_metadata(exc.trailing_metadata())  # type: ignore[attr-defined]
                context.abort(exc.code(), exc.details())  # type: ignore[attr-defined]
            if number in self.lost:
                context.abort(grpc.StatusCode.UNAVAILABLE, "the answer was lost")
            return answer

        return grpc.unary_unary_rpc_method_handler(handle)


@contextlib.contextmanager
def forwarding(target: str, method: str, **rules: Any) -> Iterator[tuple[str, Forwarding]]:
    """A ``Forwarding`` proxy to ``target`` on a free port: its address and itself."""
    handler = Forwarding(target, method, **rules)
    try:
        with serving(lambda server: server.add_generic_rpc_handlers((handler,))) as address:
            yield address, handler
    finally:
        handler.channel.close()
