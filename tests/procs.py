"""Run ``tidemark serve`` as a real child process in tests and benchmarks.

``DaemonProcess`` is the demo's ``NodeProcess`` plus what tests need: a config file, extra
environment, TLS for the readiness check, exit codes and memory readings.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

import grpc

from broker.cli.node_process import NodeProcess, free_port

__all__ = ["ArgvDaemon", "DaemonProcess", "free_port"]


class DaemonProcess(NodeProcess):
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
        super().__init__(data_dir, port=port, config=config, log_path=log_path)
        self.env = dict(env or {})
        self.config_file = config_file
        self.credentials = credentials

    def command(self) -> list[str]:
        cmd = super().command()
        return [*cmd[:4], "--config", self.config_file, *cmd[4:]] if self.config_file else cmd

    def environment(self) -> dict[str, str]:
        return {**super().environment(), **self.env}

    def channel(self, options: list[tuple[str, int]]) -> grpc.Channel:
        if self.credentials is None:
            return super().channel(options)
        return grpc.secure_channel(self.address, self.credentials, options=options)

    def start(self, timeout_s: float = 30.0, *, wait: bool = True) -> DaemonProcess:
        super().start(timeout_s, wait=wait)
        return self

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


class ArgvDaemon(DaemonProcess):
    """A daemon started with exactly the arguments a documented line gives ``tidemark``
    (the README's runbooks, run as written)."""

    def __init__(self, argv: list[str], data_dir: str, port: int) -> None:
        super().__init__(data_dir, port=port)
        self.argv = argv

    def command(self) -> list[str]:
        return [sys.executable, "-m", "broker.cli", *self.argv]
