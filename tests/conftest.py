"""Shared fixtures: real daemon processes on loopback ports, each in its own data directory."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.cli.node_process import PORT_BLOCK_ENV
from tests.aptutil import require_tool
from tests.procs import DaemonProcess
from tests.s3server import MotoS3, RadosGateway

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# loopback ports for daemons, etcd and S3 servers: below the kernel's ephemeral range (32768-60999
# by default), one block per pytest-xdist worker (broker/cli/node_process.py, PORT_BLOCK_ENV)
PORTS_FIRST, PORTS_END = 20_000, 32_000


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...; None: a serial run (or xdist's controller)
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) if worker else 1
    size = (PORTS_END - PORTS_FIRST) // count
    first = PORTS_FIRST + (int(worker.removeprefix("gw")) if worker else 0) * size
    if worker or PORT_BLOCK_ENV not in os.environ:  # a worker's own block, whatever it inherited
        os.environ[PORT_BLOCK_ENV] = f"{first}-{first + size - 1}"


FAILED_LOG_LINES = 60  # of each daemon's log, printed at the teardown of a test that failed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed  # read by ``spawn``'s teardown
    return report


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def spawn(tmp_path: Any, request: pytest.FixtureRequest) -> Iterator[Callable[..., DaemonProcess]]:
    """Start daemons (``spawn(name, config=..., env=...)``); all are killed at teardown. When the
    test failed, the end of each one's log is printed with the failure: pytest keeps only its last
    three base directories, and a rare failure in CI is otherwise gone with its logs."""
    started: list[DaemonProcess] = []

    def make(name: str = "node", *, start: bool = True, **kwargs: Any) -> DaemonProcess:
        d = DaemonProcess(str(tmp_path / name), **kwargs)
        started.append(d)
        if start:
            d.start()
        return d

    yield make
    for d in started:
        d.kill9()
    if request.node.stash.get(_CALL_FAILED, False):
        for d in started:
            print(f"--- the last {FAILED_LOG_LINES} lines of {d.log_path} ---\n{d.tail_log(FAILED_LOG_LINES)}")


@pytest.fixture
def daemon(spawn: Callable[..., DaemonProcess]) -> DaemonProcess:
    return spawn("node")


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[Any]:
    """moto's S3 server on a free loopback port, shared by the session."""

    server = MotoS3().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def radosgw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3 server: Ceph radosgw on a one-node cluster (installed with apt-get if missing)."""

    gw = RadosGateway(str(tmp_path_factory.mktemp("ceph")))
    try:
        gw.start()
        yield gw
    finally:
        gw.stop()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs mounted for the test (a disk that fills); skipped without root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdProcess]:
    """A real single-member etcd on free loopback ports (Debian's etcd-server, installed if missing)."""
    require_tool("etcd", "etcd-server")
    server = EtcdProcess(str(tmp_path / "etcd")).start()
    yield server
    server.kill9()
