"""Configuration: defaults < TOML file < ``TIDEMARK_SECTION__KEY`` environment < command-line flags.

Every key, its default and unit are documented in ``deploy/tidemark.toml``; ``KEYS`` below is the
single source of truth for names, types and bounds. Errors name the key and the reason.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Key:
    default: Any
    kind: type
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    reloadable: bool = False


KEYS: dict[str, Key] = {
    "node.data_dir": Key("./tidemark-data", str),
    "node.listen": Key("127.0.0.1:7600", str),
    # auto: the coordinator's election decides (DESIGN §11); without coordinator.endpoints it means master
    "node.role": Key("auto", str, choices=("auto", "master", "slave")),
    "node.master": Key("", str),
    "node.metrics_listen": Key("", str),
    "node.metrics_tls": Key(False, bool),   # /metrics over TLS (tls.cert_file; client certs with tls.client_ca_file)
    "node.metrics_auth": Key(False, bool),  # /metrics needs a bearer token with the metrics role
    "node.cluster_id": Key("", str),
    "node.node_id": Key("", str),
    "commitlog.segment_bytes": Key(GiB, int, minimum=64 * 1024, maximum=1 << 40),
    "commitlog.flush_interval_ms": Key(5, int, minimum=1, maximum=60_000),
    # synced log bytes further than this below the log's end leave the page cache (0: the kernel decides)
    "commitlog.cache_window_bytes": Key(GiB, int, minimum=0, maximum=1 << 40),
    "checkpoint.interval_ms": Key(1000, int, minimum=10, maximum=3_600_000),
    "offsets.flush_interval_ms": Key(100, int, minimum=1, maximum=60_000),
    "offsets.buffer_entries_max": Key(10_000, int, minimum=1, maximum=10_000_000),
    "storage.min_free_bytes": Key(64 * MiB, int, minimum=0, reloadable=True),
    "retention.local_bytes": Key(0, int, minimum=0, reloadable=True),
    "retention.local_ms": Key(0, int, minimum=0, reloadable=True),
    "retention.check_interval_ms": Key(10_000, int, minimum=10, maximum=3_600_000),
    "replication.min_insync_replicas": Key(1, int, minimum=1, maximum=2),
    "replication.listen": Key("", str),
    "replication.advertise": Key("", str),
    "replication.max_lag_bytes": Key(256 * MiB, int, minimum=1),
    "replication.max_lag_ms": Key(5000, int, minimum=10, maximum=3_600_000),
    "replication.chunk_bytes": Key(1 * MiB, int, minimum=64 * 1024, maximum=64 * MiB),
    "replication.window_bytes": Key(16 * MiB, int, minimum=64 * 1024, maximum=1 * GiB),
    "replication.reconnect_backoff_ms_max": Key(2000, int, minimum=10, maximum=60_000),
    # tiered storage (issue 5): off until a posix root or an s3 bucket is configured
    "tieredstore.backend": Key("posix", str, choices=("posix", "s3", "none")),
    "tieredstore.root": Key("", str),
    "tieredstore.s3_endpoint": Key("", str),
    "tieredstore.s3_bucket": Key("", str),
    "tieredstore.s3_prefix": Key("tidemark/", str),
    "tieredstore.s3_region": Key("", str),
    "tieredstore.s3_access_key_id": Key("", str),
    "tieredstore.s3_secret_access_key": Key("", str),
    "tieredstore.s3_retries_max": Key(5, int, minimum=0, maximum=20),
    "tieredstore.object_bytes": Key(64 * MiB, int, minimum=4096, maximum=1 * GiB),
    "tieredstore.upload_interval_ms": Key(1000, int, minimum=10, maximum=3_600_000),
    "tieredstore.retention_ms": Key(0, int, minimum=0),
    "tieredstore.read_cache_bytes": Key(128 * MiB, int, minimum=0, maximum=64 * GiB),
    "limits.request_bytes_max": Key(64 * MiB, int, minimum=64 * 1024, maximum=1 * GiB),
    "limits.pull_wait_ms_max": Key(30_000, int, minimum=0, maximum=600_000, reloadable=True),
    "limits.pull_messages_max": Key(100_000, int, minimum=1, maximum=10_000_000, reloadable=True),
    "limits.pull_bytes_max": Key(16 * MiB, int, minimum=1024, maximum=1 * GiB, reloadable=True),
    "limits.pull_decoded_messages_max": Key(10_000, int, minimum=1, maximum=1_000_000, reloadable=True),
    "limits.parked_waits_max": Key(100_000, int, minimum=1, maximum=10_000_000, reloadable=True),
    "limits.queues_max": Key(250_000, int, minimum=1, maximum=100_000_000),
    "limits.commit_offsets_max": Key(10_000, int, minimum=1, maximum=1_000_000),
    "limits.send_timeout_ms": Key(10_000, int, minimum=1, maximum=600_000, reloadable=True),
    "limits.grpc_workers": Key(16, int, minimum=1, maximum=256),
    "limits.open_files_max": Key(1024, int, minimum=64, maximum=1 << 20),
    "timer.precision_ms": Key(100, int, minimum=1, maximum=60_000),
    "timer.max_delay_ms": Key(30 * 24 * 3600 * 1000, int, minimum=1, maximum=10 * 365 * 24 * 3600 * 1000),
    "timer.wheel_slots": Key(1 << 18, int, minimum=64, maximum=1 << 24),
    "timer.snapshot_enabled": Key(True, bool),
    "timer.snapshot_interval_ms": Key(10_000, int, minimum=10, maximum=3_600_000),
    "timer.snapshot_keep": Key(2, int, minimum=1, maximum=100),
    "timer.log_segment_bytes": Key(64 * MiB, int, minimum=64 * 1024, maximum=1 << 40),
    "timer.fire_batch_max": Key(10_000, int, minimum=1, maximum=1_000_000),
    "log.level": Key("info", str, choices=("debug", "info", "warning", "error"), reloadable=True),
    "log.format": Key("console", str, choices=("console", "json")),
    # -- security (issue 7; docs/operations.md) ------------------------------------------------
    "tls.cert_file": Key("", str),
    "tls.key_file": Key("", str),
    "tls.client_ca_file": Key("", str),
    "auth.token_file": Key("", str),
    "auth.tokens_file": Key("", str),
    "auth.require_for_reads": Key(False, bool),
    "security.insecure_network": Key(False, bool),
    # -- automatic failover on etcd (DESIGN §11) ------------------------------------------------
    "coordinator.endpoints": Key((), tuple),
    "coordinator.cluster": Key("tidemark", str),
    # this pair's shard in the cluster (DESIGN §15); "" = a one-pair cluster, its keys as before shards
    "coordinator.shard": Key("", str),
    "coordinator.lease_ttl_ms": Key(2000, int, minimum=2000, maximum=600_000),
    # queue moves between shards under way at once, cluster-wide (docs/shards.md, "Moving a queue")
    "cluster.moves_max_in_flight": Key(4, int, minimum=1, maximum=1000),
    "coordinator.advertise": Key("", str),
    "coordinator.unclean_election": Key(False, bool),
    "coordinator.request_timeout_ms": Key(0, int, minimum=0, maximum=60_000),
    "coordinator.tls_ca_file": Key("", str),
    "coordinator.tls_cert_file": Key("", str),
    "coordinator.tls_key_file": Key("", str),
    "coordinator.tls_server_name": Key("", str),
    "coordinator.username": Key("", str),
    "coordinator.password_file": Key("", str),
    "replication.tls_cert_file": Key("", str),
    "replication.tls_key_file": Key("", str),
    "replication.tls_ca_file": Key("", str),
    "replication.tls_server_name": Key("", str),
    # -- consumer groups (DESIGN §12) -----------------------------------------------------------
    "groups.session_timeout_ms": Key(10_000, int, minimum=500, maximum=600_000),
    "groups.heartbeat_interval_ms": Key(3000, int, minimum=50, maximum=60_000),
    "groups.rejoin_grace_ms": Key(3000, int, minimum=0, maximum=600_000),
    "groups.members_max": Key(10_000, int, minimum=1, maximum=1_000_000),
    "groups.live_groups_max": Key(10_000, int, minimum=1, maximum=1_000_000),
    "groups.members_total_max": Key(100_000, int, minimum=1, maximum=10_000_000),
    "groups.committed_groups_max": Key(100_000, int, minimum=1, maximum=100_000_000),
    "groups.max_deliveries": Key(16, int, minimum=1, maximum=10_000),
    "groups.invisible_ms_max": Key(12 * 3600 * 1000, int, minimum=1000, maximum=7 * 24 * 3600 * 1000),
    "groups.pop_messages_max": Key(10_000, int, minimum=1, maximum=1_000_000),
    "groups.pop_window_max": Key(1_000_000, int, minimum=1000, maximum=100_000_000),
    "transactions.timeout_ms": Key(60_000, int, minimum=100, maximum=900_000),
    "transactions.max_timeout_ms": Key(900_000, int, minimum=100, maximum=24 * 3600 * 1000),
    "transactions.check_interval_ms": Key(5_000, int, minimum=50, maximum=600_000),
    "transactions.check_max": Key(15, int, minimum=0, maximum=1000),
    "transactions.open_max": Key(10_000, int, minimum=1, maximum=1_000_000, reloadable=True),
}

ENV_PREFIX = "TIDEMARK_"
_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}


class ConfigError(Exception):
    """Invalid configuration; ``str()`` is one line naming the key."""


def _coerce(name: str, key: Key, value: Any) -> Any:
    if key.kind is tuple:  # a list of strings; from the environment or a flag: comma-separated
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: expected a list of strings, got {value!r}")
        return tuple(value)
    if key.kind is bool:
        if isinstance(value, str) and value.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.lower()]
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: expected true or false, got {value!r}")
        return value
    if key.kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if isinstance(value, str):
            try:
                value = int(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"{name}: expected an integer, got {value!r}") from None
        if not isinstance(value, int):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if key.minimum is not None and value < key.minimum:
            raise ConfigError(f"{name}: {value} is below the minimum {key.minimum}")
        if key.maximum is not None and value > key.maximum:
            raise ConfigError(f"{name}: {value} is above the maximum {key.maximum}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    if key.choices and value not in key.choices:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(key.choices)}")
    return value


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in data.items():
        full = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, full + "."))
        else:
            out[full] = v
    return out


class Config:
    """Validated settings; read with ``config["section.key"]``."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._values = dict(values)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def as_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def differences(self, other: Config) -> dict[str, tuple[Any, Any]]:
        """``{name: (ours, theirs)}`` for every key whose value differs."""
        return {k: (v, other._values[k]) for k, v in self._values.items() if other._values[k] != v}

    def update_reloadable(self, other: Config) -> dict[str, tuple[Any, Any]]:
        """Take ``other``'s values of the reloadable keys (SIGHUP); returns what changed.

        Only reloadable keys may differ (the caller checks): readers look keys up on every use,
        so the new values apply from the next request on.
        """
        changed = self.differences(other)
        fixed = sorted(k for k in changed if not KEYS[k].reloadable)
        if fixed:
            raise ConfigError(f"{fixed[0]}: changed, but it needs a restart to take effect")
        for k, (_, new) in changed.items():
            self._values[k] = new
        return changed

    @classmethod
    def build(
        cls,
        file_values: Mapping[str, Any] | None = None,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Config:
        values = {name: key.default for name, key in KEYS.items()}
        layers: list[Mapping[str, Any]] = [_flatten(file_values or {})]
        env = os.environ if environ is None else environ
        layers.append(
            {k[len(ENV_PREFIX):].lower().replace("__", "."): v for k, v in env.items()
             if k.startswith(ENV_PREFIX) and "__" in k}
        )
        layers.append({k: v for k, v in (overrides or {}).items() if v is not None})
        for layer in layers:
            for name, value in layer.items():
                key = KEYS.get(name)
                if key is None:
                    raise ConfigError(f"{name}: unknown key")
                values[name] = _coerce(name, key, value)
        _check_address("node.listen", values["node.listen"])
        for addr_key in ("node.metrics_listen", "replication.listen", "replication.advertise", "node.master",
                         "coordinator.advertise"):
            if values[addr_key]:
                _check_address(addr_key, values[addr_key])
        _check_roles(values)
        _check_security(values)
        if values["tieredstore.backend"] == "s3" and not values["tieredstore.s3_bucket"]:
            raise ConfigError("tieredstore.s3_bucket: required when tieredstore.backend is s3")
        return cls(values)

    @classmethod
    def load(cls, path: str | None, overrides: Mapping[str, Any] | None = None) -> Config:
        file_values: dict[str, Any] = {}
        if path:
            try:
                with open(path, "rb") as f:
                    file_values = tomllib.load(f)
            except OSError as exc:
                raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        return cls.build(file_values, overrides)


def tiering_enabled(config: Config) -> bool:
    """Tiered storage is on with backend s3, or backend posix and a root directory."""
    backend = config["tieredstore.backend"]
    return backend == "s3" or (backend == "posix" and bool(config["tieredstore.root"]))


# What a setting needs beyond ``[project].dependencies``: (key, value) -> (module, extra).
EXTRAS_NEEDED = {("tieredstore.backend", "s3"): ("boto3", "s3")}


def missing_extras(config: Config) -> list[str]:
    """One line per setting whose optional package is not installed (found, never imported)."""
    missing = []
    for (key, value), (module, extra) in EXTRAS_NEEDED.items():
        if config[key] == value and importlib.util.find_spec(module) is None:
            missing.append(f"{key} = {value!r} needs {module}, which is not installed: pip install 'tidemark[{extra}]'")
    return missing


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{name}: {value!r} is not HOST:PORT")


CLUSTER_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")


def _check_roles(values: dict[str, Any]) -> None:
    """``auto`` is the election with a coordinator and a master without one; with a coordinator
    no fixed role is accepted (a node that makes itself master beside the elected one would be a
    second master)."""
    endpoints = values["coordinator.endpoints"]
    if not endpoints:
        if values["node.role"] == "auto":
            values["node.role"] = "master"
        if values["node.role"] == "slave" and not values["node.master"]:
            raise ConfigError("node.master: required when node.role is slave")
        return
    if values["node.role"] != "auto":
        raise ConfigError(f"node.role: {values['node.role']!r} with coordinator.endpoints set; the election decides "
                          "(use auto, or clear coordinator.endpoints for manual roles)")
    if values["node.master"]:
        raise ConfigError("node.master: not used with coordinator.endpoints (the elected master is in etcd); remove it")
    for endpoint in endpoints:
        scheme, sep, rest = endpoint.partition("://")
        if not sep or scheme not in ("http", "https"):
            raise ConfigError(f"coordinator.endpoints: {endpoint!r} is not http://HOST:PORT or https://HOST:PORT")
        _check_address("coordinator.endpoints", rest.rstrip("/"))
    schemes = {e.partition("://")[0] for e in endpoints}
    if len(schemes) > 1:
        raise ConfigError("coordinator.endpoints: mixes http and https; use one scheme for every endpoint")
    if "https" in schemes and not values["coordinator.tls_ca_file"]:
        raise ConfigError("coordinator.tls_ca_file: required with https endpoints")
    if values["coordinator.tls_ca_file"] and "https" not in schemes:
        raise ConfigError("coordinator.endpoints: coordinator.tls_ca_file is set but the endpoints are http://")
    if bool(values["coordinator.tls_cert_file"]) != bool(values["coordinator.tls_key_file"]):
        missing = "coordinator.tls_key_file" if values["coordinator.tls_cert_file"] else "coordinator.tls_cert_file"
        raise ConfigError(f"{missing}: required for a client certificate to etcd (the other half is set)")
    if bool(values["coordinator.username"]) != bool(values["coordinator.password_file"]):
        missing = "coordinator.password_file" if values["coordinator.username"] else "coordinator.username"
        raise ConfigError(f"{missing}: etcd authentication needs both coordinator.username and coordinator.password_file")
    cluster = values["coordinator.cluster"]
    if not cluster or not set(cluster) <= CLUSTER_NAME_CHARS or len(cluster) > 100:
        raise ConfigError(f"coordinator.cluster: {cluster[:100]!r} must be 1-100 letters, digits, '-', '_' or '.'")
    shard = values["coordinator.shard"]
    if shard and (not set(shard) <= CLUSTER_NAME_CHARS or len(shard) > 64 or shard in (".", "..")):
        raise ConfigError(f"coordinator.shard: {shard[:100]!r} must be 1-64 letters, digits, '-', '_' or '.' "
                          "(or empty: a one-pair cluster)")
    if values["coordinator.lease_ttl_ms"] % 1000:
        raise ConfigError(f"coordinator.lease_ttl_ms: {values['coordinator.lease_ttl_ms']} is not whole seconds "
                          "(etcd leases are granted in seconds)")


_TLS_GROUPS = {
    "tls": ("tls.cert_file", "tls.key_file"),
    "replication mutual TLS": ("replication.tls_cert_file", "replication.tls_key_file", "replication.tls_ca_file"),
}


def _check_security(values: Mapping[str, Any]) -> None:
    """TLS keys come in complete groups; mutual TLS for replication needs its own port."""
    for what, names in _TLS_GROUPS.items():
        given = [n for n in names if values[n]]
        if given and len(given) < len(names):
            missing = next(n for n in names if not values[n])
            raise ConfigError(f"{missing}: required for {what} (because {given[0]} is set)")
    if values["tls.client_ca_file"] and not values["tls.cert_file"]:
        raise ConfigError("tls.cert_file: required when tls.client_ca_file is set (client certificates need TLS)")
    if (values["replication.tls_cert_file"] or values["tls.cert_file"]) and not values["replication.listen"]:
        raise ConfigError("replication.listen: required with TLS (replication gets its own port, with mutual TLS "
                          "when replication.tls_* are set)")
    if values["auth.require_for_reads"] and not (values["auth.token_file"] or values["auth.tokens_file"]):
        raise ConfigError("auth.tokens_file: required when auth.require_for_reads is true")
    if values["node.metrics_tls"] and not values["tls.cert_file"]:
        raise ConfigError("tls.cert_file: required when node.metrics_tls is true (the metrics port uses its certificate)")
    if values["coordinator.shard"] and values["auth.token_file"] and not values["auth.tokens_file"]:
        raise ConfigError("auth.tokens_file: required in a cluster of shards with tokens (its nodes call each other "
                          "with a token of the replication role; auth.token_file's has none)")
    if values["node.metrics_auth"] and not values["auth.tokens_file"]:
        raise ConfigError("auth.tokens_file: required when node.metrics_auth is true (a token with the metrics role)")
    _check_exposure(values)


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT listens on loopback only (a name other than localhost counts as exposed)."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure_exposures(values: Mapping[str, Any]) -> list[str]:
    """The listen keys serving a non-loopback address with nothing to protect them (DESIGN §10)."""
    tokens = bool(values["auth.token_file"] or values["auth.tokens_file"])
    client_certificates = bool(values["tls.cert_file"] and values["tls.client_ca_file"])  # TLS alone authenticates nobody
    out = []
    if not is_loopback(values["node.listen"]) and not (tokens or client_certificates):
        out.append("node.listen")
    repl = values["replication.listen"]
    if repl and not is_loopback(repl) and not (values["replication.tls_cert_file"] or values["auth.tokens_file"]):
        out.append("replication.listen")
    return out


def _check_exposure(values: Mapping[str, Any]) -> None:
    """Protected mode: a non-loopback port needs TLS or tokens, unless the operator says otherwise."""
    exposed = insecure_exposures(values)
    if exposed and not values["security.insecure_network"]:
        name = exposed[0]
        fix = ("auth.tokens_file, or client certificates (tls.cert_file, tls.key_file, tls.client_ca_file)"
               if name == "node.listen"
               else "replication.tls_cert_file, replication.tls_key_file and replication.tls_ca_file, or auth.tokens_file")
        raise ConfigError(f"{name}: {values[name]} is not a loopback address and nothing protects it: set {fix} "
                          "(or security.insecure_network = true to serve it unprotected)")
