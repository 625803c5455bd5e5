"""Configuration: layering, validation errors naming the key, and the CLI's exit codes."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from broker.config import KEYS, Config, ConfigError, _flatten


def test_defaults_and_layers() -> None:
    """Defaults < file < environment < flags."""
    cfg = Config.build(
        {"commitlog": {"flush_interval_ms": 7}, "offsets": {"flush_interval_ms": 50}},
        {"offsets.flush_interval_ms": 20},
        {"TIDEMARK_COMMITLOG__FLUSH_INTERVAL_MS": "9", "TIDEMARK_OFFSETS__FLUSH_INTERVAL_MS": "30"},
    )
    assert cfg["commitlog.flush_interval_ms"] == 9
    assert cfg["offsets.flush_interval_ms"] == 20
    assert cfg["commitlog.segment_bytes"] == 1 << 30


ETCD = {"endpoints": ["http://127.0.0.1:2379"]}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"commitlog": {"segment_bytes": "big"}}, "commitlog.segment_bytes: expected an integer"),
        ({"commitlog": {"flush_interval_ms": 0}}, "commitlog.flush_interval_ms: 0 is below the minimum"),
        ({"commitlog": {"nonsense": 1}}, "commitlog.nonsense: unknown key"),
        ({"log": {"format": "xml"}}, "log.format: 'xml' is not one of"),
        ({"node": {"listen": "nowhere"}}, "node.listen: 'nowhere' is not HOST:PORT"),
        ({"node": {"role": "slave"}}, "node.master: required"),
        ({"tieredstore": {"backend": "s3"}}, "tieredstore.s3_bucket: required"),
        ({"tieredstore": {"backend": "gcs"}}, "tieredstore.backend: 'gcs' is not one of"),
        ({"node": {"role": "master"}, "coordinator": {**ETCD}}, "node.role: 'master' with coordinator.endpoints set"),
        ({"node": {"master": "127.0.0.1:1"}, "coordinator": {**ETCD}}, "node.master: not used with coordinator.endpoints"),
        ({"coordinator": {"endpoints": ["127.0.0.1:2379"]}}, "coordinator.endpoints: '127.0.0.1:2379' is not http"),
        ({"coordinator": {"endpoints": ["https://127.0.0.1:2379"]}}, "coordinator.tls_ca_file: required"),
        ({"coordinator": {**ETCD, "username": "tm"}}, "coordinator.password_file: etcd authentication needs both"),
        ({"coordinator": {**ETCD, "cluster": "a/b"}}, "coordinator.cluster: 'a/b' must be"),
        ({"coordinator": {**ETCD, "shard": "s/1"}}, "coordinator.shard: 's/1' must be"),
        ({"coordinator": {**ETCD, "shard": ".."}}, "coordinator.shard: '..' must be"),
        ({"coordinator": {**ETCD, "lease_ttl_ms": 2500}}, "coordinator.lease_ttl_ms: 2500 is not whole seconds"),
        ({"coordinator": {**ETCD, "lease_ttl_ms": 1000}}, "coordinator.lease_ttl_ms: 1000 is below the minimum"),
    ],
)
def test_errors_name_the_key(values: dict[str, object], message: str) -> None:
    """Each invalid setting raises one message that starts with its key."""
    with pytest.raises(ConfigError, match=message):
        Config.build(values, environ={})


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], check=False, capture_output=True, text=True, timeout=60)


def test_config_check_cli(tmp_path: Path) -> None:
    """`tidemark config check`: 0 on a good file, 2 with one line naming the key otherwise."""
    good = tmp_path / "good.toml"
    good.write_text("[commitlog]\nflush_interval_ms = 10\n")
    assert _cli("config", "check", str(good)).returncode == 0
    bad = tmp_path / "bad.toml"
    bad.write_text("[retention]\nlocal_bytes = -5\n")
    r = _cli("config", "check", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "retention.local_bytes" in r.stderr
    broken = tmp_path / "broken.toml"
    broken.write_text("[commitlog\n")
    assert _cli("config", "check", str(broken)).returncode == 2


def test_serve_with_bad_flag_exits_2(tmp_path: Path) -> None:
    """A bad flag value stops the daemon before it touches the data directory."""
    r = _cli("serve", "--data-dir", str(tmp_path / "d"), "--listen", "localhost")
    assert r.returncode == 2 and "node.listen" in r.stderr
    assert not (tmp_path / "d").exists()


def test_deploy_toml_documents_every_key_with_its_default() -> None:
    """deploy/tidemark.toml lists exactly the keys the code knows, each with its default."""


    root = Path(__file__).resolve().parent.parent
    with open(root / "deploy" / "tidemark.toml", "rb") as f:
        documented = _flatten(tomllib.load(f))
    assert set(documented) == set(KEYS)
    def default(k: str) -> object:
        return list(KEYS[k].default) if isinstance(KEYS[k].default, tuple) else KEYS[k].default  # TOML has lists

    assert [k for k in KEYS if documented[k] != default(k)] == []
    assert _cli("config", "check", str(root / "deploy" / "tidemark.toml")).returncode == 0
