"""A ``tidemark serve`` child process, for ``tidemark demo`` (the tests extend it in tests/procs.py)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# "FIRST-LAST": the loopback ports free_port hands out. The tests give each of their workers a block
# of its own below the kernel's ephemeral range (tests/conftest.py): a port picked by bind(0) and
# released was taken meanwhile by the other worker's process, or by an outgoing connection's
# local end, before the daemon it was meant for bound it ("Address already in use").
PORT_BLOCK_ENV = "TIDEMARK_PORT_BLOCK"
_handed: set[int] = set()  # ports of the block this process handed out (not again until half are)
_handed_lock = threading.Lock()


def free_port() -> int:
    """A loopback port nothing listens on now: the kernel's pick, or one of ``PORT_BLOCK_ENV``'s."""
    block = os.environ.get(PORT_BLOCK_ENV)
    if not block:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    first, last = (int(p) for p in block.split("-", 1))
    with _handed_lock:
        if len(_handed) > (last - first) // 2:
            _handed.clear()
        for _ in range(4 * (last - first + 1)):
            port = random.randint(first, last)  # at random: sibling processes of one worker draw from it too
            if port in _handed:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed.add(port)
            return port
    raise RuntimeError(f"no free port in {PORT_BLOCK_ENV}={block}")


class NodeProcess:
    """One daemon on 127.0.0.1: ``start()`` returns once it serves gRPC health checks.

    ``config`` goes in as ``TIDEMARK_*`` environment; the log goes to ``log_path`` (default:
    ``<data_dir>.log`` beside the directory)."""

    def __init__(self, data_dir: str, *, port: int | None = None, config: Mapping[str, object] | None = None,
                 log_path: str | None = None) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.config = dict(config or {})
        self.log_path = log_path or os.path.join(os.path.dirname(os.path.abspath(data_dir)),
                                                 f"{os.path.basename(data_dir)}.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_seconds = 0.0

    def command(self) -> list[str]:
        return [sys.executable, "-m", "broker.cli", "serve", "--data-dir", self.data_dir, "--listen", self.address]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in self.config.items():
            env["TIDEMARK_" + key.upper().replace(".", "__")] = str(value)
        return env

    def channel(self, options: list[tuple[str, int]]) -> grpc.Channel:
        """The channel the readiness check uses (plaintext here)."""
        return grpc.insecure_channel(self.address, options=options)

    def start(self, timeout_s: float = 30.0, *, wait: bool = True) -> NodeProcess:
        t0 = time.monotonic()
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment())
        log.close()
        if wait:
            self.wait_ready(timeout_s)
            self.ready_seconds = time.monotonic() - t0
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        # short reconnect backoff: gRPC's default (1 s, x1.6) would report starts up to a second late
        options = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
                   ("grpc.max_reconnect_backoff_ms", 100)]
        with self.channel(options) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    code = self.proc.returncode if self.proc is not None else None
                    raise RuntimeError(f"daemon exited with {code}: {self.tail_log()}")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.02)  # between health probes of a starting process
        raise TimeoutError(f"daemon on {self.address} not ready after {timeout_s}s: {self.tail_log()}")

    def tail_log(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)
