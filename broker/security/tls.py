"""TLS credentials from the configured PEM files (client port ``tls.*``, replication ``replication.tls_*``).

Files are read once at start (a changed certificate needs a restart); a missing or unreadable
file is a configuration error naming its key, so ``tidemark config check`` reports it too.
"""

from __future__ import annotations

from typing import Any

import grpc

from broker.config import Config, ConfigError
from broker.invariant import StartupRefused


def read_pem(config: Config, key: str) -> bytes:
    path = config[key]
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{key}: {path} is not a PEM file")
    return data


def client_port_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS for the client port, requiring client certificates when ``tls.client_ca_file`` is set."""
    if not config["tls.cert_file"]:
        return None
    pair = (read_pem(config, "tls.key_file"), read_pem(config, "tls.cert_file"))
    client_ca = read_pem(config, "tls.client_ca_file") if config["tls.client_ca_file"] else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def replication_server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """Mutual TLS for the replication port: only slaves whose certificate ``replication.tls_ca_file`` signed."""
    if not config["replication.tls_cert_file"]:
        return None
    pair = (read_pem(config, "replication.tls_key_file"), read_pem(config, "replication.tls_cert_file"))
    return grpc.ssl_server_credentials([pair], root_certificates=read_pem(config, "replication.tls_ca_file"),
                                       require_client_auth=True)


def replication_channel_credentials(config: Config) -> grpc.ChannelCredentials | None:
    """The slave's side: present our certificate, accept only a master that the same CA signed."""
    if not config["replication.tls_cert_file"]:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(config, "replication.tls_ca_file"),
        private_key=read_pem(config, "replication.tls_key_file"),
        certificate_chain=read_pem(config, "replication.tls_cert_file"),
    )


def listen_on(server: Any, key: str, address: str, credentials: grpc.ServerCredentials | None) -> None:
    """Bind a gRPC server (thread-pool or asyncio) to ``address``, with TLS when ``credentials``;
    a port that cannot be bound refuses the start in one line naming ``key``."""
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise StartupRefused(f"{key}: cannot listen on {address}")


def check_files(config: Config) -> None:
    """Read every configured certificate and key file (``config check`` and start-up)."""
    for key in ("tls.cert_file", "tls.key_file", "tls.client_ca_file", "replication.tls_cert_file",
                "replication.tls_key_file", "replication.tls_ca_file"):
        if config[key]:
            read_pem(config, key)
