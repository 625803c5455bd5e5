"""The metrics port under slow and hostile clients (issue 35, finding 12), on a real daemon: connections
that trickle their request (slow loris) or never finish a TLS handshake are closed at a deadline
counted from the connection, not renewed by each byte, and never lock a scraper with a valid token
out; the token is checked once the headers are in, and a request with a body is refused unread."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from broker.daemon.metrics_http import CONNECTIONS_MAX, HEAD_DEADLINE_S
from tests.certs import CA
from tests.procs import DaemonProcess, free_port
from tests.waits import wait_until

SCRAPER_TOKEN = "scrape-token-0123456789"
SLOW_CLIENTS = 32
SLOW_FOR_S = 15.0
SLOW_BYTE_EVERY_S = 2.0
SCRAPE_WITHIN_S = 2.0


def _metrics_node(spawn: Callable[..., DaemonProcess], tmp_path: Path, **extra: Any) -> tuple[DaemonProcess, int]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"scraper metrics {SCRAPER_TOKEN}\n")
    port = free_port()
    node = spawn("n", config={"node.metrics_listen": f"127.0.0.1:{port}", "node.metrics_auth": True,
                              "auth.tokens_file": str(tokens), **extra.pop("config", {})}, **extra)
    return node, port


def _connect(port: int, tls: ssl.SSLContext | None, timeout_s: float) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    return tls.wrap_socket(sock, server_hostname="127.0.0.1") if tls is not None else sock


def _ask(port: int, head: bytes, tls: ssl.SSLContext | None = None, timeout_s: float = SCRAPE_WITHIN_S) -> tuple[int, bytes]:
    """Send ``head`` on a new connection; the answer's status and body (the server closes after it).
    Status 0: the connection was closed or reset without an answer."""
    answer = b""
    try:
        with _connect(port, tls, timeout_s) as sock:
            sock.sendall(head)
            while chunk := sock.recv(65536):
                answer += chunk
    except (ConnectionError, ssl.SSLEOFError):
        pass
    if not answer:
        return 0, b""
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _scrape(port: int, token: str | None, tls: ssl.SSLContext | None = None) -> tuple[int, float]:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    t0 = time.monotonic()
    status, body = _ask(port, f"GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}\r\n".encode(), tls)
    assert status != 200 or b"tidemark_" in body
    return status, time.monotonic() - t0


def _refused(port: int, reason: str) -> float:
    """``tidemark_metrics_connections_refused_total{reason}``, scraped."""
    page = _ask(port, f"GET /metrics HTTP/1.1\r\nAuthorization: Bearer {SCRAPER_TOKEN}\r\n\r\n".encode())[1].decode()
    series = f'tidemark_metrics_connections_refused_total{{reason="{reason}"}} '
    return sum(float(line[len(series):]) for line in page.splitlines() if line.startswith(series))


class SlowClients:
    """``count`` connections that send a partial request line, then one byte every ``every_s``;
    each notes how long the server let it live (``None``: still open when the clients stopped)."""

    def __init__(self, port: int, count: int, every_s: float, for_s: float, tls: ssl.SSLContext | None = None) -> None:
        self.socks: list[socket.socket] = []
        self.opened_at: list[float] = []
        for _ in range(count):
            sock = _connect(port, tls, 5.0)
            sock.sendall(b"GET /metr")
            self.socks.append(sock)
            self.opened_at.append(time.monotonic())
        self.lived_s: list[float | None] = [None] * count
        self._every_s, self._for_s = every_s, for_s
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self) -> None:
        end = time.monotonic() + self._for_s
        while time.monotonic() < end:
            time.sleep(self._every_s)
            for i, sock in enumerate(self.socks):
                if self.lived_s[i] is None and not self._alive(sock):
                    self.lived_s[i] = time.monotonic() - self.opened_at[i]

    @staticmethod
    def _alive(sock: socket.socket) -> bool:
        try:
            sock.sendall(b"i")
            sock.settimeout(0.01)
            return sock.recv(1) != b""  # the server answered or closed: a close reads as b""
        except (TimeoutError, ssl.SSLWantReadError):
            return True
        except OSError:
            return False

    def join(self) -> None:
        self._thread.join()
        for sock in self.socks:
            sock.close()


def _scrapes_stay_served(port: int, slow: SlowClients, tls: ssl.SSLContext | None = None) -> list[float]:
    """While the slow clients trickle: a scrape with the token every half second, each answered 200 in time."""
    took = []
    while slow._thread.is_alive():
        status, elapsed = _scrape(port, SCRAPER_TOKEN, tls)
        assert status == 200 and elapsed <= SCRAPE_WITHIN_S, (status, elapsed)
        took.append(elapsed)
        time.sleep(0.5)
    return took


def test_slow_clients_never_lock_a_scraper_out(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """32 connections trickling a request line, a byte every 2 s for 15 s: scrapes with the token answer
    200 within 2 s throughout, one without it 401; each slow connection is closed at the head deadline."""
    _node, port = _metrics_node(spawn, tmp_path)
    wait_until(lambda: _scrape(port, SCRAPER_TOKEN)[0] == 200, 30, "the metrics port serving")
    slow = SlowClients(port, SLOW_CLIENTS, SLOW_BYTE_EVERY_S, SLOW_FOR_S)
    status, elapsed = _scrape(port, None)
    assert status == 401 and elapsed <= SCRAPE_WITHIN_S, (status, elapsed)
    took = _scrapes_stay_served(port, slow)
    slow.join()
    assert len(took) >= 10
    assert all(s is not None and s <= HEAD_DEADLINE_S + SLOW_BYTE_EVERY_S + 1 for s in slow.lived_s), slow.lived_s
    assert _refused(port, "deadline") >= SLOW_CLIENTS


def test_a_flood_of_silent_connections_evicts_the_oldest(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Past ``CONNECTIONS_MAX``, each new connection closes the oldest one still silent: with 200 silent
    connections open, a scrape is answered within 2 s and the evictions are counted."""
    _node, port = _metrics_node(spawn, tmp_path)
    wait_until(lambda: _scrape(port, SCRAPER_TOKEN)[0] == 200, 30, "the metrics port serving")
    silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
    try:
        status, elapsed = _scrape(port, SCRAPER_TOKEN)
        assert status == 200 and elapsed <= SCRAPE_WITHIN_S, (status, elapsed)
        assert _refused(port, "evicted") >= 200 - CONNECTIONS_MAX
    finally:
        for sock in silent:
            sock.close()


@pytest.fixture
def tls_node(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> tuple[int, ssl.SSLContext]:
    ca = CA.create(tmp_path, "ca")
    server = ca.issue("server", client=False)
    _node, port = _metrics_node(spawn, tmp_path, credentials=grpc.ssl_channel_credentials(Path(ca.cert).read_bytes()),
                                config={"node.metrics_tls": True, "tls.cert_file": server.cert, "tls.key_file": server.key,
                                        "replication.listen": f"127.0.0.1:{free_port()}"})
    return port, ssl.create_default_context(cafile=ca.cert)


def test_unfinished_tls_handshakes_are_closed_at_the_deadline(tls_node: tuple[int, ssl.SSLContext]) -> None:
    """32 TCP connections to the TLS port that never send a ClientHello: a scrape over TLS answers within
    2 s meanwhile, and each silent connection is closed at the head deadline."""
    port, ctx = tls_node
    wait_until(lambda: _scrape(port, SCRAPER_TOKEN, ctx)[0] == 200, 30, "the TLS metrics port serving")
    silent = [socket.create_connection(("127.0.0.1", port), timeout=HEAD_DEADLINE_S + 5) for _ in range(SLOW_CLIENTS)]
    t0 = time.monotonic()
    status, elapsed = _scrape(port, SCRAPER_TOKEN, ctx)
    assert status == 200 and elapsed <= SCRAPE_WITHIN_S, (status, elapsed)
    for sock in silent:
        with sock, contextlib.suppress(ConnectionResetError):  # closed: an end of file, or a reset
            assert sock.recv(1) == b""
    assert time.monotonic() - t0 <= HEAD_DEADLINE_S + 1.5


def test_slow_clients_over_tls_never_lock_a_scraper_out(tls_node: tuple[int, ssl.SSLContext]) -> None:
    """The same trickle after a finished handshake: the deadline counts from the connection, handshake included."""
    port, ctx = tls_node
    wait_until(lambda: _scrape(port, SCRAPER_TOKEN, ctx)[0] == 200, 30, "the TLS metrics port serving")
    slow = SlowClients(port, SLOW_CLIENTS, SLOW_BYTE_EVERY_S, HEAD_DEADLINE_S + 4, ctx)
    _scrapes_stay_served(port, slow, ctx)
    slow.join()
    assert all(s is not None and s <= HEAD_DEADLINE_S + SLOW_BYTE_EVERY_S + 1 for s in slow.lived_s), slow.lived_s


def test_the_token_is_checked_first_and_a_body_is_refused_unread(spawn: Callable[..., DaemonProcess],
                                                                   tmp_path: Path) -> None:
    """Without a token: 401 even with a body announced; with it, a body (Content-Length, chunked) is refused
    at once (the body never sent), and a head past the bound is refused with 431."""
    _node, port = _metrics_node(spawn, tmp_path)
    wait_until(lambda: _scrape(port, SCRAPER_TOKEN)[0] == 200, 30, "the metrics port serving")
    auth = f"Authorization: Bearer {SCRAPER_TOKEN}\r\n"
    assert _ask(port, b"GET /metrics HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n")[0] == 401
    assert _ask(port, f"GET /metrics HTTP/1.1\r\n{auth}Content-Length: 1000000\r\n\r\n".encode())[0] == 413
    assert _ask(port, f"GET /metrics HTTP/1.1\r\n{auth}Transfer-Encoding: chunked\r\n\r\n".encode())[0] == 413
    assert _ask(port, f"GET /metrics HTTP/1.1\r\n{auth}Content-Length: 0\r\n\r\n".encode())[0] == 200
    assert _ask(port, f"GET /metrics HTTP/1.1\r\n{auth}X-Pad: {'p' * 20000}\r\n\r\n".encode())[0] == 431
    assert _ask(port, f"GET /nothing HTTP/1.1\r\n{auth}\r\n".encode())[0] == 404
    assert _ask(port, b"GET /nothing HTTP/1.1\r\n\r\n")[0] == 401
