"""Toward internet scale, simulated: a real etcd holding 100 shards' leases and the placement of
10,000 topics x 16 queues; coordinators only, no data path (issue 38, docs/shards.md).

What runs, all against one real etcd (Debian's ``etcd-server``, a single member on this host):

- ``--shards`` x 2 simulated nodes, each doing what a node's coordinator does with etcd, through
  the daemon's own ``Etcd`` client (``replication/coordination/etcd.py``): a lease of 2 s renewed
  and a view of its shard's keys read every ``--tick-ms`` (100 ms, as ``coordinator.py``), its node
  record written once a second; the first node of each shard holds the ``leader`` key and
  publishes ``topology/<shard>``. They share ``--clients`` gRPC connections to etcd.
- The placement of ``--topics`` x ``--queues`` written as ``create_topics`` writes it (128 topics
  per etcd transaction, spread fewest-first over the shards).
- ``--watchers`` copies of the cluster (the daemon's ``ClusterMap``: one range read, then one
  watch of ``topics/`` .. ``topology/``), standing in for as many nodes.
- One real ``tidemark serve`` joining as one more shard: ``GetRoutes`` asked of it for one random
  topic at a time is the route lookup.

Then for ``--seconds``: a new topic is placed every 100 ms (as ``create_topic``), and its delay
until every watcher holds it is the watch delay; a client asks for routes back to back.
Figures: route lookup p50/p99, watch delay p99 (targets <= 100 ms), etcd's write and request
rates, its RSS and database size, and the simulated nodes' CPU.

Usage: .venv/bin/python bench/shard_sim.py [--quick] [--shards 100] [--topics 10000] [--queues 16]
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import re
import sys
import threading
import time
import urllib.request
from typing import Any

import common
from common import Results, log
from measure import quantile

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient
from broker.config import Config
from replication.coordination import placement as pl
from replication.coordination import records as rec
from replication.coordination.cluster_map import ClusterMap
from replication.coordination.etcd import Etcd
from tests.failoverutil import coordinated, wait_master
from tests.procs import DaemonProcess

CLUSTER = "sim"
TXN_TOPICS = 128
LOOKUP_TARGET_MS = 100.0
WATCH_TARGET_MS = 100.0


def _config(endpoint: str, shard: str) -> Config:
    return Config.load(None, {"coordinator.endpoints": [endpoint], "coordinator.cluster": CLUSTER,
                              "coordinator.shard": shard})


class SimNode:
    """What one node's coordinator asks of etcd, on a shared client."""

    def __init__(self, etcd: Etcd, shard: str, index: int, tick_s: float) -> None:
        self.etcd, self.shard, self.index, self.tick_s = etcd, shard, index, tick_s
        self.node_id = f"{shard}-n{index}"
        self.client = f"10.{index}.{int(shard[1:]) // 256}.{int(shard[1:]) % 256}:7600"
        self.errors = 0
        self.rounds = 0
        self.leases_lost = 0

    async def _take_lease(self) -> int:
        """A new lease (as a node's coordinator takes one when etcd expired its last), and the
        keys bound to it: a master's leader key and its shard's topology."""
        lease = await self.etcd.grant(2)
        if self.index == 0:
            leader = rec.Leader(self.node_id, 1, self.client, self.client)
            await self.etcd._kv.put(self.etcd.key("leader"), rec.encode(leader), lease=lease)
            nodes = tuple(sorted({self.client, self.client.replace(":7600", ":7601")}))
            await self.etcd.publish_topology(rec.Topology(self.node_id, 1, self.client, nodes), lease)
        return lease

    async def run(self, stop: asyncio.Event) -> None:
        lease = 0
        registered = 0.0
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                if not lease or not await self.etcd.renew(lease):
                    if lease:
                        self.leases_lost += 1
                    lease = await self._take_lease()
                    registered = 0.0
                await self.etcd.view()
                self.rounds += 1
                if t0 - registered >= 1.0:
                    await self.etcd.register(rec.Node(self.node_id, self.client, self.client, 1, int(t0)), lease)
                    registered = t0
            except Exception:
                self.errors += 1
            await asyncio.sleep(max(0.0, self.tick_s - (time.monotonic() - t0)))


class Sim:
    """The simulated nodes and watchers on one asyncio loop in a thread of this process."""

    def __init__(self, endpoint: str, a: Any) -> None:
        self.endpoint, self.a = endpoint, a
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.watchers: list[ClusterMap] = []
        self.seen: dict[str, list[float]] = {}  # topic -> when each watcher first held it
        self.marked: dict[str, set[int]] = {}  # topic -> the watchers that hold it
        self.written: dict[str, float] = {}  # topic -> when its placement's write began
        self.nodes: list[SimNode] = []
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout_s: float = 600.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def clients(self, n: int, shard: str = "s000") -> list[Etcd]:
        out = []
        for _ in range(n):
            e = Etcd(_config(self.endpoint, shard))
            await e.connect()
            out.append(e)
        return out

    async def start_nodes(self) -> None:
        shared = await self.clients(self.a.clients)
        for s in range(self.a.shards):
            shard = f"s{s:03d}"
            for i in range(2):
                e = Etcd(_config(self.endpoint, shard))  # this shard's key names, a shared connection
                e._client = shared[(2 * s + i) % len(shared)]._client
                node = SimNode(e, shard, i, self.a.tick_ms / 1000.0)
                self.nodes.append(node)
                SIM_NODES.append(node)
                asyncio.get_running_loop().create_task(node.run(self.stop))

    async def place(self, topics: list[str], held: dict[str, int]) -> int:
        e = (await self.clients(1))[0]
        revision = 0
        for start in range(0, len(topics), TXN_TOPICS):
            chunk = [(t, self.a.queues) for t in topics[start:start + TXN_TOPICS]]
            records = {t: pl.encode(p) for t, p in pl.spread(held, chunk).items()}
            for p in (pl.decode(v) for v in records.values()):
                for q in range(p.queues):
                    held[p.owner(q)] += 1
            revision = await e.create_placements(records)
        await e.close()
        return revision

    async def start_watchers(self) -> float:
        t0 = time.monotonic()
        conns = await self.clients(self.a.watchers)
        for e in conns:
            m = ClusterMap(rec.prefix(CLUSTER))
            m.on_change.append(functools.partial(self._changed, m))
            self.watchers.append(m)
            asyncio.get_running_loop().create_task(m.follow(e))
        while not all(m.revision for m in self.watchers):
            await asyncio.sleep(0.01)
        return time.monotonic() - t0

    def _changed(self, m: ClusterMap) -> None:
        now = time.monotonic()
        for topic, seen in self.seen.items():
            if len(seen) < len(self.watchers) and id(m) not in self.marked[topic] and m.placement(topic) is not None:
                self.marked[topic].add(id(m))
                seen.append(now)

    async def place_one(self, topic: str, held: dict[str, int]) -> None:
        """Place one new topic, as ``create_topic`` does."""
        self.seen[topic] = []
        self.marked[topic] = set()
        self.written[topic] = time.monotonic()
        await self.place([topic], held)


def _etcd_metrics(endpoint: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{endpoint}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for name in ("etcd_mvcc_put_total", "etcd_mvcc_db_total_size_in_bytes", "etcd_server_proposals_committed_total",
                 "etcd_debugging_mvcc_watcher_total", "etcd_mvcc_range_total"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    out["grpc_handled"] = sum(float(v) for v in re.findall(r'^grpc_server_handled_total\{[^}]*\} (\S+)$', text, re.M))
    return out


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=100)
    p.add_argument("--topics", type=int, default=10_000)
    p.add_argument("--queues", type=int, default=16)
    p.add_argument("--watchers", type=int, default=20)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tick-ms", type=int, default=100)
    p.add_argument("--seconds", type=float, default=30.0)
    a = p.parse_args()
    if a.quick:
        a.shards, a.topics, a.watchers, a.seconds = 10, 500, 5, 5.0
    res = Results("shard_sim", a.results, {"quick": a.quick, "shards": a.shards, "topics": a.topics, "queues": a.queues,
                                          "watchers": a.watchers, "tick_ms": a.tick_ms})
    common.preflight(res, a.max_wait_quiet)
    with common.temp_dir("tm-shard-sim-", a.workdir) as workdir:
        etcd = EtcdProcess(os.path.join(workdir, "etcd")).start()
        daemon: DaemonProcess | None = None
        sim = Sim(etcd.endpoint, a)
        try:
            held = {f"s{s:03d}": 0 for s in range(a.shards)}
            t0 = time.monotonic()
            topics = [f"topic-{i:05d}" for i in range(a.topics)]
            sim.run(sim.place(topics, held))
            placed_s = time.monotonic() - t0
            log(f"placed {a.topics} topics x {a.queues} queues in {placed_s:.1f} s")
            sim.run(sim.start_nodes())
            time.sleep(3.0)
            load_s = sim.run(sim.start_watchers())
            log(f"{a.watchers} watchers loaded the cluster in {load_s:.2f} s")
            daemon = DaemonProcess(os.path.join(workdir, "node"), config=coordinated(
                etcd.endpoint, **{"coordinator.cluster": CLUSTER, "coordinator.shard": "joiner"})).start(120)
            wait_master([daemon], 120)
            with BrokerClient(daemon.address) as c:
                common.wait_for(lambda: len(c.cluster_status()["shards"]) > a.shards, 120, "the daemon's copy loaded")
            _report(res, a, *_measure(sim, etcd, daemon, topics, held, a), placed_s=placed_s, load_s=load_s)
        finally:
            sim.loop.call_soon_threadsafe(sim.stop.set)
            if daemon is not None:
                daemon.kill9()
            etcd.kill9()
    res.print_table()
    return 0


def _measure(sim: Sim, etcd: EtcdProcess, daemon: DaemonProcess, topics: list[str], held: dict[str, int],
             a: Any) -> tuple[list[float], list[float], dict[str, float], dict[str, float], float, float, int]:
    """Route lookups back to back and a new topic every 100 ms for ``a.seconds``: (lookup times,
    watch delays, etcd metrics before and after, wall seconds, this process's CPU seconds, etcd's pid)."""
    cpu0 = common.cpu_seconds_of(os.getpid())
    assert etcd.proc is not None
    etcd_cpu0 = common.cpu_seconds_of(etcd.proc.pid)
    m0, wall0 = _etcd_metrics(etcd.endpoint), time.monotonic()
    rounds0 = sum(n.rounds for n in SIM_NODES)
    errors0 = sum(n.errors for n in SIM_NODES)
    lost0 = sum(n.leases_lost for n in SIM_NODES)
    lookups: list[float] = []
    stop = threading.Event()

    def ask_routes() -> None:
        rng = random.Random(7)
        with BrokerClient(daemon.address) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c._learn_routes([rng.choice(topics)])
                lookups.append(time.perf_counter() - t)

    asker = threading.Thread(target=ask_routes, daemon=True)
    asker.start()
    n = 0
    end = time.monotonic() + a.seconds
    while time.monotonic() < end:
        sim.run(sim.place_one(f"new-{n:05d}", held))
        n += 1
        time.sleep(0.1)
    time.sleep(1.0)
    stop.set()
    asker.join(10)
    wall = time.monotonic() - wall0
    m1 = _etcd_metrics(etcd.endpoint)
    m1["node_rounds"] = sum(n.rounds for n in SIM_NODES) - rounds0
    m1["etcd_cpu_s"] = common.cpu_seconds_of(etcd.proc.pid) - etcd_cpu0
    m1["node_errors"] = sum(n.errors for n in SIM_NODES) - errors0
    m1["leases_lost"] = sum(n.leases_lost for n in SIM_NODES) - lost0
    cpu = common.cpu_seconds_of(os.getpid()) - cpu0
    for topic, seen in sim.seen.items():
        if len(seen) < a.watchers:
            raise RuntimeError(f"{topic}: seen by {len(seen)} of {a.watchers} watchers")
    # from the placement's write (begun) to the last of the watchers holding it
    delays = sorted(max(seen) - sim.written[topic] for topic, seen in sim.seen.items())
    assert etcd.proc is not None
    return sorted(lookups), delays, m0, m1, wall, cpu, etcd.proc.pid


def _report(res: Results, a: Any, lookups: list[float], delays: list[float], m0: dict[str, float],
            m1: dict[str, float], wall: float, cpu: float, etcd_pid: int, *, placed_s: float, load_s: float) -> None:
    def rate(name: str) -> float:
        return (m1.get(name, 0) - m0.get(name, 0)) / wall

    p99 = 1000 * quantile(lookups, 0.99)
    res.add("route lookup (GetRoutes of one topic from a node) p50", 1000 * quantile(lookups, 0.5), "ms",
            lookups=len(lookups))
    target, ok = common.at_most(p99, LOOKUP_TARGET_MS)
    res.add("route lookup (GetRoutes of one topic from a node) p99", p99, "ms", target=target, ok=ok, lookups=len(lookups))
    delay_p99 = 1000 * quantile(delays, 0.99)
    target, ok = common.at_most(delay_p99, WATCH_TARGET_MS)
    res.add("watch delay: a new topic's write to the last watcher holding it, p99", delay_p99, "ms", target=target,
            ok=ok, topics=len(delays))
    res.add("nodes simulated", 2 * a.shards, "nodes", note=f"in the window: {m1['node_errors']:.0f} failed etcd rounds, "
            f"{m1['leases_lost']:.0f} leases expired (a round late by more than the 2 s TTL)")
    res.add("a simulated node's rounds (lease renewal + view) per second", m1["node_rounds"] / wall / len(SIM_NODES),
            "rounds/s", note=f"nominal {1000 / a.tick_ms:g}: fewer when this process or etcd cannot keep up")
    res.add("etcd requests per second", rate("grpc_handled"), "req/s")
    res.add("etcd writes (puts) per second", rate("etcd_mvcc_put_total"), "puts/s")
    res.add("etcd proposals committed per second", rate("etcd_server_proposals_committed_total"), "ops/s")
    res.add("etcd CPU", m1["etcd_cpu_s"] / wall, "cores", note="a single member on this host")
    res.add("etcd CPU per request", 1e6 * m1["etcd_cpu_s"] / max(1.0, m1["grpc_handled"] - m0["grpc_handled"]), "us")
    res.add("etcd RSS", _rss(etcd_pid) / 1e6, "MB")
    res.add("etcd database size", m1.get("etcd_mvcc_db_total_size_in_bytes", 0) / 1e6, "MB")
    res.add("etcd watchers", m1.get("etcd_debugging_mvcc_watcher_total", 0), "watchers")
    res.add("simulating process CPU (nodes, watchers, lookups)", cpu / wall, "cores")
    res.add("placing the topics (128 per transaction)", placed_s, "s")
    res.add("a watcher's first load of the cluster", load_s, "s", note=f"{a.watchers} at once")


SIM_NODES: list[SimNode] = []


def sim_errors(sim: Sim) -> int:
    return sum(n.errors for n in sim.nodes)


if __name__ == "__main__":
    sys.exit(main())
