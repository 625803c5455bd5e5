"""S3-compatible servers on loopback for the tiered-storage tests and benchmarks.

- ``MotoS3``: moto's in-memory S3 (``ThreadedMotoServer``) on a free port: fast unit tests.
- ``RadosGateway``: Debian's Ceph radosgw on a one-node cluster in a temporary directory: one
  monitor (msgr v1), one bluestore OSD on a 4 GiB sparse file, ``auth ... = none``, pool size 1,
  no manager daemon, a user made with ``radosgw-admin``. Its beast frontend runs with
  ``tcp_nodelay=1``, as an operator should run it: with Nagle's algorithm on (beast's default)
  a response with a body that follows its headers in a second write waits for the client's
  delayed ACK, 40 ms; measured here, a LIST right after another request on the same connection
  took 45-50 ms with the default and 4-6 ms with ``tcp_nodelay=1``. Installed with apt-get when missing;
  up in about 20 s; every process is ours and is killed by ``stop()``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.request
import uuid
from typing import Any

from moto.server import ThreadedMotoServer

from tests.aptutil import apt_install
from tests.procs import free_port
from tests.waits import wait_until

ACCESS_KEY = "tidemark-test"
SECRET_KEY = "tidemark-test-secret"
PACKAGES = ("radosgw", "ceph-mon", "ceph-osd")


class MotoS3:
    def __init__(self) -> None:

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def start(self) -> MotoS3:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()


def ensure_radosgw() -> None:
    """Install Debian's radosgw, ceph-mon and ceph-osd when one of them is missing."""
    def present() -> bool:
        return all(shutil.which(b) for b in ("radosgw", "radosgw-admin", "ceph-mon", "ceph-osd", "ceph", "monmaptool"))

    if not present():
        apt_install(PACKAGES, present)


CONF = """[global]
fsid = {fsid}
mon host = v1:127.0.0.1:{mon_port}
mon initial members = a
public addr = 127.0.0.1
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
osd pool default size = 1
osd pool default min size = 1
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd crush chooseleaf type = 0
osd pool default pg num = 8
osd pool default pgp num = 8
mon max pg per osd = 1000
ms bind msgr2 = false
run dir = {dir}/run
admin socket = {dir}/run/$name.asok
log file = {dir}/log/$name.log
pid file = {dir}/run/$name.pid
[mon.a]
public addr = v1:127.0.0.1:{mon_port}
mon data = {dir}/mon
[osd.0]
osd data = {dir}/osd
osd objectstore = bluestore
bluestore block create = true
bluestore block size = 4294967296
bluestore fsck on mount = false
osd memory target = 1073741824
[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:{rgw_port} tcp_nodelay=1
rgw data = {dir}/rgw
"""


class RadosGateway:
    def __init__(self, parent: str | None = None) -> None:
        self.parent = parent
        self.procs: list[subprocess.Popen[bytes]] = []
        self._fresh()

    def _fresh(self) -> None:
        """A new directory and new ports (each start attempt gets its own)."""
        self.dir = tempfile.mkdtemp(prefix="radosgw-", dir=self.parent)
        self.mon_port = free_port()
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.conf = os.path.join(self.dir, "ceph.conf")

    def _run(self, *args: str, timeout_s: float = 60) -> None:
        subprocess.run(list(args), check=True, timeout=timeout_s, capture_output=True)

    def _spawn(self, name: str, *args: str) -> None:
        out = open(os.path.join(self.dir, "log", f"{name}.out"), "wb")  # noqa: SIM115 - handed to the child
        self.procs.append(subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        out.close()

    def start(self, timeout_s: float = 60, attempts: int = 3) -> RadosGateway:
        """Start the cluster; a start that fails is retried in a fresh directory on fresh ports.

        About one start in ten here has its OSD refused by the monitor at boot ("wrong fsid" in
        ``mon_cmd_maybe_osd_create``) and never come up; a fresh cluster then starts normally.
        The logs of a failed attempt are kept in ``/tmp/radosgw-failed-*``.
        """
        for attempt in range(attempts):
            try:
                return self._start(timeout_s)
            except (RuntimeError, AssertionError, subprocess.SubprocessError) as exc:  # AssertionError: a wait timed out
                kept = tempfile.mkdtemp(prefix="radosgw-failed-")
                shutil.copytree(os.path.join(self.dir, "log"), os.path.join(kept, "log"), dirs_exist_ok=True)
                self.stop()
                if attempt == attempts - 1:
                    raise RuntimeError(f"radosgw did not start in {attempts} attempts: {exc} (logs in {kept})") from exc
                self._fresh()
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> RadosGateway:
        ensure_radosgw()
        fsid = str(uuid.uuid4())
        for sub in ("mon", "osd", "run", "log", "rgw"):
            os.makedirs(os.path.join(self.dir, sub))
        with open(self.conf, "w") as f:
            f.write(CONF.format(fsid=fsid, mon_port=self.mon_port, rgw_port=self.port, dir=self.dir))
        c = ("--conf", self.conf)
        monmap = os.path.join(self.dir, "monmap")
        self._run("monmaptool", "--create", "--addv", "a", f"[v1:127.0.0.1:{self.mon_port}]", "--fsid", fsid, monmap)
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", monmap, *c)
        self._spawn("mon", "ceph-mon", "-i", "a", "-f", *c)
        osd_uuid = str(uuid.uuid4())
        self._run("ceph", *c, "--connect-timeout", "30", "osd", "new", osd_uuid, "0")
        self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid, *c, timeout_s=120)
        self._spawn("osd", "ceph-osd", "-i", "0", "-f", *c)
        self._wait_osd_up(timeout_s)
        self._run("radosgw-admin", *c, "user", "create", "--uid", "tidemark", "--display-name", "tidemark",
                  "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, timeout_s=120)
        self._spawn("rgw", "radosgw", "-f", *c, "-n", "client.rgw.a")

        def serving() -> bool:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a ceph process exited with {p.returncode}; logs in {self.dir}/log")
            with urllib.request.urlopen(self.endpoint, timeout=1):
                return True

        wait_until(serving, timeout_s, f"radosgw serving on {self.endpoint}", poll_s=0.2,
                   transient=lambda exc: isinstance(exc, OSError))
        return self

    def _wait_osd_up(self, timeout_s: float) -> None:
        def osd_up() -> bool:
            out = subprocess.run(["ceph", "--conf", self.conf, "--connect-timeout", "10", "osd", "dump", "--format", "json"],
                                 capture_output=True, text=True, timeout=60, check=False)
            return out.returncode == 0 and any(o.get("up") for o in json.loads(out.stdout).get("osds", []))

        wait_until(osd_up, timeout_s, "the OSD up", poll_s=0.5)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []
        shutil.rmtree(self.dir, ignore_errors=True)


def s3_config(endpoint: str, bucket: str) -> dict[str, Any]:
    """Daemon configuration for the s3 backend against one of these servers."""
    return {"tieredstore.backend": "s3", "tieredstore.s3_endpoint": endpoint, "tieredstore.s3_bucket": bucket,
            "tieredstore.s3_access_key_id": ACCESS_KEY, "tieredstore.s3_secret_access_key": SECRET_KEY,
            "tieredstore.s3_region": "us-east-1"}
