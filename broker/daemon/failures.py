"""What a request that failed on anything but a ``BrokerError`` answers, and the one line it logs.

An unexpected error is a bug that must not take the daemon down, nor stall it: it is logged as
one bounded line (the error's type and message cut to ``SHOWN_MAX`` characters, the method, the
request's size, the frames it passed through, a failure id the answer repeats) and never the
request's contents: a traceback renderer that shows local variables printed whole requests (a
send of 5,000 messages held the serving thread for 12 s, users' messages in the daemon's log).
"""

from __future__ import annotations

import errno
import secrets
from contextvars import ContextVar
from typing import Any

import grpc
import structlog

from broker.errors import BrokerError
from broker.logsafe import bounded, frames, kind

log = structlog.get_logger("service")
REQUEST: ContextVar[tuple[str, Any] | None] = ContextVar("tidemark_request", default=None)  # (method, request)


def refuse(context: Any, code: grpc.StatusCode, message: str, metadata: Any = None) -> None:
    """End a call with ``code``: the handler returns None after this (grpc sends no message for a
    status other than OK). Not ``context.abort``: it raises, and grpc keeps that exception with a
    traceback through the handler's frames, whose locals hold the request, in a cycle that only the
    cyclic collector frees (refused sends of 6 MB piled up to 1.4 GB between collections)."""
    if metadata:
        context.set_trailing_metadata(metadata)
    context.set_code(code)
    context.set_details(message)


def request_bytes(request: Any) -> int:
    """The request's encoded size, when it can be had without serializing it again (-1 if not)."""
    size = getattr(request, "wire_bytes", None)
    if isinstance(size, int):
        return size
    byte_size = getattr(request, "ByteSize", None)
    return int(byte_size()) if callable(byte_size) else -1


def unexpected(exc: Exception) -> BrokerError:
    """The process out of file descriptors (every idle file was already given back: sockets hold
    the rest) is a resource of this node, not a bug: RESOURCE_EXHAUSTED, which a client may retry.
    Anything else: INTERNAL, with a failure id to find the log line by."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        log.warning("out_of_file_descriptors", error=str(exc))
        return BrokerError("RESOURCE_EXHAUSTED", f"this node is out of file descriptors ({exc.strerror}): "
                           "retry later, or raise LimitNOFILE above limits.open_files_max plus the connections")
    failure_id = secrets.token_hex(6)
    method, request = REQUEST.get() or ("", None)
    log.error("request_failed", failure=failure_id, method=method, request_bytes=request_bytes(request),
              error=kind(exc), message=bounded(str(exc)), where=frames(exc))
    return BrokerError("INTERNAL", f"internal error {failure_id} ({kind(exc)}); the node's log has its line")
