"""What a user installs is what we test: the wheel and the sdist ``python -m build`` makes from this
checkout, and ``pip install`` of the checkout itself as docs/operations.md §1 says, each into a
fresh virtual environment *without* the lock file (pip resolves ``[project].dependencies`` alone,
as an operator's install does). Then the installed ``tidemark`` is run from outside the checkout:
``--help``, ``pip check``, ``serve`` with no configuration, ``serve`` under a real etcd (elected,
and a failover), a send and a consume, a configuration that needs a missing extra, and the sdist
built with no C compiler (the Python walk runs; status says so).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from broker.cli.etcd_process import EtcdProcess
from tests.aptutil import require_tool
from tests.procs import DaemonProcess, free_port
from tests.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("install")]  # one worker builds and installs

ROOT = Path(__file__).resolve().parent.parent
OPERATIONS = ROOT / "docs" / "operations.md"
INSTALL_TIMEOUT_S = 900                  # a clean machine downloads grpcio, numpy, lmdb, ... once
SKIPPED_DIRS = {".git", ".venv", "build", "dist", "node_modules", "__pycache__", ".mypy_cache", ".ruff_cache",
                ".pytest_cache"}


def _base_python() -> str:
    """The interpreter the test venv was made from (a venv's venv would inherit nothing, but be exact)."""
    return getattr(sys, "_base_executable", sys.executable)


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no venv, no PYTHONPATH, no pip settings of ours."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME") and not k.startswith("TIDEMARK_")}
    return {**env, **extra}


def _run(cmd: list[str], cwd: Path, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=_clean_env(**env), capture_output=True, text=True, timeout=timeout_s,
                          check=False)


def _copy_checkout(dest: Path) -> Path:
    """The files a clone has (tracked, plus new files not ignored), without venvs or build output."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=False)
    if listed.returncode == 0:
        names = [n for n in listed.stdout.decode().split("\0") if n]
    else:  # an export without .git
        names = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts) and p.suffix not in (".so", ".pyc")]
    for name in names:
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _venv(path: Path, *pip_args: str, **env: str) -> Path:
    made = _run([_base_python(), "-m", "venv", str(path)], path.parent)
    assert made.returncode == 0, made.stderr
    installed = _run([str(path / "bin" / "pip"), "install", "--no-cache-dir", "-q", *pip_args], path.parent,
                     INSTALL_TIMEOUT_S, **env)
    assert installed.returncode == 0, f"pip install {pip_args}: {installed.stderr[-3000:]}"
    return path


class Installed:
    """The built artifacts and the venvs they were installed into."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.src = base / "src"
        self.dist = base / "dist"
        self.wheel = Path()
        self.sdist = Path()
        self.wheel_venv = base / "wheel-venv"
        self.sdist_venv = base / "sdist-venv"

    def tidemark(self, venv: Path, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv / "bin" / "tidemark"), *args], cwd=self.base, env=_clean_env(**env),
                              input=stdin, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """``python -m build`` (an isolated build: setuptools from the index, the wheel built from the
    sdist), then the wheel and, with ``CC=false``, the sdist into venvs of their own, in parallel."""
    inst = Installed(tmp_path_factory.mktemp("install"))
    inst.src.mkdir()
    _copy_checkout(inst.src)
    built = _run([sys.executable, "-m", "build", "--outdir", str(inst.dist), str(inst.src)], inst.base, INSTALL_TIMEOUT_S)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    inst.wheel = next(inst.dist.glob("tidemark-*.whl"))
    inst.sdist = next(inst.dist.glob("tidemark-*.tar.gz"))
    with ThreadPoolExecutor(2) as pool:
        wheel = pool.submit(_venv, inst.wheel_venv, str(inst.wheel))
        # no C compiler: setuptools' CC is `false`, so the optional extension fails to build
        sdist = pool.submit(_venv, inst.sdist_venv, str(inst.sdist), CC="false", LDSHARED="false")
        wheel.result()
        sdist.result()
    yield inst


class InstalledDaemon(DaemonProcess):
    """``tidemark serve`` from an installed venv, started outside the checkout."""

    def __init__(self, venv: Path, data_dir: str, **kwargs: object) -> None:
        super().__init__(data_dir, **kwargs)  # type: ignore[arg-type]
        self.venv = venv

    def command(self) -> list[str]:
        cmd = [str(self.venv / "bin" / "tidemark"), "serve", "--data-dir", self.data_dir, "--listen", self.address]
        return [*cmd[:2], "--config", self.config_file, *cmd[2:]] if self.config_file else cmd

    def environment(self) -> dict[str, str]:
        env = _clean_env()
        for key, value in self.config.items():
            env["TIDEMARK_" + key.upper().replace(".", "__")] = str(value)
        return {**env, **self.env}


def test_the_artifacts_hold_what_an_install_needs(installed: Installed) -> None:
    """The sdist carries the C module's source and the proto; the wheel every package and the
    console script; neither carries tests or the lock file's tools."""
    with tarfile.open(installed.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"broker/logformat/_framing.c", "broker/logformat/_plainwire.c", "broker/logformat/_utf8.h",
            "proto/tidemark.proto", "pyproject.toml", "README.md"} <= names
    with zipfile.ZipFile(installed.wheel) as whl:
        wheel_names = whl.namelist()
        entry_points = next(whl.read(n).decode() for n in wheel_names if n.endswith("entry_points.txt"))
        metadata = next(whl.read(n).decode() for n in wheel_names if n.endswith(".dist-info/METADATA"))
    for package in ("broker", "replication", "tieredstore", "spark_connector", "proto"):
        assert f"{package}/__init__.py" in wheel_names, package
    for module in ("_framing", "_plainwire"):
        assert any(n.startswith(f"broker/logformat/{module}") and n.endswith(".so") for n in wheel_names), module
    assert not any(n.startswith("tests/") for n in wheel_names)
    assert "tidemark = broker.cli:main" in entry_points and "replication.coordination.lookup:prestart" in entry_points
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.startswith("etcd3aio") for r in requires), requires        # automatic failover needs no extra
    assert all("extra ==" in r for r in requires if r.startswith(("boto3", "pyspark", "pyarrow", "pandas"))), requires


def test_the_wheel_installs_serves_and_fails_over(installed: Installed, tmp_path: Path) -> None:
    """A fresh venv with the wheel: ``pip check`` clean, no optional package pulled in, ``--help``;
    a daemon with no configuration answers status, send and consume; two daemons under a real etcd
    elect one master and fail over to the other after a kill -9."""
    venv = installed.wheel_venv
    check = _run([str(venv / "bin" / "pip"), "check"], tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    for optional in ("boto3", "pyspark", "pyarrow"):
        assert _run([str(venv / "bin" / "pip"), "show", optional], tmp_path).returncode == 1, optional
    helped = installed.tidemark(venv, "--help")
    assert helped.returncode == 0 and "serve" in helped.stdout
    where = _run([str(venv / "bin" / "python"), "-c", "import broker; print(broker.__file__)"], tmp_path)
    assert str(venv) in where.stdout, where.stdout + where.stderr      # not this checkout

    node = InstalledDaemon(venv, str(tmp_path / "alone")).start()
    try:
        st = json.loads(installed.tidemark(venv, "status", "--broker", node.address, "--json").stdout)
        assert st["role"] == "master" and st["native_framing"] is True
        assert installed.tidemark(venv, "topic", "create", "orders", "--queues", "2", "--broker", node.address).returncode == 0
        sent = installed.tidemark(venv, "send", "orders", "--broker", node.address, "--ack", "flush", stdin="a\nb\nc\n")
        assert sent.returncode == 0 and len(sent.stdout.splitlines()) == 3, sent.stderr
        got = installed.tidemark(venv, "consume", "orders", "--broker", node.address, "--max", "3", "--timeout-ms", "2000")
        assert sorted(json.loads(line)["body"] for line in got.stdout.splitlines()) == ["a", "b", "c"], got.stderr
    finally:
        assert node.stop() == 0, node.tail_log()

    require_tool("etcd", "etcd-server")
    etcd = EtcdProcess(str(tmp_path / "etcd")).start()
    nodes = [InstalledDaemon(venv, str(tmp_path / name), config={"coordinator.endpoints": etcd.endpoint})
             for name in ("a", "b")]
    try:
        for n in nodes:
            n.start()

        def roles() -> list[str]:
            out = []
            for n in nodes:
                r = installed.tidemark(venv, "status", "--broker", n.address, "--json")
                out.append(json.loads(r.stdout)["role"] if r.returncode == 0 and n.proc and n.proc.poll() is None else "down")
            return out

        wait_until(lambda: sorted(roles()) == ["master", "slave"], 30, what="one node elected, the other following")
        master = nodes[roles().index("master")]
        both = ",".join(n.address for n in nodes)
        assert installed.tidemark(venv, "topic", "create", "t", "--broker", both).returncode == 0
        assert installed.tidemark(venv, "send", "t", "--broker", both, "--ack", "replica", stdin="x\n").returncode == 0
        master.kill9()
        survivor = next(n for n in nodes if n is not master)
        wait_until(lambda: roles()[nodes.index(survivor)] == "master", 30, what="the slave elected after a kill -9")
        sent = installed.tidemark(venv, "send", "t", "--broker", both, "--ack", "replica", stdin="y\n")
        assert sent.returncode == 0, sent.stderr
        got = installed.tidemark(venv, "consume", "t", "--broker", survivor.address, "--max", "2", "--timeout-ms", "3000")
        assert sorted(json.loads(line)["body"] for line in got.stdout.splitlines()) == ["x", "y"], got.stderr
    finally:
        for n in nodes:
            n.kill9()
        etcd.kill9()


def test_a_missing_extra_refuses_in_one_line(installed: Installed, tmp_path: Path) -> None:
    """The wheel without ``[s3]``: a configuration naming the S3 backend exits 1 with one line
    that names the extra; the Spark connector's import names its extra too."""
    config = tmp_path / "s3.toml"
    config.write_text('[tieredstore]\nbackend = "s3"\ns3_bucket = "b"\ns3_endpoint = "http://127.0.0.1:9"\n')
    r = installed.tidemark(installed.wheel_venv, "serve", "--config", str(config), "--data-dir", str(tmp_path / "d"),
                           "--listen", f"127.0.0.1:{free_port()}")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "pip install 'tidemark[s3]'" in r.stderr and "Traceback" not in r.stderr
    spark = _run([str(installed.wheel_venv / "bin" / "python"), "-c", "import spark_connector"], tmp_path)
    assert spark.returncode == 1 and "pip install 'tidemark[spark]'" in spark.stderr.strip().splitlines()[-1]


def test_the_sdist_installs_without_a_c_compiler(installed: Installed, tmp_path: Path) -> None:
    """Built with ``CC=false``: the install succeeds, the daemon serves with the Python framing
    walk, says so in status, and a send is stored and read back."""
    venv = installed.sdist_venv
    assert not list((venv / "lib").rglob("_framing*.so")) and not list((venv / "lib").rglob("_plainwire*.so"))
    node = InstalledDaemon(venv, str(tmp_path / "node")).start()
    try:
        st = json.loads(installed.tidemark(venv, "status", "--broker", node.address, "--json").stdout)
        assert st["native_framing"] is False
        assert installed.tidemark(venv, "topic", "create", "t", "--broker", node.address).returncode == 0
        assert installed.tidemark(venv, "send", "t", "--broker", node.address, "--ack", "flush", stdin="p\n").returncode == 0
        got = installed.tidemark(venv, "consume", "t", "--broker", node.address, "--max", "1", "--timeout-ms", "2000")
        assert [json.loads(line)["body"] for line in got.stdout.splitlines()] == ["p"], got.stderr
    finally:
        assert node.stop() == 0, node.tail_log()
    assert "native_framing_missing" in Path(node.log_path).read_text()


def _sh_blocks(section: str) -> list[list[str]]:
    """The ``sh`` blocks of one section of docs/operations.md, as commands (continuations joined)."""
    text = OPERATIONS.read_text()
    body = text[text.index(section):]
    body = body[:body.index("\n## ", 1)]
    blocks = []
    for chunk in body.split("```sh\n")[1:]:
        lines = chunk[:chunk.index("```")].replace("\\\n", " ").splitlines()
        blocks.append([line.partition("#")[0].strip() for line in lines if line.partition("#")[0].strip()])
    return blocks


def test_the_install_runbook_runs_as_written(installed: Installed, tmp_path: Path) -> None:
    """docs/operations.md §1: the code block runs as written with /opt/tidemark in a temporary
    directory and /path/to/tidemark this checkout's files (``pip install`` of a checkout, no lock
    file); the system block's files exist and systemd-sysusers accepts them under a temporary
    root. Its ``install -o/-g`` and ``systemctl`` lines are checked to name those files, not run:
    they would change this machine."""
    code, system = _sh_blocks("## 1. Install (each host)")
    venv = tmp_path / "opt-tidemark"
    for command in code:
        words = [w.replace("/opt/tidemark", str(venv)).replace("/path/to/tidemark", str(installed.src))
                 for w in command.split()]
        r = _run(words, tmp_path, INSTALL_TIMEOUT_S)
        assert r.returncode == 0, (command, r.stdout[-2000:], r.stderr[-2000:])
    assert "serve" in _run([str(venv / "bin" / "tidemark"), "--help"], tmp_path).stdout
    node = InstalledDaemon(venv, str(tmp_path / "node")).start()
    try:
        st = json.loads(installed.tidemark(venv, "status", "--broker", node.address, "--json").stdout)
        assert st["role"] == "master" and st["native_framing"] is True
    finally:
        assert node.stop() == 0
    sources = [w for command in system for w in command.split() if w.startswith("deploy/")]
    assert len(sources) >= 6 and all((ROOT / s).is_file() for s in sources), sources
    sysusers = shutil.which("systemd-sysusers")
    if sysusers:
        root = tmp_path / "root"
        (root / "etc").mkdir(parents=True)
        r = _run([sysusers, f"--root={root}", str(ROOT / "deploy/sysusers.d/tidemark.conf")], tmp_path)
        assert r.returncode == 0 and "tidemark:" in (root / "etc" / "group").read_text(), r.stderr
