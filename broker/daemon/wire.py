"""gRPC registration of the Broker service, with a zero-copy Pull response.

A pull answer is mostly log bytes. Building a ``PullResponse`` message copies every blob into
it and serialising copies them again; instead the servicer returns the wire bytes, built with one
join: the small fields serialised by protobuf, then each blob as field 1 (``repeated bytes``,
wire type 2: tag ``0x0a``, varint length, bytes). Protobuf parsers accept fields in any order
(protobuf encoding spec), so clients parse it as an ordinary ``PullResponse``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError

from broker.daemon.failures import REQUEST, refuse
from broker.daemon.send_wire import parse_send
from broker.errors import MESSAGE_MAX, BrokerError
from broker.logformat.cut import Blob, cut_run
from proto import tidemark_pb2 as pb

log = structlog.get_logger("wire")
_BATCHES_TAG = b"\x0a"
SERVICE = pb.DESCRIPTOR.services_by_name["Broker"]


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field_parts(tag: bytes, value: bytes | memoryview | Blob) -> list[bytes | memoryview]:
    """A length-delimited field: its tag, its length as a varint, its value (pieces back to back)."""
    pieces = value if isinstance(value, tuple) else (value,)
    return [tag, varint(sum(len(p) for p in pieces)), *pieces]


_UNCUT_LOG_S = 60.0  # an answer sent uncut is logged at most this often (a damaged batch is read again and again)
_uncut_logged = [0.0]


def cut_answer(batches: Sequence[bytes], skip_first: int, count: int, topic: str, queue_id: int) -> tuple[list[Blob], int]:
    """``batches`` cut to the ``count`` records they answer after ``skip_first`` (``cut_run``), or
    as read, with a warning, when one of them does not check (a reader that checks the body CRC
    finds it too; ours and the Node example check the headers only)."""
    blobs, skip, why = cut_run(batches, skip_first, count)
    if why is not None:
        now = time.monotonic()
        if now - _uncut_logged[0] >= _UNCUT_LOG_S:
            _uncut_logged[0] = now
            log.warning("answer_sent_uncut", topic=topic, queue_id=queue_id, why=why)
    return blobs, skip


def pull_response_bytes(
    batches: Sequence[bytes | memoryview | Blob], *, skip_first: int, count: int, next_offset: int, min_offset: int,
    max_offset: int
) -> bytes:
    """Wire bytes of a ``PullResponse`` holding ``batches`` and the given scalar fields."""
    head = pb.PullResponse(skip_first=skip_first, count=count, next_offset=next_offset, min_offset=min_offset,
                           max_offset=max_offset)
    parts: list[bytes | memoryview] = [head.SerializeToString()]
    for blob in batches:
        parts += field_parts(_BATCHES_TAG, blob)
    return b"".join(parts)


def _passthrough(data: bytes) -> bytes:
    return data


# Methods that answer either a message or its wire bytes (the C path's message receipts, popped messages)
_MAYBE_BYTES = frozenset({"Send", "Pop"})


def _bytes_or(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    def serialize_or_pass(response: Any) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return serialize_or_pass


class Undecodable:
    """A request whose bytes do not parse as its message type."""

    def __init__(self, error: str) -> None:
        self.error = error


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """Parse a request, or mark it undecodable: gRPC would answer INTERNAL for a parser error."""

    def lenient(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(str(exc))

    return lenient


def _undecodable(request: Any) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(request, Undecodable):
        return grpc.StatusCode.INVALID_ARGUMENT, f"the request cannot be decoded: {request.error[:200]}"
    return None


def _refused(exc: BrokerError) -> tuple[grpc.StatusCode, str]:
    return getattr(grpc.StatusCode, exc.code), exc.message[:MESSAGE_MAX]


def _guarded(behavior: Callable[[Any, Any], Any], servicer: Any, fenced: bool, method: str) -> Callable[[Any, Any], Any]:
    """``behavior``, unless the request does not decode (INVALID_ARGUMENT) or, when ``fenced``, a new
    master's metadata view did not apply in time what was confirmed when it took office
    (``BrokerService.wait_fence``: every call but the exempt ones reads topics, queues or offsets
    from the views). A coroutine handler waits for the fence as a coroutine."""
    if inspect.iscoroutinefunction(behavior):
        async def run_async(request: Any, context: grpc.aio.ServicerContext) -> Any:
            REQUEST.set((method, request))  # each call runs in a context of its own
            refused = _undecodable(request)
            if refused is None and fenced:
                try:
                    await servicer.wait_fence_async()
                except BrokerError as exc:
                    refused = _refused(exc)
            if refused is not None:
                refuse(context, *refused)
                return None
            return await behavior(request, context)

        return run_async

    def run(request: Any, context: grpc.ServicerContext) -> Any:
        token = REQUEST.set((method, request))  # a pool thread serves many calls: reset after
        try:
            return _run_guarded(request, context)
        finally:
            REQUEST.reset(token)

    def _run_guarded(request: Any, context: grpc.ServicerContext) -> Any:
        refused = _undecodable(request)
        if refused is None and fenced:
            try:
                servicer.wait_fence()
            except BrokerError as exc:
                refused = _refused(exc)
        if refused is not None:
            refuse(context, *refused)
            return None
        return behavior(request, context)

    return run


def add_broker_service(servicer: Any, server: grpc.aio.Server, fence_exempt: frozenset[str] = frozenset()) -> None:
    """Register every Broker method; Pull returns pre-encoded bytes (see module docstring), Send's
    batches are views of the request (``send_wire``); a request that does not parse gets
    INVALID_ARGUMENT; every method but ``fence_exempt`` waits for a new master's metadata fence."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in SERVICE.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        if method.client_streaming or method.server_streaming:  # TransactionChecks: a coroutine of its own
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                servicer.rpc(method.name), request_deserializer=_lenient(request_cls.FromString),
                response_serializer=response_cls.SerializeToString)
            continue
        serialize: Callable[[Any], bytes] = (_passthrough if method.name == "Pull" else
                                             _bytes_or(response_cls.SerializeToString) if method.name in _MAYBE_BYTES
                                             else response_cls.SerializeToString)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _guarded(servicer.rpc(method.name), servicer, method.name not in fence_exempt, method.name),
            request_deserializer=_lenient(parse_send if method.name == "Send" else request_cls.FromString),
            response_serializer=serialize,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
