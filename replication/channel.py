"""How a slave reaches its master: mutual TLS when ``replication.tls_*`` are set, plus its
replication token (the first token of ``auth.tokens_file`` with the ``replication`` role) on every
call. Used by the follower and the bootstrap."""

from __future__ import annotations

from typing import Any

import grpc

from broker.config import Config
from broker.security import auth, tls


def open_channel(config: Config, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
    creds = tls.replication_channel_credentials(config)
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    if config["replication.tls_server_name"]:  # the name the master's certificate carries, if not the address
        options = [*options, ("grpc.ssl_target_name_override", config["replication.tls_server_name"])]
    return grpc.secure_channel(address, creds, options=options)


def call_metadata(config: Config) -> tuple[tuple[str, str], ...]:
    return auth.call_metadata(config)
