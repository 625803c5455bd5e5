"""The Prometheus endpoint (``node.metrics_listen``): ``GET /metrics``, optionally over TLS and
behind a bearer token, like the client port.

- ``node.metrics_tls = true``: TLS with ``tls.cert_file`` / ``tls.key_file``; with
  ``tls.client_ca_file`` the scraper must also present a certificate that CA signed.
- ``node.metrics_auth = true``: ``Authorization: Bearer <token>`` of ``auth.tokens_file`` with the
  ``metrics`` (or ``admin``) role; 401 without one, 403 for another. Tokens rotate with SIGHUP, as
  on the client port. Prometheus: ``authorization: {credentials_file: ...}`` in the scrape job.

Each request is served on a thread of its own (the TLS handshake too), so a slow or silent
scraper holds up nobody else; at most ``CONNECTIONS_MAX`` at once.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from broker.threads import NamedThread

log = structlog.get_logger("metrics_http")
CONNECTIONS_MAX = 16
SCHEME = "Bearer "
READ_TIMEOUT_S = 10.0
ROLES_ALLOWED = frozenset({"metrics", "admin"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry, tls: ssl.SSLContext | None,
                 authorize: Callable[[str | None], int] | None) -> None:
        super().__init__(address, _Handler)
        self.registry = registry
        self.authorize = authorize
        self.slots = threading.BoundedSemaphore(CONNECTIONS_MAX)
        if tls is not None:  # the handshake happens on the request's own thread (first read)
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # too many scrapers at once: drop this one
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:  # a failed handshake, a reset: one line
        log.info("metrics_request_failed", client=str(client_address[0]))


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = READ_TIMEOUT_S

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self._answer(404, b"not found: scrape /metrics\n")
            return
        if self.server.authorize is not None:
            status = self.server.authorize(self.headers.get("Authorization"))
            if status != 200:
                self._answer(status, b"a bearer token with the metrics role is required\n" if status == 401 else
                             b"this token lacks the metrics role\n", {"WWW-Authenticate": "Bearer"})
                return
        encoder, content_type = choose_encoder(str(self.headers.get("Accept", "")))
        self._answer(200, encoder(self.server.registry), {"Content-Type": content_type})

    def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        return


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
    """Start serving on a daemon thread; returns a function that stops it. OSError if it cannot listen."""
    server = _Server((host, port), registry, tls, authorize)
    thread = NamedThread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return stop


def tls_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
