"""Configuration added for running it for real: booleans, TLS key groups, what a reload may change."""

from __future__ import annotations

import re

import pytest

from broker.config import KEYS, Config, ConfigError


@pytest.mark.parametrize(("raw", "value"), [("true", True), ("FALSE", False), ("1", True), ("no", False)])
def test_booleans_from_the_environment(raw: str, value: bool) -> None:
    """TIDEMARK_AUTH__REQUIRE_FOR_READS accepts true/false/1/0/yes/no (any case)."""
    env = {"TIDEMARK_AUTH__TOKEN_FILE": "/t", "TIDEMARK_AUTH__REQUIRE_FOR_READS": raw}
    assert Config.build(environ=env)["auth.require_for_reads"] is value


def test_a_bad_boolean_names_the_key() -> None:
    """Anything else is an error naming the key; TOML must give a real boolean, not 1."""
    with pytest.raises(ConfigError, match=re.escape("auth.require_for_reads: expected true or false")):
        Config.build(environ={"TIDEMARK_AUTH__REQUIRE_FOR_READS": "maybe"})
    with pytest.raises(ConfigError, match=re.escape("auth.require_for_reads: expected true or false")):
        Config.build({"auth": {"require_for_reads": 1}}, environ={})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"cert_file": "c"}, "replication": {"listen": "h:1"}}, "tls.key_file: required for tls"),
        ({"tls": {"client_ca_file": "ca"}}, "tls.cert_file: required when tls.client_ca_file"),
        ({"tls": {"cert_file": "c", "key_file": "k"}}, "replication.listen: required with TLS"),
        ({"replication": {"listen": "h:1", "tls_cert_file": "c", "tls_key_file": "k"}},
         "replication.tls_ca_file: required for replication mutual TLS"),
        ({"auth": {"require_for_reads": True}}, "auth.tokens_file: required when auth.require_for_reads"),
    ],
)
def test_incomplete_security_settings(values: dict[str, object], message: str) -> None:
    """TLS keys come in complete groups, with a separate replication port; reads need a token to require."""
    with pytest.raises(ConfigError, match=message):
        Config.build(values, environ={})


def test_update_reloadable_applies_only_reloadable_keys() -> None:
    """A reload takes new limits in place (readers see them) but refuses a restart-only key."""
    running = Config.build({"limits": {"pull_messages_max": 10}}, environ={})
    changed = running.update_reloadable(Config.build({"limits": {"pull_messages_max": 5}}, environ={}))
    assert changed == {"limits.pull_messages_max": (10, 5)} and running["limits.pull_messages_max"] == 5
    with pytest.raises(ConfigError, match=re.escape("commitlog.segment_bytes: changed, but it needs a restart")):
        running.update_reloadable(Config.build({"commitlog": {"segment_bytes": 1 << 20}}, environ={}))
    assert running["commitlog.segment_bytes"] == KEYS["commitlog.segment_bytes"].default


def test_security_keys_need_a_restart() -> None:
    """No TLS or auth key is reloadable (certificates are read at start; the token *file* is re-read)."""
    assert not any(KEYS[k].reloadable for k in KEYS if k.startswith(("tls.", "auth.", "replication.tls_")))
