"""The coordinator talks to etcd the way production etcd wants: TLS with client certificates, and
a user with a password (etcd's auth), limited to the cluster's key prefix."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.cli.etcd_process import EtcdProcess
from tests.aptutil import require_tool
from tests.certs import CA
from tests.failoverutil import Spawn, coordinated, status, wait_master
from tests.waits import holds_for, wait_until


@pytest.fixture
def secure_etcd(tmp_path: Path) -> Iterator[tuple[EtcdProcess, CA, str]]:
    """etcd with TLS, client certificates and auth on; user ``tidemark`` may read and write only
    under /tidemark/; yields (etcd, CA, the password file)."""
    require_tool("etcd", "etcd-server")
    etcdctl = require_tool("etcdctl", "etcd-client")
    ca = CA.create(tmp_path, "etcd-ca")
    server, admin = ca.issue("etcd-server"), ca.issue("admin", server=False)
    etcd = EtcdProcess(str(tmp_path / "etcd"), cert_file=server.cert, key_file=server.key,
                       client_ca_file=ca.cert).start()
    base = [etcdctl, f"--endpoints={etcd.endpoint}", f"--cacert={ca.cert}", f"--cert={admin.cert}",
            f"--key={admin.key}"]
    for args in (["user", "add", "root", "--new-user-password=root-secret-1"],
                 ["user", "add", "tidemark", "--new-user-password=tidemark-secret-1"],
                 ["role", "add", "tidemark-rw"],
                 ["role", "grant-permission", "tidemark-rw", "--prefix=true", "readwrite", "/tidemark/"],
                 ["user", "grant-role", "tidemark", "tidemark-rw"],
                 ["auth", "enable"]):
        subprocess.run([*base, *args], check=True, capture_output=True, timeout=30, env={"ETCDCTL_API": "3"})
    password = tmp_path / "etcd-password"
    password.write_text("tidemark-secret-1\n")
    yield etcd, ca, str(password)
    etcd.kill9()


def _config(etcd: EtcdProcess, ca: CA, password_file: str, name: str) -> dict[str, object]:
    client = ca.issue(f"tidemark-{name}", server=False)
    return coordinated(etcd.endpoint, **{"coordinator.tls_ca_file": ca.cert, "coordinator.tls_cert_file": client.cert,
                                         "coordinator.tls_key_file": client.key, "coordinator.username": "tidemark",
                                         "coordinator.password_file": password_file})


def test_a_pair_elects_through_etcd_with_tls_client_certificates_and_auth(
        spawn: Spawn, secure_etcd: tuple[EtcdProcess, CA, str]) -> None:
    etcd, ca, password = secure_etcd
    nodes = [spawn(n, config=_config(etcd, ca, password, n)) for n in ("a", "b")]
    master = wait_master(nodes)
    slave = nodes[1] if master is nodes[0] else nodes[0]
    wait_until(lambda: len(status(master)["coordinator"]["insync"]) == 2, 30, "the slave in etcd's in-sync set")
    master.kill9()
    assert wait_master(nodes, 30, among=[slave]) is slave


def test_a_wrong_etcd_password_keeps_the_node_out_and_says_why(
        spawn: Spawn, secure_etcd: tuple[EtcdProcess, CA, str], tmp_path: Path) -> None:
    etcd, ca, _ = secure_etcd
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    d = spawn("a", config=_config(etcd, ca, str(wrong), "a"))
    wait_until(lambda: status(d)["coordinator"]["error"], 15, "the coordinator error shown",
               accept=lambda e: "auth" in e.lower() or "password" in e.lower())
    holds_for(lambda: status(d)["role"] == "slave" and not status(d)["coordinator"]["connected"], 3,
              "a node etcd does not authenticate is never master")
