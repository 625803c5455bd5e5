"""The systemd units in deploy/systemd: they verify, are hardened (exposure ≤ 2.0) and start our CLI."""

from __future__ import annotations

import ctypes
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from broker.cli.main import _parser
from broker.client import BrokerClient, Message
from broker.config import Config
from tests.aptutil import require_tool
from tests.certs import CA
from tests.procs import DaemonProcess, free_port
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent
UNIT_DIR = ROOT / "deploy" / "systemd"
UNITS = sorted(p.name for p in UNIT_DIR.glob("*.service"))
INSTALLED_BINARY = "/opt/tidemark/bin/tidemark"  # where docs/operations.md installs the venv
EXPOSURE_MAX = 2.0
HARDENING = re.compile(r"# --- hardening.*?# --- end of hardening ---", re.S)


@pytest.fixture(scope="session")
def systemd_analyze() -> str:
    """Debian's systemd package (works offline without systemd as PID 1); installed if missing."""
    return require_tool("systemd-analyze", "systemd")


@pytest.fixture
def local_units(tmp_path: Path) -> Iterator[Path]:
    """Copies of the units whose ExecStart names this checkout's ``tidemark`` instead of
    /opt/tidemark/bin/tidemark (verify checks that the binary exists); nothing else changes."""
    binary = Path(sys.executable).parent / "tidemark"
    assert binary.exists(), f"{binary}: the venv's console script (make venv installs it)"
    for name in UNITS:
        text = (UNIT_DIR / name).read_text()
        assert INSTALLED_BINARY in text
        (tmp_path / name).write_text(text.replace(INSTALLED_BINARY, str(binary)))
    yield tmp_path


def _exposure(systemd_analyze: str, unit: Path) -> float:
    r = subprocess.run([systemd_analyze, "security", "--offline=true", str(unit)], capture_output=True, text=True,
                       timeout=60, check=False)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+) (\w+)", r.stdout)
    assert m, f"no exposure score in: {r.stdout[-500:]} {r.stderr[-500:]}"
    return float(m.group(1))


def test_three_units_exist() -> None:
    """A master unit, a slave unit and a template reading /etc/tidemark/%i.toml."""
    assert UNITS == ["tidemark-master.service", "tidemark-slave.service", "tidemark@.service"]
    assert "--config /etc/tidemark/%i.toml" in (UNIT_DIR / "tidemark@.service").read_text()


@pytest.mark.parametrize("name", UNITS)
def test_unit_verifies(systemd_analyze: str, local_units: Path, name: str) -> None:
    """`systemd-analyze verify` passes with no complaint about the unit (bad values only warn, so warnings fail too)."""
    r = subprocess.run([systemd_analyze, "verify", str(local_units / name)], capture_output=True, text=True, timeout=60,
                       check=False)
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if name in line]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr


@pytest.mark.parametrize("name", UNITS)
def test_unit_exposure_is_ok(systemd_analyze: str, local_units: Path, name: str) -> None:
    """`systemd-analyze security --offline=true` rates the unit ≤ 2.0 ("OK")."""
    score = _exposure(systemd_analyze, local_units / name)
    print(f"{name}: exposure {score}")
    assert score <= EXPOSURE_MAX


def test_exposure_check_detects_a_weak_unit(systemd_analyze: str, local_units: Path) -> None:
    """Without the hardening block the same unit scores far above 2.0 (the check above can fail)."""
    text = (local_units / "tidemark-master.service").read_text()
    weak = local_units / "weak.service"
    weak.write_text(HARDENING.sub("", text))
    assert _exposure(systemd_analyze, weak) > 5.0


def _directives(name: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in (UNIT_DIR / name).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


@pytest.mark.parametrize("name", UNITS)
def test_unit_runs_the_daemon_as_the_contract_says(name: str) -> None:
    """Type=notify with a watchdog, SIGHUP reload, a private state directory; ExecStart parses as `tidemark serve`."""
    d = _directives(name)
    assert d["Type"] == ["notify"] and d["NotifyAccess"] == ["main"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert d["WatchdogSec"] and d["TimeoutStopSec"] and d["StateDirectoryMode"] == ["0700"]
    assert d["UMask"] == ["0077"] and d["NoNewPrivileges"] == ["yes"] and d["ProtectSystem"] == ["strict"]
    assert d["RestrictAddressFamilies"] == ["AF_INET AF_INET6 AF_UNIX"]  # AF_UNIX: the notify socket
    argv = shlex.split(d["ExecStart"][0])
    assert argv[0] == INSTALLED_BINARY
    args = _parser().parse_args(argv[1:])
    assert args.command == "serve" and args.config.startswith("/etc/tidemark/")
    assert args.role is None and args.master is None  # the role lives in the file: failover edits one place


def test_hardening_is_the_same_in_every_unit() -> None:
    """The three units share one hardening block, so a fix to one cannot miss the others."""
    blocks = {name: HARDENING.search((UNIT_DIR / name).read_text()) for name in UNITS}
    assert all(blocks.values())
    assert len({m.group(0) for m in blocks.values() if m}) == 1


# MemoryDenyWriteExecute=yes is kept only because the daemon demonstrably works under it: Linux ≥ 6.3
# offers the same rule per process (prctl PR_SET_MDWE, inherited across exec), which the test applies.
_MDWE_EXEC = """
import ctypes, os, sys
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
    sys.exit(f'PR_SET_MDWE failed: errno {ctypes.get_errno()}')
os.execv(sys.argv[1], sys.argv[1:])
"""


class _MdweDaemon(DaemonProcess):
    def command(self) -> list[str]:
        return [sys.executable, "-c", _MDWE_EXEC, *super().command()]


def test_daemon_works_under_memory_deny_write_execute(tmp_path: Path) -> None:
    """With W^X enforced by the kernel, the daemon serves TLS, tokens and replication (grpc, lmdb, crc32c)."""


    ca = CA.create(tmp_path, "ca")
    leaf = ca.issue("node")
    token = tmp_path / "token"
    token.write_text("mdwe-token-0123456789abcdef\n")
    creds = grpc.ssl_channel_credentials(Path(ca.cert).read_bytes())
    master = _MdweDaemon(str(tmp_path / "m"), credentials=creds, config={
        "tls.cert_file": leaf.cert, "tls.key_file": leaf.key, "auth.token_file": str(token),
        "replication.listen": f"127.0.0.1:{free_port()}", "replication.tls_cert_file": leaf.cert,
        "replication.tls_key_file": leaf.key, "replication.tls_ca_file": ca.cert})
    slave = _MdweDaemon(str(tmp_path / "s"), credentials=creds, config={
        **master.config, "replication.listen": f"127.0.0.1:{free_port()}", "node.role": "slave",
        "node.master": master.config["replication.listen"]})
    pr_get_mdwe = 66
    if ctypes.CDLL(None, use_errno=True).prctl(pr_get_mdwe, 0, 0, 0, 0) < 0:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux < 6.3)")
    try:
        master.start()
        slave.start()
        with BrokerClient(master.address, tls_ca_file=ca.cert, token=token.read_text().strip()) as c:
            c.create_topic("t", queues=2)
            c.send("t", [Message(body=b"wx", key="k")], ack="replica")
            end = c.status()["max_offset"]
        with BrokerClient(slave.address, tls_ca_file=ca.cert) as s:
            wait_until(lambda: s.status()["confirm_offset"] >= end, 20, "the slave confirming the master's end",
                       observe=s.status)
            assert s.status()["confirm_offset"] == end
        assert master.stop() == 0 and slave.stop() == 0
    finally:
        master.kill9()
        slave.kill9()


@pytest.mark.parametrize("role", ["master", "slave"])
def test_example_config_fits_its_unit(role: str) -> None:
    """deploy/etc/ROLE.toml is valid, says its role, and keeps its data directory *inside* the unit's
    StateDirectory: bundle staging (<dir>.bootstrap) and move-aside (<dir>.old-*) need a writable parent."""

    cfg = Config.load(str(ROOT / "deploy" / "etc" / f"{role}.toml"))
    state = _directives(f"tidemark-{role}.service")["StateDirectory"][0]
    assert os.path.dirname(cfg["node.data_dir"]) == f"/var/lib/{state}"
    assert cfg["node.role"] == role
    assert _directives(f"tidemark-{role}.service")["ExecStart"][0].endswith(f"--config /etc/tidemark/{role}.toml")
