"""Run ``tidemark serve`` as a real child process (demo, tests, benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DaemonProcess:
    """One daemon: ``start()`` returns once it serves gRPC health checks."""

    def __init__(
        self,
        data_dir: str,
        *,
        port: int | None = None,
        config: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        config_file: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        """``config`` goes in as ``TIDEMARK_*`` environment; ``config_file`` as ``--config``;
        ``credentials`` (TLS on the client port) are what the readiness check connects with."""
        self.data_dir = data_dir
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.config = dict(config or {})
        self.env = dict(env or {})
        self.log_path = log_path or os.path.join(os.path.dirname(os.path.abspath(data_dir)),
                                                 f"{os.path.basename(data_dir)}.log")
        self.config_file = config_file
        self.credentials = credentials
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_seconds = 0.0

    def command(self) -> list[str]:
        config = ["--config", self.config_file] if self.config_file else []
        return [sys.executable, "-m", "broker.cli", "serve", *config, "--data-dir", self.data_dir, "--listen", self.address]

    def start(self, timeout_s: float = 30.0, *, wait: bool = True) -> DaemonProcess:
        env = dict(os.environ)
        for key, value in self.config.items():
            env["TIDEMARK_" + key.upper().replace(".", "__")] = str(value)
        env.update(self.env)
        t0 = time.monotonic()
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
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
        with (grpc.secure_channel(self.address, self.credentials, options=options) if self.credentials
              else grpc.insecure_channel(self.address, options=options)) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.tail_log()}")
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.02)
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

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return int(self.proc.wait(timeout_s))

    def rss_anon_bytes(self) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0
