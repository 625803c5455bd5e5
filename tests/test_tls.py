"""TLS on the client port, mutual TLS on the replication port, bearer tokens: real daemons on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from broker.client import BrokerClient, BrokerError, Message
from broker.security.auth import ALWAYS_OPEN, READ_ONLY
from proto import tidemark_pb2 as pb
from tests.certs import CA, Leaf
from tests.procs import DaemonProcess, free_port
from tests.waits import wait_until

Spawn = Callable[..., DaemonProcess]
TOKEN = "t0ken-" + "a1b2c3d4e5f6a7b8c9d0"
WRONG = "wr0ng-" + "a1b2c3d4e5f6a7b8c9d0"


@dataclass(frozen=True)
class PKI:
    ca: CA
    rogue: CA  # another CA: what it signs must be refused
    server: Leaf
    client: Leaf
    rogue_client: Leaf
    master_repl: Leaf
    slave_repl: Leaf
    rogue_slave: Leaf


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = CA.create(d, "ca"), CA.create(d, "rogue")
    return PKI(ca, rogue, ca.issue("server", client=False), ca.issue("client", server=False),
               rogue.issue("rogue-client", server=False), ca.issue("master-repl"), ca.issue("slave-repl"),
               rogue.issue("rogue-slave"))


def _creds(ca: CA, leaf: Leaf | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        Path(ca.cert).read_bytes(), Path(leaf.key).read_bytes() if leaf else None,
        Path(leaf.cert).read_bytes() if leaf else None)


def _token_file(tmp_path: Path, value: str = TOKEN, name: str = "token") -> str:
    path = tmp_path / name
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


def _code(fn: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(BrokerError) as info:
        fn()
    return info.value.code


def _tls_config(pki: PKI, **extra: object) -> dict[str, object]:
    return {"tls.cert_file": pki.server.cert, "tls.key_file": pki.server.key,
            "replication.listen": f"127.0.0.1:{free_port()}", **extra}


# -- client port -----------------------------------------------------------------------------------
def test_client_port_tls_needs_the_right_ca(spawn: Spawn, pki: PKI) -> None:
    """Plaintext and a client trusting another CA fail with UNAVAILABLE; the right CA works (file or PEM bytes)."""
    d = spawn("tls", config=_tls_config(pki), credentials=_creds(pki.ca))
    with BrokerClient(d.address, timeout_s=5) as plain:
        assert _code(plain.list_topics) == grpc.StatusCode.UNAVAILABLE
    with BrokerClient(d.address, timeout_s=5, tls_ca_file=pki.rogue.cert) as wrong:
        assert _code(wrong.list_topics) == grpc.StatusCode.UNAVAILABLE
    with BrokerClient(d.address, timeout_s=5, tls_ca_file=pki.ca.cert) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(body=b"over tls")], ack="flush")
        assert [m.body for m in c.pull("t", 0, 0)] == [b"over tls"]
    with BrokerClient(d.address, timeout_s=5, root_certificates=Path(pki.ca.cert).read_bytes()) as old_style:
        assert "t" in old_style.list_topics()


def test_client_certificates_when_client_ca_is_set(spawn: Spawn, pki: PKI) -> None:
    """With tls.client_ca_file, a client without a certificate, or with one another CA signed, is refused."""
    d = spawn("mtls", config=_tls_config(pki, **{"tls.client_ca_file": pki.ca.cert}),
              credentials=_creds(pki.ca, pki.client))
    with BrokerClient(d.address, timeout_s=5, tls_ca_file=pki.ca.cert) as no_cert:
        assert _code(no_cert.list_topics) == grpc.StatusCode.UNAVAILABLE
    with BrokerClient(d.address, timeout_s=5, tls_ca_file=pki.ca.cert, tls_cert_file=pki.rogue_client.cert,
                      tls_key_file=pki.rogue_client.key) as rogue:
        assert _code(rogue.list_topics) == grpc.StatusCode.UNAVAILABLE
    with BrokerClient(d.address, timeout_s=5, tls_ca_file=pki.ca.cert, tls_cert_file=pki.client.cert,
                      tls_key_file=pki.client.key) as c:
        c.create_topic("t")
        assert "t" in c.list_topics()
        assert c.status()["security"] == {"tls": True, "client_certificates": True, "replication_mutual_tls": False,
                                          "token_for_writes": False, "token_for_reads": False,
                                          "tokens": [], "insecure_network": []}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], capture_output=True, text=True, timeout=60,
                          check=False, env={**os.environ, **(env or {})})


def test_cli_tls_and_token_flags(spawn: Spawn, pki: PKI, tmp_path: Path) -> None:
    """--tls-ca and --token-file (or $TIDEMARK_TOKEN) reach a TLS + token broker; without them the CLI fails."""
    d = spawn("cli", config=_tls_config(pki, **{"auth.token_file": _token_file(tmp_path)}), credentials=_creds(pki.ca))
    tf = _token_file(tmp_path, name="client-token")
    r = _cli("topic", "create", "a", "--broker", d.address, "--tls-ca", pki.ca.cert, "--token-file", tf)
    assert r.returncode == 0, r.stderr
    r = _cli("topic", "create", "b", "--broker", d.address, "--tls-ca", pki.ca.cert, env={"TIDEMARK_TOKEN": TOKEN})
    assert r.returncode == 0, r.stderr
    r = _cli("topic", "create", "c", "--broker", d.address, "--tls-ca", pki.ca.cert)
    assert r.returncode == 1 and "UNAUTHENTICATED" in r.stderr
    r = _cli("status", "--broker", d.address)  # plaintext against TLS
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr
    r = _cli("topic", "list", "--broker", d.address, "--tls-ca", pki.ca.cert)  # reads need no token
    assert r.returncode == 0 and '"a"' in r.stdout and '"b"' in r.stdout and '"c"' not in r.stdout


# -- replication port ------------------------------------------------------------------------------
def _slave_config(master: DaemonProcess, leaf: Leaf | None, ca: CA | None) -> dict[str, object]:
    cfg: dict[str, object] = {"node.role": "slave", "node.master": master.config["replication.listen"],
                              "replication.reconnect_backoff_ms_max": 200}
    if leaf is not None and ca is not None:
        cfg.update({"replication.listen": f"127.0.0.1:{free_port()}", "replication.tls_cert_file": leaf.cert,
                    "replication.tls_key_file": leaf.key, "replication.tls_ca_file": ca.cert})
    return cfg


def test_replication_mutual_tls_refuses_unknown_slaves(spawn: Spawn, pki: PKI) -> None:
    """A slave with a certificate from another CA, or with none, never replicates; the CA's own slave does."""
    master = spawn("master", config={"replication.listen": f"127.0.0.1:{free_port()}",
                                     "replication.tls_cert_file": pki.master_repl.cert,
                                     "replication.tls_key_file": pki.master_repl.key,
                                     "replication.tls_ca_file": pki.ca.cert})
    with BrokerClient(master.address) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(body=b"m%d" % i) for i in range(10)], ack="flush")
        master_end = c.status()["max_offset"]
    rogue = spawn("rogue", config=_slave_config(master, pki.rogue_slave, pki.ca))
    no_cert = spawn("nocert", config=_slave_config(master, None, None))
    good = spawn("good", config=_slave_config(master, pki.slave_repl, pki.ca))
    with BrokerClient(good.address) as g:
        wait_until(lambda: g.status()["max_offset"] == master_end and g.status()["confirm_offset"] == master_end, 20,
                   "the good slave confirming the master's end", observe=g.status)
        assert [m.body for m in g.pull("t", 0, 0)] == [b"m%d" % i for i in range(10)]
        good_id = g.status()["node_id"]
    wait_until(lambda: all(Path(r.log_path).read_text().count("master_unreachable") >= 3 for r in (rogue, no_cert)),
               20, "several reconnect attempts of the refused slaves (backoff cap 200 ms)")
    for refused in (rogue, no_cert):
        with BrokerClient(refused.address) as r:
            st = r.status()
        assert st["max_offset"] == 0 and not st["replication"]["connected"], st
        assert st["replication"]["error"].startswith("UNAVAILABLE"), st["replication"]
    with BrokerClient(master.address) as c:
        assert [r["node_id"] for r in c.status()["replicas"]] == [good_id]
    assert "snapshot_installed" in Path(good.log_path).read_text()  # the bundle came over mutual TLS too
    assert all("bootstrap_failed" in Path(r.log_path).read_text() for r in (rogue, no_cert))


def _tokens_file(tmp_path: Path, lines: list[str], name: str = "tokens") -> str:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    path.chmod(0o600)
    return str(path)


def test_replication_carries_the_token(spawn: Spawn, tmp_path: Path) -> None:
    """With auth.tokens_file, a slave holding a token with the replication role replicates; one without
    a token is refused (UNAUTHENTICATED), and so is one whose token lacks the role (PERMISSION_DENIED)."""
    token = {"auth.tokens_file": _tokens_file(tmp_path, [f"ops read,write,admin,system {TOKEN}",
                                                         f"peer replication {TOKEN}-repl"])}
    master = spawn("master", config=token)
    with BrokerClient(master.address, token=TOKEN) as c:
        c.create_topic("t")
        c.send("t", [Message(body=b"x")], ack="flush")
        end = c.status()["max_offset"]
    slave_cfg = {"node.role": "slave", "node.master": master.address, "replication.reconnect_backoff_ms_max": 200}
    good = spawn("good", config={**slave_cfg, **token})
    bad = spawn("bad", config=slave_cfg)
    with BrokerClient(good.address) as g:
        wait_until(lambda: g.status()["confirm_offset"] == end, 20, "the slave with the token confirming the end",
                   observe=g.status)
    assert "snapshot_installed" in Path(good.log_path).read_text()  # Snapshot carried the token as well
    with BrokerClient(bad.address) as b:
        st = b.status()
    assert st["max_offset"] == 0 and st["replication"]["error"].startswith("UNAUTHENTICATED"), st["replication"]
    no_role = spawn("no-role", config={**slave_cfg, "auth.tokens_file": _tokens_file(
        tmp_path, [f"ops read,write,admin,system {TOKEN}", f"peer replication {TOKEN}-other"], name="tokens-other")})
    with BrokerClient(no_role.address) as n:  # its replication token is not one the master knows
        wait_until(lambda: n.status()["replication"]["error"].startswith("PERMISSION_DENIED"), 30,
                   what="the slave to be refused", observe=n.status)
        assert n.status()["max_offset"] == 0


# -- bearer token ----------------------------------------------------------------------------------
def _protected_methods() -> list[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every method of our services not on the read allow-list."""
    out = []
    for service in pb.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            path = f"/{service.full_name}/{m.name}"
            if path not in READ_ONLY and path not in ALWAYS_OPEN:
                out.append((path, m.client_streaming, m.server_streaming))
    return out


def _raw_call(channel: grpc.Channel, path: str, client_streaming: bool, server_streaming: bool,
              metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    ident: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    try:
        if client_streaming and server_streaming:
            list(channel.stream_stream(path, ident, ident)(iter([b""]), timeout=5, metadata=metadata))
        elif server_streaming:
            list(channel.unary_stream(path, ident, ident)(b"", timeout=5, metadata=metadata))
        else:
            channel.unary_unary(path, ident, ident)(b"", timeout=5, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def test_token_guards_every_write_and_admin_call(spawn: Spawn, tmp_path: Path) -> None:
    """No token → UNAUTHENTICATED, wrong → PERMISSION_DENIED, right → OK; reads stay open; the secret is never logged."""
    d = spawn("node", config={"auth.token_file": _token_file(tmp_path)})
    with BrokerClient(d.address) as anon:
        assert _code(lambda: anon.create_topic("t")) == grpc.StatusCode.UNAUTHENTICATED
    with BrokerClient(d.address, token=WRONG) as wrong:
        assert _code(lambda: wrong.create_topic("t")) == grpc.StatusCode.PERMISSION_DENIED
    with BrokerClient(d.address, token=TOKEN) as c:
        c.create_topic("t")
        c.send("t", [Message(body=b"hello")], ack="flush")
        c.commit_offset("g", "t", 0, 1)
    with BrokerClient(d.address) as anon:  # reads need no token
        assert [m.body for m in anon.pull("t", 0, 0)] == [b"hello"]
        assert "t" in anon.list_topics() and anon.status()["role"] == "master"
        wait_until(lambda: anon.committed_offset("g", "t", 0) == 1, 20, "the committed offset readable")
        assert anon.offset_for_time("t", 0, 0) == 0
        assert _code(lambda: anon.send("t", [Message(body=b"no")], ack="flush")) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: anon.commit_offset("g", "t", 0, 0)) == grpc.StatusCode.UNAUTHENTICATED
    protected = _protected_methods()
    names = {p.rsplit("/", 1)[1] for p, _, _ in protected}
    assert {"Send", "CommitOffset", "CreateTopic", "DeleteTopic", "Promote", "Demote", "Stream", "Snapshot"} <= names
    with grpc.insecure_channel(d.address) as ch:
        for path, cs, ss in protected:  # every method not on the allow-list, including any added later
            assert _raw_call(ch, path, cs, ss) == grpc.StatusCode.UNAUTHENTICATED, path
            assert _raw_call(ch, path, cs, ss, (("authorization", "Bearer " + WRONG),)) == \
                grpc.StatusCode.PERMISSION_DENIED, path
        assert _raw_call(ch, "/tidemark.v1.Broker/DeleteTopic", False, False,
                         (("authorization", "Basic " + TOKEN),)) == grpc.StatusCode.UNAUTHENTICATED
    log = Path(d.log_path).read_text()
    assert "auth_refused" in log and "method=/tidemark.v1.Broker/CreateTopic" in log and "peer=" in log
    assert TOKEN not in log and WRONG not in log


def test_token_rotates_on_sighup(spawn: Spawn, tmp_path: Path) -> None:
    """SIGHUP re-reads auth.token_file: the old token is refused from then on, the new one accepted."""
    path = _token_file(tmp_path)
    d = spawn("node", config={"auth.token_file": path})
    new = "n3w-" + TOKEN
    Path(path).write_text(new + "\n")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "token_rotated=True" in Path(d.log_path).read_text(), 10, "the token rotation logged")
    with BrokerClient(d.address, token=TOKEN) as old:
        assert _code(lambda: old.create_topic("x")) == grpc.StatusCode.PERMISSION_DENIED
    with BrokerClient(d.address, token=new) as c:
        c.create_topic("x")
    assert new not in Path(d.log_path).read_text()


def test_require_for_reads(spawn: Spawn, tmp_path: Path) -> None:
    """auth.require_for_reads closes pull, status and list topics too; health checks stay open (readiness used one)."""
    d = spawn("node", config={"auth.token_file": _token_file(tmp_path), "auth.require_for_reads": "true"})
    with BrokerClient(d.address) as anon:
        assert _code(anon.list_topics) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(anon.status) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: anon.pull("t", 0, 0)) == grpc.StatusCode.UNAUTHENTICATED
    with BrokerClient(d.address, token=TOKEN) as c:
        c.create_topic("t")
        assert len(c.pull("t", 0, 0)) == 0 and "t" in c.list_topics()
        assert c.status()["security"]["token_for_reads"] is True


def test_bad_security_settings_exit_2(tmp_path: Path, pki: PKI) -> None:
    """A missing certificate or a too-short token stops start-up with exit 2 and the key in one line."""
    short = _token_file(tmp_path, "short")
    cases = {
        "tls.cert_file": {"TIDEMARK_TLS__CERT_FILE": str(tmp_path / "missing.pem"), "TIDEMARK_TLS__KEY_FILE": pki.server.key,
                          "TIDEMARK_REPLICATION__LISTEN": "127.0.0.1:1"},
        "auth.token_file": {"TIDEMARK_AUTH__TOKEN_FILE": short},
        "replication.listen": {"TIDEMARK_TLS__CERT_FILE": pki.server.cert, "TIDEMARK_TLS__KEY_FILE": pki.server.key},
        "replication.tls_ca_file": {"TIDEMARK_REPLICATION__TLS_CERT_FILE": pki.master_repl.cert,
                                    "TIDEMARK_REPLICATION__TLS_KEY_FILE": pki.master_repl.key,
                                    "TIDEMARK_REPLICATION__LISTEN": "127.0.0.1:1"},
    }
    for key, env in cases.items():
        r = _cli("serve", "--data-dir", str(tmp_path / "d"), "--listen", f"127.0.0.1:{free_port()}", env=env)
        assert r.returncode == 2 and r.stderr.startswith(f"tidemark: {key}:"), (key, r.stderr)
        assert r.stderr.strip().count("\n") == 0
    assert not (tmp_path / "d").exists()
    conf = tmp_path / "c.toml"
    conf.write_text(f'[auth]\ntoken_file = "{short}"\n')
    r = _cli("config", "check", str(conf))
    assert r.returncode == 2 and "auth.token_file" in r.stderr
