"""Bearer tokens with roles (DESIGN §10): who may call what.

Clients send ``authorization: Bearer <token>``. ``auth.tokens_file`` holds one token per line,
``NAME ROLES TOKEN`` (roles comma-separated, from ``ROLES``; ``#`` starts a comment), so that
several tokens are valid at once (rotation: add the new one, move clients, remove the old). The
older ``auth.token_file`` (one token) still works: it has every role but ``replication``. Both
files are re-read on SIGHUP.

Each method needs one role (``METHOD_ROLES``; a method not listed needs ``admin``). Reads are
open to anonymous callers unless ``auth.require_for_reads``; health checks are always open.
Reading a system topic (``__timer`` holds users' delayed messages) needs ``system``, checked by
the service with ``caller_may``. With no token configured at all, every call is allowed but no
caller is *authenticated*: a replica's epoch is believed only from an authenticated peer.

No token or a malformed header → ``UNAUTHENTICATED``; an unknown token or a missing role →
``PERMISSION_DENIED``. Refusals are logged with the method, the peer and the token's *name*,
never the secret; tokens are compared in constant time.
"""

from __future__ import annotations

import contextvars
import hmac
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from broker import metrics
from broker.config import Config, ConfigError
from broker.errors import shown

log = structlog.get_logger("auth")
TOKEN_CHARS_MIN = 16
HEADER = "authorization"
SCHEME = "Bearer "
ROLES = ("read", "write", "admin", "replication", "system", "metrics")  # metrics: scrape /metrics only
LEGACY_ROLES = frozenset(ROLES) - {"replication"}
LEGACY_NAME = "auth.token_file"

# Never need a token: liveness probes must work for anyone who can reach the port.
ALWAYS_OPEN = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
METHOD_ROLES = {
    "/tidemark.v1.Broker/Pull": "read",
    "/tidemark.v1.Broker/PullLocal": "read",
    "/tidemark.v1.Broker/OffsetForTime": "read",
    "/tidemark.v1.Broker/GetOffset": "read",
    "/tidemark.v1.Broker/ListTopics": "read",
    "/tidemark.v1.Broker/Status": "read",
    "/tidemark.v1.Broker/ListGroups": "read",
    "/tidemark.v1.Broker/DescribeGroup": "read",
    "/tidemark.v1.Broker/DescribeTopic": "read",
    "/tidemark.v1.Broker/GetRoutes": "read",
    "/tidemark.v1.Broker/ListTransactions": "read",
    "/tidemark.v1.Broker/DescribeTransaction": "read",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": "read",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": "read",
    "/tidemark.v1.Broker/Send": "write",
    "/tidemark.v1.Broker/CommitOffset": "write",
    "/tidemark.v1.Broker/CancelTimer": "write",
    "/tidemark.v1.Broker/Heartbeat": "write",  # joins a group: consuming with a group commits offsets too
    "/tidemark.v1.Broker/Pop": "write",  # leases messages: a change of state, recorded in __pop
    "/tidemark.v1.Broker/Ack": "write",
    "/tidemark.v1.Broker/Nack": "write",
    "/tidemark.v1.Broker/ChangeInvisible": "write",
    "/tidemark.v1.Broker/BeginTransaction": "write",
    "/tidemark.v1.Broker/EndTransaction": "write",
    "/tidemark.v1.Broker/TransactionChecks": "write",
    "/tidemark.v1.Broker/AddTransactionParticipant": "write",
    "/tidemark.v1.Broker/PrepareTransaction": "replication",  # node to node: a coordinator shard's master
    "/tidemark.v1.Broker/DecideTransaction": "replication",
    "/tidemark.v1.Broker/ForwardTimers": "replication",  # node to node: timers of a queue that moved
    "/tidemark.v1.Broker/ImportOffsets": "replication",  # node to node: offsets of a group slot that moved
    "/tidemark.v1.Broker/AbortTransaction": "admin",
    "/tidemark.v1.Broker/CreateTopic": "admin",
    "/tidemark.v1.Broker/CreateTopics": "admin",
    "/tidemark.v1.Broker/DeleteTopic": "admin",
    "/tidemark.v1.Broker/MoveQueue": "admin",
    "/tidemark.v1.Broker/MoveSlot": "admin",
    "/tidemark.v1.Broker/Rebalance": "admin",
    "/tidemark.v1.Broker/Promote": "admin",
    "/tidemark.v1.Broker/Demote": "admin",
    "/tidemark.v1.Broker/ResetOffsets": "admin",
    "/tidemark.v1.Replication/Stream": "replication",
    "/tidemark.v1.Replication/Snapshot": "replication",
}

READ_ONLY = frozenset(m for m, role in METHOD_ROLES.items() if role == "read")
# Any known token may ask these, whatever its roles: a producer holding only ``write`` must find
# where its queues are in a cluster of shards (docs/shards.md)
ANY_TOKEN = frozenset({"/tidemark.v1.Broker/GetRoutes"})


@dataclass(frozen=True)
class Token:
    name: str
    roles: frozenset[str]
    secret: str


@dataclass(frozen=True)
class Caller:
    """Who is calling: the token's name and roles; ``authenticated`` when a credential proved it."""

    name: str
    roles: frozenset[str]
    authenticated: bool

    def may(self, role: str) -> bool:
        return role in self.roles


EVERYONE = Caller("anyone", frozenset(ROLES), authenticated=False)  # no token configured
ANONYMOUS = Caller("anonymous", frozenset({"read"}), authenticated=False)  # tokens configured, none sent
_CALLER: contextvars.ContextVar[Caller] = contextvars.ContextVar("caller", default=EVERYONE)


def current_caller() -> Caller:
    """The caller of the request being handled (set by the interceptor)."""
    return _CALLER.get()


# -- token files ------------------------------------------------------------------------------------
def _check_secret(secret: str, where: str) -> None:
    if len(secret) < TOKEN_CHARS_MIN or not secret.isascii() or not secret.isprintable() or " " in secret:
        raise ConfigError(f"{where} must hold a token of at least {TOKEN_CHARS_MIN} printable ASCII characters "
                          "without spaces")


def _read_text(path: str, key: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{key}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None


def read_token(path: str, key: str = "auth.token_file") -> str:
    """The single token of ``auth.token_file`` (or a client's ``--token-file``)."""
    token = _read_text(path, key).strip()
    _check_secret(token, f"{key}: {path}")
    return token


def read_tokens_file(path: str, key: str = "auth.tokens_file") -> list[Token]:
    """``NAME ROLES TOKEN`` per line; errors name the file and the line."""
    tokens: list[Token] = []
    for number, raw in enumerate(_read_text(path, key).splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{key}: {path} line {number}"
        parts = line.split()
        if len(parts) != 3:
            raise ConfigError(f"{where}: expected NAME ROLES TOKEN")
        name, roles_text, secret = parts
        roles = frozenset(r for r in roles_text.split(",") if r)
        unknown = sorted(roles - set(ROLES))
        if unknown or not roles:
            raise ConfigError(f"{where}: unknown role {unknown[0] if unknown else '(none)'!r}; roles are {', '.join(ROLES)}")
        _check_secret(secret, where)
        if any(t.name == name for t in tokens):
            raise ConfigError(f"{where}: token name {shown(name)} used twice")
        tokens.append(Token(name, roles, secret))
    if not tokens:
        raise ConfigError(f"{key}: {path} holds no token")
    return tokens


def load_tokens(config: Config) -> list[Token]:
    """Every token the configuration names (both files); empty when authentication is off."""
    tokens = read_tokens_file(config["auth.tokens_file"]) if config["auth.tokens_file"] else []
    if config["auth.token_file"]:
        tokens.append(Token(LEGACY_NAME, LEGACY_ROLES, read_token(config["auth.token_file"])))
    return tokens


class TokenSource:
    """The valid tokens, replaced as a whole on SIGHUP."""

    def __init__(self, tokens: list[Token]) -> None:
        self._tokens = tokens
        self._lock = threading.Lock()

    def find(self, given: str) -> Token | None:
        """The token whose secret is ``given``; every token is compared, in constant time."""
        with self._lock:
            tokens = self._tokens
        found = None
        for t in tokens:
            if hmac.compare_digest(given.encode(), t.secret.encode()):
                found = t
        return found

    def replace(self, tokens: list[Token]) -> bool:
        """Use ``tokens`` from now on; True if anything changed."""
        with self._lock:
            changed, self._tokens = tokens != self._tokens, tokens
        return changed

    def names(self) -> list[str]:
        with self._lock:
            return [t.name for t in self._tokens]


# -- deciding a call ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    reason: str


class Authorizer:
    """Decides each call from its method and metadata: a ``Caller`` or a ``Refusal``."""

    def __init__(self, tokens: TokenSource | None, require_for_reads: bool, *, peer_certified: bool = False) -> None:
        self.tokens = tokens
        self.require_for_reads = require_for_reads
        self.peer_certified = peer_certified  # a port whose TLS handshake required a trusted client certificate

    def decide(self, method: str, metadata: Any) -> Caller | Refusal:
        if self.peer_certified:
            return Caller("certificate", frozenset({"replication"}), authenticated=True)
        if self.tokens is None:
            return EVERYONE
        if method in ALWAYS_OPEN:
            return ANONYMOUS
        header = next((str(v) for k, v in metadata or () if k == HEADER), None)
        needed = METHOD_ROLES.get(method, "admin")
        if header is None:
            if method in ALWAYS_OPEN or (needed == "read" and not self.require_for_reads):
                return ANONYMOUS
            return Refusal(grpc.StatusCode.UNAUTHENTICATED, f"no token (this call needs the {needed} role)")
        secret = header[len(SCHEME):].strip() if header.startswith(SCHEME) else ""
        if not secret:
            return Refusal(grpc.StatusCode.UNAUTHENTICATED, "malformed authorization header")
        token = self.tokens.find(secret)
        if token is None:
            return Refusal(grpc.StatusCode.PERMISSION_DENIED, "unknown token")
        caller = Caller(token.name, token.roles, authenticated=True)
        if not caller.may(needed) and method not in ANY_TOKEN:
            return Refusal(grpc.StatusCode.PERMISSION_DENIED, f"token {token.name!r} lacks the {needed} role")
        return caller


def _as_caller(handler: grpc.RpcMethodHandler, caller: Caller) -> grpc.RpcMethodHandler:
    """``handler`` with ``current_caller()`` set to ``caller`` while it runs."""

    def unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(behavior):  # on the asyncio server: the context is this task's
            async def run_async(request: Any, context: Any) -> Any:
                _CALLER.set(caller)
                return await behavior(request, context)
            return run_async

        def run(request: Any, context: grpc.ServicerContext) -> Any:
            token = _CALLER.set(caller)
            try:
                return behavior(request, context)
            finally:
                _CALLER.reset(token)
        return run

    def streaming(behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def run_async(request: Any, context: Any) -> AsyncIterator[Any]:
                _CALLER.set(caller)
                async for item in behavior(request, context):
                    yield item
            return run_async
        if inspect.iscoroutinefunction(behavior):
            return unary(behavior)

        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            token = _CALLER.set(caller)  # the stream runs in this thread's context until it ends
            try:
                yield from behavior(request, context)
            finally:
                _CALLER.reset(token)
        return run

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kwargs)


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str,
              on_refuse: Callable[[grpc.ServicerContext], None], *, asynchronous: bool) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails every call with ``code`` (a coroutine on
    the asyncio server, which cannot run plain streaming handlers)."""

    def deny_sync(_request: Any, context: grpc.ServicerContext) -> Any:
        on_refuse(context)
        context.abort(code, message)

    async def deny_async(_request: Any, context: Any) -> Any:
        on_refuse(context)
        await context.abort(code, message)

    def deny_unary(_request: Any, context: Any) -> Any:
        """No abort (it raises, and grpc keeps the exception in a cycle with this frame, whose
        ``_request`` may be megabytes): the code set, nothing answered."""
        on_refuse(context)
        context.set_code(code)
        context.set_details(message)

    async def deny_unary_async(_request: Any, context: Any) -> Any:
        deny_unary(_request, context)

    deny: Callable[..., Any] = deny_async if asynchronous else deny_sync
    if not handler.response_streaming:
        deny = deny_unary_async if asynchronous else deny_unary

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


def _guarded(authorizer: Authorizer, handler: grpc.RpcMethodHandler | None,
             details: grpc.HandlerCallDetails, *, asynchronous: bool = False) -> grpc.RpcMethodHandler | None:
    """``handler`` run as its caller, or a handler that refuses the call."""
    if handler is None:
        return None
    method = details.method  # type: ignore[attr-defined]
    verdict = authorizer.decide(method, details.invocation_metadata)  # type: ignore[attr-defined]
    if isinstance(verdict, Caller):
        return _as_caller(handler, verdict)

    def on_refuse(context: grpc.ServicerContext) -> None:
        metrics.AUTH_REFUSED.labels(verdict.code.name).inc()
        log.warning("auth_refused", method=method, peer=context.peer(), reason=verdict.reason)

    return _refusing(handler, verdict.code, f"{method}: {verdict.reason}", on_refuse, asynchronous=asynchronous)


class AuthInterceptor(grpc.ServerInterceptor):
    """For the thread-pool gRPC server (a separate ``replication.listen`` port)."""

    def __init__(self, authorizer: Authorizer) -> None:
        self.authorizer = authorizer

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return _guarded(self.authorizer, continuation(details), details)


class AsyncAuthInterceptor(grpc.aio.ServerInterceptor):
    """For the asyncio gRPC server (the client port)."""

    def __init__(self, authorizer: Authorizer) -> None:
        self.authorizer = authorizer

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return _guarded(self.authorizer, await continuation(details), details, asynchronous=True)  # type: ignore[return-value]


def authorizer(config: Config, *, peer_certified: bool = False) -> tuple[Authorizer, TokenSource | None]:
    """The authorizer ``config`` asks for, and its token source (replaced on SIGHUP)."""
    tokens = load_tokens(config)
    source = TokenSource(tokens) if tokens else None
    return Authorizer(source, config["auth.require_for_reads"], peer_certified=peer_certified), source


def interceptors(config: Config, *, peer_certified: bool = False) -> tuple[list[grpc.ServerInterceptor], TokenSource | None]:
    """Interceptors of a thread-pool server, and the token source."""
    auth, source = authorizer(config, peer_certified=peer_certified)
    return [AuthInterceptor(auth)], source


def call_metadata(config: Config) -> tuple[tuple[str, str], ...]:
    """Metadata carrying our replication credential on calls to another node: the first token of
    ``auth.tokens_file`` with the ``replication`` role, if any."""
    if not config["auth.tokens_file"]:
        return ()
    token = next((t for t in read_tokens_file(config["auth.tokens_file"]) if "replication" in t.roles), None)
    return ((HEADER, SCHEME + token.secret),) if token is not None else ()
