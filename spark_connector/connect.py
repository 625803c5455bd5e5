"""Opening a broker connection from the reader options (``tlsCaFile``, ``tokenFile``), in any process."""

from __future__ import annotations

from broker.client import BrokerClient
from broker.config import ConfigError
from broker.security.auth import read_token
from spark_connector.options import OptionError


def connect(brokers: tuple[str, ...], tls_ca_file: str | None, token_file: str | None) -> BrokerClient:
    try:
        token = read_token(token_file, "tokenFile") if token_file else None
    except ConfigError as exc:
        raise OptionError("tokenFile", str(exc).removeprefix("tokenFile: ")) from None
    try:
        return BrokerClient(list(brokers), tls_ca_file=tls_ca_file, token=token)
    except OSError as exc:
        raise OptionError("tlsCaFile", f"cannot read {tls_ca_file}: {exc.strerror}") from None
