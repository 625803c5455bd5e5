"""A loopback TCP proxy whose link a test can cut and heal (for replication and failover tests).

``cut()`` resets every connection and refuses new ones (a process that died); ``silence()``
keeps connections open but drops every byte, and takes new connections without ever connecting
them (a network partition: the peer learns nothing until its own timeouts fire); ``delay_s`` holds
each chunk that long (a slow link)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(16)
        self.port = self._server.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._open = threading.Event()
        self._open.set()
        self.silent = False
        self.delay_s = 0.0  # a slow link: each chunk is held this long before it is forwarded
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if not self._open.is_set():
                client.close()
                continue
            if self.silent:
                with self._lock:
                    self._conns.append(client)
                threading.Thread(target=self._drain, args=(client,), daemon=True).start()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            ends = [2]  # pumps of this pair still running: the last one closes both sockets
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump_then_close, args=(a, b, ends), daemon=True).start()

    def _pump_then_close(self, src: socket.socket, dst: socket.socket, ends: list[int]) -> None:
        self._pump(src, dst)
        with self._lock:
            ends[0] -= 1
            if ends[0]:
                return
        self._forget(src, dst)

    def _forget(self, *socks: socket.socket) -> None:
        """Close connections that ended (their descriptors would pile up over a long run)."""
        with self._lock:
            self._conns = [c for c in self._conns if all(c is not s for s in socks)]
        for s in socks:
            s.close()  # a second close (by cut) of a Python socket is a no-op

    def _drain(self, src: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while src.recv(65536):
                pass
        self._forget(src)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if self.delay_s:
                    time.sleep(self.delay_s)
                if not self.silent:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        """Drop every connection and refuse new ones."""
        self._open.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def silence(self) -> None:
        """Drop every byte from now on, on open and new connections alike, without closing any."""
        self.silent = True

    def heal(self) -> None:
        """Back to normal. Connections that were silenced stay broken (bytes were lost), as TCP
        after a long partition: they are reset, so both ends reconnect."""
        if self.silent:
            self.silent = False
            self.cut()
        self._open.set()

    def close(self) -> None:
        self.cut()
        self._server.close()
