"""The system under test of a chaos run: a real etcd, an S3 server (moto), and two coordinated
daemons (a pair) -- or two pairs as two shards of one cluster (``shards=("s1", "s2")``: nodes a, b
and c, d) -- every link through a loopback TcpProxy the nemesis can silence or slow.

Each node's data directory lives on a tmpfs of its own (a disk the nemesis can fill), its fsyncs
are journaled (``TIDEMARK_FSYNC_JOURNAL``: a power loss drops what was never synced) and its wall
clock reads an offset file (``TIDEMARK_CLOCK_OFFSET_FILE``: a clock jump without touching the
host's clock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from broker.cli.etcd_process import EtcdProcess
from broker.cli.node_process import free_port
from broker.client import BrokerClient, BrokerError
from tests.crashutil import drop_unsynced_bytes
from tests.procs import DaemonProcess
from tests.s3server import MotoS3, s3_config
from tests.tcpproxy import TcpProxy

NODES = ("a", "b")
SHARD_NODES = (("a", "b"), ("c", "d"), ("e", "f"))  # the nodes of the first, second, third shard
CLUSTER = "chaos"
FS_BYTES = 768 << 20


class Node:
    """One daemon with its own disk, journal, clock file and proxies (to etcd, for replication)."""

    def __init__(self, name: str, run: Path, etcd: EtcdProcess, s3_endpoint: str, mount: bool, shard: str = "") -> None:
        self.name = name
        self.shard = shard
        self.mount = run / f"fs-{name}"
        self.mount.mkdir(parents=True, exist_ok=True)
        self.mounted = False
        if mount:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(self.mount)], check=True)
            self.mounted = True
        self.journal = run / f"{name}.fsync-journal"
        self.clock_file = run / f"{name}.clock-offset"
        self.clock_file.write_text("0\n")
        self.ballast = self.mount / "ballast"
        self.to_etcd = TcpProxy(etcd.client_port)
        self.to_repl = TcpProxy(0)  # its target, the replication port, is picked in make_daemon()
        config: dict[str, Any] = {
            "coordinator.endpoints": f"http://127.0.0.1:{self.to_etcd.port}",
            "replication.advertise": self.to_repl.address,
            "replication.max_lag_ms": 2000,
            "commitlog.segment_bytes": 8 << 20,
            "retention.local_bytes": 64 << 20,
            "retention.check_interval_ms": 500,
            "checkpoint.interval_ms": 1000,
            "storage.min_free_bytes": 32 << 20,
            "tieredstore.upload_interval_ms": 500,
            "tieredstore.object_bytes": 4 << 20,
            **s3_config(s3_endpoint, f"chaos-{shard}" if shard else "chaos"),  # a bucket per shard
        }
        if shard:
            config.update({"coordinator.cluster": CLUSTER, "coordinator.shard": shard})
        self.config = config
        self.run = run
        self._daemon: DaemonProcess | None = None

    def make_daemon(self) -> None:
        """Pick the daemon's ports only once every proxy is bound (a port picked earlier could be
        handed to a proxy binding port 0 before the daemon takes it)."""
        repl_port = free_port()
        self.to_repl.target_port = repl_port
        self.config["replication.listen"] = f"127.0.0.1:{repl_port}"
        env = {"TIDEMARK_FSYNC_JOURNAL": str(self.journal), "TIDEMARK_CLOCK_OFFSET_FILE": str(self.clock_file)}
        self._daemon = DaemonProcess(str(self.mount / "data"), config=self.config, env=env,
                                     log_path=str(self.run / f"node-{self.name}.log"))

    @property
    def daemon(self) -> DaemonProcess:
        assert self._daemon is not None, "make_daemon() first"
        return self._daemon

    @property
    def address(self) -> str:
        return self.daemon.address

    def alive(self) -> bool:
        return self.daemon.proc is not None and self.daemon.proc.poll() is None

    def status(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        try:
            with BrokerClient(self.address, timeout_s=timeout_s, follow_master=False) as c:
                return c.status()
        except BrokerError:
            return None

    def log_bytes(self) -> tuple[int, bytes]:
        """(first offset, every byte) of the local log, from the segment files (read again when
        retention deletes a file in between)."""
        for _ in range(20):
            try:
                segs = sorted((Path(self.daemon.data_dir) / "log").glob("*.log"))
                return int(segs[0].name[:20]), b"".join(p.read_bytes() for p in segs)
            except (FileNotFoundError, IndexError):
                time.sleep(0.05)
        raise RuntimeError(f"could not read {self.daemon.data_dir}/log between two deletions")

    def fill_disk(self) -> None:
        """Take every free byte of this node's disk but 1 MiB (below storage.min_free_bytes)."""
        st = os.statvfs(self.mount)
        free = st.f_bavail * st.f_frsize
        with open(self.ballast, "wb") as f, contextlib.suppress(OSError):
            os.posix_fallocate(f.fileno(), 0, max(0, free - (1 << 20)))

    def free_disk(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.ballast.unlink()

    def set_clock_offset(self, offset_ms: int) -> None:
        tmp = self.clock_file.with_suffix(".tmp")
        tmp.write_text(f"{offset_ms}\n")
        os.replace(tmp, self.clock_file)

    def power_loss(self) -> int:
        """kill -9, then drop every byte the node never synced (the crash tests' journal). Returns
        the bytes dropped; the caller restarts the node."""
        self.daemon.kill9()
        return drop_unsynced_bytes(str(self.journal)) if self.journal.exists() else 0

    def close(self) -> None:
        if self._daemon is not None:
            self._daemon.kill9()
        self.to_etcd.close()
        self.to_repl.close()
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.mount)], check=False)


class Cluster:
    """etcd + S3 (behind a proxy) + nodes a and b (or a pair per shard)."""

    def __init__(self, run: Path, *, mount: bool, shards: tuple[str, ...] = ("",)) -> None:
        self.run = run
        self.shards = shards
        names = {shard: SHARD_NODES[i] if shard else NODES for i, shard in enumerate(shards)}
        self.etcd = EtcdProcess(str(run / "etcd")).start()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
        self.s3 = MotoS3().start()
        self.to_s3 = TcpProxy(self.s3.port)
        self.nodes = {n: Node(n, run, self.etcd, f"http://127.0.0.1:{self.to_s3.port}", mount, shard)
                      for shard in shards for n in names[shard]}
        for node in self.nodes.values():
            node.make_daemon()
        for node in self.nodes.values():
            node.daemon.start(60)

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes.values()]

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1 or bool(self.shards[0])

    def of(self, shard: str) -> list[Node]:
        """The nodes of ``shard`` (a pair)."""
        return [n for n in self.nodes.values() if n.shard == shard]

    def master(self, shard: str | None = None) -> Node | None:
        """The node of ``shard`` (default: the first) that says it is the unfenced master (None
        during an election)."""
        for node in self.of(self.shards[0] if shard is None else shard):
            st = node.status(1.0) if node.alive() else None
            if st and st["role"] == "master" and not st["fenced"]:
                return node
        return None

    def other(self, node: Node) -> Node:
        """The other node of ``node``'s pair."""
        return next(n for n in self.of(node.shard) if n is not node)

    def compare_logs(self, shard: str | None = None, timeout_s: float = 60.0) -> dict[str, Any] | None:
        """Once the master counts its slave in sync: both logs' bytes from the later of their
        starts to the lower of their confirm offsets, read from the segment files while the pair
        runs (bytes below a confirm offset never change). None if not in sync within the time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            master = self.master(shard)
            st = master.status() if master is not None else None
            if master is not None and st and st["replicas"] and all(r["in_sync"] for r in st["replicas"]):
                slave = self.other(master)
                sst = slave.status()
                if sst is not None:
                    below = min(int(st["confirm_offset"]), int(sst["confirm_offset"]))
                    (fa, da), (fb, db) = master.log_bytes(), slave.log_bytes()
                    low = max(fa, fb)
                    if low <= below <= min(fa + len(da), fb + len(db)):
                        return {"from": low, "below": below,
                                "equal": da[low - fa : below - fa] == db[low - fb : below - fb]}
            time.sleep(0.5)
        return None

    def heal_network(self) -> None:
        for node in self.nodes.values():
            for proxy in (node.to_etcd, node.to_repl):
                proxy.delay_s = 0.0
                proxy.heal()
        self.to_s3.delay_s = 0.0
        self.to_s3.heal()

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()
        self.to_s3.close()
        self.etcd.kill9()
        with contextlib.suppress(Exception):
            self.s3.stop()
