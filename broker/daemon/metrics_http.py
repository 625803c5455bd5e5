"""The Prometheus endpoint (``node.metrics_listen``): ``GET /metrics``, optionally over TLS and
behind a bearer token, like the client port.

- ``node.metrics_tls = true``: TLS with ``tls.cert_file`` / ``tls.key_file``; with
  ``tls.client_ca_file`` the scraper must also present a certificate that CA signed.
- ``node.metrics_auth = true``: ``Authorization: Bearer <token>`` of ``auth.tokens_file`` with the
  ``metrics`` (or ``admin``) role; 401 without one, 403 for another. Tokens rotate with SIGHUP, as
  on the client port. Prometheus: ``authorization: {credentials_file: ...}`` in the scrape job.

A stranger must not keep the scraper out (DESIGN §10). Connections live on an event loop of their
own (``aioloop.LoopThread``, asyncio's loop: uvloop cannot start TLS on an accepted stream): a slow
or silent one holds a socket, never a thread.

- The TLS handshake, the request line and the headers must all arrive within ``HEAD_DEADLINE_S``
  of the connection (a byte now and then does not renew it) and within ``HEAD_BYTES_MAX``
  (past it: 431); otherwise the connection is closed.
- The token is checked as soon as the headers are complete, before anything else. A scrape has no
  body: a request announcing one (``Content-Length`` > 0, ``Transfer-Encoding``) is answered 413
  without reading it.
- At most ``CONNECTIONS_MAX`` connections at once; one more closes the oldest that is not being
  answered a scrape (still sending its head, or being refused), or is itself refused when there
  is none.
- The page is rendered off the loop (one at a time, thread ``metrics-render``) and must be
  written within ``ANSWER_DEADLINE_S``.

Connections closed by these bounds are counted in ``tidemark_metrics_connections_refused_total``
by reason. One request per connection (``Connection: close``), as Prometheus scrapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from broker import metrics
from broker.daemon.aioloop import LoopThread
from broker.threads import name_pool_thread

log = structlog.get_logger("metrics_http")
SCHEME = "Bearer "
ROLES_ALLOWED = frozenset({"metrics", "admin"})
HEAD_DEADLINE_S = 5.0  # from accept: the TLS handshake, the request line and every header
HEAD_BYTES_MAX = 8 * 1024  # the request line and headers (Prometheus sends ~300 bytes)
ANSWER_DEADLINE_S = 10.0  # to write a page (a few MB with many series) and close
CONNECTIONS_MAX = 64  # each holds a descriptor and at most 2 x HEAD_BYTES_MAX of buffer
LINGER_AFTER = (400, 413, 431)  # refusals of a client that may still be sending: its input is dropped
LINGER_S = 1.0  # for this long (at most LINGER_BYTES_MAX) before the close, so that it reads the answer
LINGER_BYTES_MAX = 64 * 1024  # instead of a reset
TLS_FAILURE_LOG_EVERY_S = 1.0
HEAD_END = b"\r\n\r\n"
PATHS = ("/metrics", "/")
Answer = tuple[int, bytes, dict[str, str]]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass(eq=False)
class _Connection:
    writer: asyncio.StreamWriter
    scraping: bool = False  # authorized and being answered a page: not evicted


class _Protocol(asyncio.StreamReaderProtocol):
    """With TLS, reads nothing until the handler starts the handshake: a ClientHello read as plain
    data before that would be lost."""

    def __init__(self, reader: asyncio.StreamReader, connected: Handler, *, tls: bool) -> None:
        super().__init__(reader, connected)
        self._tls = tls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._tls:
            transport.pause_reading()  # type: ignore[attr-defined]
        super().connection_made(transport)


class _Server:
    def __init__(self, registry: CollectorRegistry, tls: ssl.SSLContext | None,
                 authorize: Callable[[str | None], int] | None) -> None:
        self.registry = registry
        self.tls = tls
        self.authorize = authorize
        self.connections: dict[asyncio.Task[Any], _Connection] = {}  # in accept order: the oldest first
        self.listener: asyncio.Server | None = None
        self.tls_failures, self.tls_failure_logged_at = 0, 0.0
        self.render = ThreadPoolExecutor(1, thread_name_prefix="metrics-render", initializer=name_pool_thread)

    async def listen(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.listener = await loop.create_server(
            lambda: _Protocol(asyncio.StreamReader(HEAD_BYTES_MAX), self._connected, tls=self.tls is not None),
            host, port)

    async def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
        for task in list(self.connections):
            task.cancel()

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self.connections) >= CONNECTIONS_MAX and not self._evict_one():
            metrics.METRICS_CONNECTIONS_REFUSED.labels("full").inc()
            writer.transport.abort()
            return
        conn = self.connections[task] = _Connection(writer)
        try:
            await self._serve(conn, reader)
        except asyncio.CancelledError:  # evicted, or the server stops: quietly (3.11's streams log a cancelled handler)
            pass
        finally:
            self.connections.pop(task, None)
            conn.writer.transport.abort()  # a no-op after a graceful close

    def _evict_one(self) -> bool:
        """Close the oldest connection not being answered a scrape; False when every one is."""
        for task, conn in self.connections.items():
            if not conn.scraping:
                del self.connections[task]
                task.cancel()
                metrics.METRICS_CONNECTIONS_REFUSED.labels("evicted").inc()
                return True
        return False

    async def _serve(self, conn: _Connection, reader: asyncio.StreamReader) -> None:
        try:
            async with asyncio.timeout(HEAD_DEADLINE_S):
                if self.tls is not None:
                    await conn.writer.start_tls(self.tls)
                head = await reader.readuntil(HEAD_END)
        except TimeoutError:
            metrics.METRICS_CONNECTIONS_REFUSED.labels("deadline").inc()
            return
        except asyncio.LimitOverrunError:
            metrics.METRICS_CONNECTIONS_REFUSED.labels("head_too_large").inc()
            await self._answer(conn, reader, (431, b"the request head is too large\n", {}))
            return
        except ssl.SSLError as exc:  # a failed handshake (plain HTTP, a certificate refused)
            self._log_tls_failure(conn, exc)
            return
        except (asyncio.IncompleteReadError, OSError):  # closed or reset before its head was complete
            return
        answer, accept = self._check(head)
        if answer is None:
            conn.scraping = True
            encoder, content_type = choose_encoder(accept)
            page = await asyncio.get_running_loop().run_in_executor(self.render, encoder, self.registry)
            answer = (200, page, {"Content-Type": content_type})
        elif answer[0] == 413:
            metrics.METRICS_CONNECTIONS_REFUSED.labels("body").inc()
        await self._answer(conn, reader, answer)

    def _log_tls_failure(self, conn: _Connection, exc: ssl.SSLError) -> None:
        """One line a second at most: whoever connects decides how many handshakes fail."""
        self.tls_failures += 1
        now = time.monotonic()
        if now - self.tls_failure_logged_at >= TLS_FAILURE_LOG_EVERY_S:
            log.info("metrics_tls_failed", client=str(conn.writer.get_extra_info("peername")),
                     error=str(exc)[:200], failures_since_last_line=self.tls_failures)
            self.tls_failures, self.tls_failure_logged_at = 0, now

    def _check(self, head: bytes) -> tuple[Answer | None, str]:
        """The refusal a complete head gets (None: a scrape) and its Accept header. The token first."""
        request, *lines = head[:-len(HEAD_END)].decode("latin-1").split("\r\n")
        headers: dict[str, list[str]] = {}
        for line in lines:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                return (400, b"malformed header line\n", {}), ""
            headers.setdefault(name.lower(), []).append(value.strip())
        method, _, target = request.partition(" ")
        target, _, version = target.partition(" ")
        if not version.startswith("HTTP/"):
            return (400, b"malformed request line\n", {}), ""
        if self.authorize is not None:
            given = headers.get("authorization", [])
            status = self.authorize(given[0] if len(given) == 1 else None)
            if status != 200:
                return (status, b"a bearer token with the metrics role is required\n" if status == 401 else
                        b"this token lacks the metrics role\n", {"WWW-Authenticate": "Bearer"}), ""
        if "transfer-encoding" in headers or any(v != "0" for v in headers.get("content-length", [])):
            return (413, b"a scrape has no body\n", {}), ""
        if method != "GET":
            return (405, b"GET /metrics\n", {"Allow": "GET"}), ""
        if target.split("?", 1)[0] not in PATHS:
            return (404, b"not found: scrape /metrics\n", {}), ""
        return None, ", ".join(headers.get("accept", []))

    async def _answer(self, conn: _Connection, reader: asyncio.StreamReader, answer: Answer) -> None:
        """Write ``answer`` and close, within ``ANSWER_DEADLINE_S``; after a refusal of what may still be
        arriving, drop it for a moment first (closing on unread input would reset the answer)."""
        status, body, headers = answer
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", *(f"{k}: {v}" for k, v in headers.items()),
                 f"Content-Length: {len(body)}", "Connection: close", "", ""]
        writer = conn.writer
        with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
            async with asyncio.timeout(ANSWER_DEADLINE_S):
                writer.write("\r\n".join(lines).encode("latin-1") + body)
                await writer.drain()
                if status in LINGER_AFTER:
                    await _drop_input(reader, writer)
                writer.close()
                await writer.wait_closed()


async def _drop_input(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    if writer.can_write_eof():
        writer.write_eof()
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while dropped < LINGER_BYTES_MAX and (chunk := await reader.read(LINGER_BYTES_MAX)):
                dropped += len(chunk)


def bearer_check(find_roles: Callable[[str], frozenset[str] | None]) -> Callable[[str | None], int]:
    """An ``authorize`` for ``serve``: HTTP status 200, 401 or 403 for an Authorization header."""

    def authorize(header: str | None) -> int:
        if not header or not header.startswith(SCHEME) or not header[len(SCHEME):].strip():
            return 401
        roles = find_roles(header[len(SCHEME):].strip())
        return 200 if roles is not None and roles & ROLES_ALLOWED else 403

    return authorize


def serve(host: str, port: int, registry: CollectorRegistry, *, tls: ssl.SSLContext | None = None,
          authorize: Callable[[str | None], int] | None = None) -> Callable[[], None]:
    """Start serving on a loop thread of its own; returns a function that stops it. OSError if it cannot listen."""
    loop = LoopThread("metrics-http", asyncio.new_event_loop)
    server = _Server(registry, tls, authorize)
    try:
        loop.call(server.listen(host, port))
    except BaseException:
        loop.close()
        raise

    def stop() -> None:
        loop.call(server.close())
        loop.close(drain_s=1.0)
        server.render.shutdown(wait=False)

    return stop


def tls_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
