"""Bearer-token authentication for admin and write calls (``auth.token_file``).

Clients send ``authorization: Bearer <token>`` metadata. A server interceptor lets through, with
no token, only the methods on an explicit read-only allow-list; every other method (including any
added later) needs the token. No token or a malformed header → ``UNAUTHENTICATED``; a wrong token →
``PERMISSION_DENIED``. Refusals are logged with the method and the peer, never with the secret.
The file is re-read on SIGHUP, so a token can be rotated without a restart.
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from broker import metrics
from broker.config import Config, ConfigError

log = structlog.get_logger("auth")
TOKEN_CHARS_MIN = 16
HEADER = "authorization"
SCHEME = "Bearer "

# Never need a token: liveness probes must work for anyone who can reach the port.
ALWAYS_OPEN = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
# Read-only calls: open unless auth.require_for_reads. Everything not listed is treated as a write.
READ_ONLY = frozenset({
    "/tidemark.v1.Broker/Pull",
    "/tidemark.v1.Broker/OffsetForTime",
    "/tidemark.v1.Broker/GetOffset",
    "/tidemark.v1.Broker/ListTopics",
    "/tidemark.v1.Broker/Status",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
})


def read_token(path: str, key: str = "auth.token_file") -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if len(token) < TOKEN_CHARS_MIN or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(f"{key}: {path} must hold one token of at least {TOKEN_CHARS_MIN} printable ASCII "
                          "characters without spaces")
    return token


class TokenSource:
    """The expected token, re-readable from its file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._token = read_token(path)
        self._lock = threading.Lock()

    def matches(self, given: str) -> bool:
        with self._lock:
            expected = self._token
        return hmac.compare_digest(given.encode(), expected.encode())

    def replace(self, token: str) -> bool:
        """Use ``token`` from now on (SIGHUP re-reads the file); True if it changed."""
        with self._lock:
            changed, self._token = token != self._token, token
        return changed


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str,
              on_refuse: Callable[[grpc.ServicerContext], None]) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails every call with ``code``."""

    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        on_refuse(context)
        context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class TokenInterceptor(grpc.ServerInterceptor):
    def __init__(self, tokens: TokenSource, require_for_reads: bool) -> None:
        self.tokens = tokens
        self.require_for_reads = require_for_reads

    def needs_token(self, method: str) -> bool:
        if method in ALWAYS_OPEN:
            return False
        return self.require_for_reads or method not in READ_ONLY

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        method = details.method  # type: ignore[attr-defined]
        if handler is None or not self.needs_token(method):
            return handler
        header = next((str(v) for k, v in details.invocation_metadata or () if k == HEADER), None)  # type: ignore[attr-defined]
        if header is None or not header.startswith(SCHEME) or not header[len(SCHEME):].strip():
            reason, code = ("no token" if header is None else "malformed authorization header"), grpc.StatusCode.UNAUTHENTICATED
        elif not self.tokens.matches(header[len(SCHEME):].strip()):
            reason, code = "wrong token", grpc.StatusCode.PERMISSION_DENIED
        else:
            return handler

        def on_refuse(context: grpc.ServicerContext) -> None:
            metrics.AUTH_REFUSED.labels(code.name).inc()
            log.warning("auth_refused", method=method, peer=context.peer(), reason=reason)

        return _refusing(handler, code, f"{method}: {reason} (this call needs the bearer token)", on_refuse)


def interceptors(config: Config) -> tuple[list[grpc.ServerInterceptor], TokenSource | None]:
    """The server interceptors ``config`` asks for, and the token source (for SIGHUP)."""
    if not config["auth.token_file"]:
        return [], None
    tokens = TokenSource(config["auth.token_file"])
    return [TokenInterceptor(tokens, config["auth.require_for_reads"])], tokens


def call_metadata(config: Config) -> tuple[tuple[str, str], ...]:
    """Metadata carrying our token on calls to another node (replication), if one is configured."""
    if not config["auth.token_file"]:
        return ()
    return ((HEADER, SCHEME + read_token(config["auth.token_file"])),)
