"""The test proxy (tests/tcpproxy.py) closes connections that ended: a 30-minute chaos run opens
tens of thousands through its S3, etcd and replication proxies, and the harness process ran out of
file descriptors when they were only shut down, never closed."""

from __future__ import annotations

import os
import socket
import threading

from tests.tcpproxy import TcpProxy
from tests.waits import wait_until


def _echo_server() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_ended_connections_release_their_descriptors() -> None:
    server = _echo_server()
    proxy = TcpProxy(server.getsockname()[1])
    try:
        before = len(os.listdir("/proc/self/fd"))
        for i in range(200):
            with socket.create_connection(("127.0.0.1", proxy.port)) as c:
                c.sendall(b"ping %d" % i)
                assert c.recv(64) == b"ping %d" % i
        wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before + 4, 10,
                   "the proxy's descriptors of ended connections closed",
                   observe=lambda: (len(os.listdir("/proc/self/fd")), before))
        proxy.silence()
        for _ in range(50):  # silenced: taken, drained, never connected upstream
            socket.create_connection(("127.0.0.1", proxy.port)).close()
        wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before + 4, 10, "the drained ones closed too",
                   observe=lambda: (len(os.listdir("/proc/self/fd")), before))
    finally:
        proxy.close()
        server.close()
