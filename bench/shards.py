"""A cluster of shards (issue 38, docs/shards.md): scale-out, the cost of routes, failure isolation.

One real etcd (Debian's ``etcd-server``) and ``tidemark serve`` processes with
``coordinator.cluster`` / ``coordinator.shard`` set.

``scale`` and ``routing`` (one set of daemons, windows interleaved over ``--rounds``):

- ``one``: cluster ``one``, shard ``s1``: one node confined to CPU 0 (``taskset -c 0``);
- ``two``: cluster ``two``, shards ``s1`` on CPU 0 and ``s2`` on CPU 1, one node each;
- ``pair``: one node with no shard (a one-pair cluster, today's keys) on CPU 0: direct, no routes.

The same producers run against each: ``--producers`` processes, each with a ``BrokerClient``
bootstrapped from the first node, each ``send()`` ``--batch`` 1 KiB messages with ack=flush. The
clients are not confined: the machine has two cores, so in ``two`` they share them with both
daemons (their CPU is printed). Scale-out = ``two`` / ``one`` messages per second (target >= 1.6x),
the median of the rounds' ratios (each round runs ``one`` and then ``two``, back to back).
``--scale-clients raw`` measures it again with the cheapest client there is (``raw_producer``):
each process sends one request it encoded once (a keyless batch per queue, no producer id, the
bytes as the client would send them), rotating over the queues, straight to each queue's master:
the daemons do all their work per request, the clients little but gRPC's per-call cost.
Routing cost = the clients' CPU per message in ``two`` over ``pair`` (target <= 1.1x), keyless
(each call to one shard) and keyed (64 keys: each call split over both shards, side by side), each
through ``BrokerClient.send()`` (one request per shard per call) and, keyed, through
``BrokerClient.producer()`` (``PRODUCER_IN_FLIGHT`` calls outstanding per producer: each shard's
share of several calls in one request, as a Kafka producer batches per broker).

``isolation``: two shards of two nodes each (master and slave); one client sends 10-message
ack=replica batches to a queue of each shard, back to back, in two threads. The master of ``s1`` is
killed (kill -9) ``--kills`` times (restarted as a slave in between). Per kill: the longest gap
between two acknowledgements of the ``s2`` queue around it (target <= 0.5 s), the failover time
(kill to the slave serving as master, polled every 20 ms), and how long after that the same client,
whose routes still name the dead master, has its next ``s1`` send acknowledged (target <= 0.2 s).

Usage: .venv/bin/python bench/shards.py [--quick] [--parts scale,routing,isolation] [--rounds 3]
"""

from __future__ import annotations

import collections
import itertools
import os
import statistics
import sys
import threading
import time
from typing import Any

import common
import crc32c
import grpc
import load
from common import Results, log

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, BrokerError, Message
from broker.client.core import ACKS
from broker.client.messages import encode_messages
from broker.logformat import batch as bf
from proto import tidemark_pb2 as pb
from tests.failoverutil import coordinated, in_sync, status, wait_master
from tests.procs import DaemonProcess

TOPIC = "load"
QUEUES = 8
SCALE_TARGET = 1.6
ROUTING_TARGET = 1.1
GAP_TARGET_S = 0.5
STALE_ROUTE_TARGET_S = 0.2
KEYS = 64
PRODUCER_IN_FLIGHT = 4  # calls a producer process keeps outstanding through BrokerClient.producer()
SCALE_CLIENTS = {"keyless": "BrokerClient.send()", "raw": "pre-encoded requests (raw_producer)"}
KINDS = {"keyless": "keyless", "keyed": "keyed (each call split over both shards)",
         "producer": "keyed through producer() (each shard's share of several calls in one request)"}
RETAINED_BYTES = 4 << 30


CGROUP_CPU = "/sys/fs/cgroup/cpu"  # cgroup v1's cpu controller (this machine); v2 has cpu.max instead
CGROUP_PERIOD_US = 100_000


class PinnedDaemon(DaemonProcess):
    """A daemon confined to one CPU (``taskset`` execs it: the pid is the daemon's) and, with
    ``cores`` < 1, to that share of it (a cgroup's CFS quota: every thread of the process)."""

    def __init__(self, data_dir: str, cpu: int, cores: float, **kwargs: Any) -> None:
        super().__init__(data_dir, **kwargs)
        self.cpu, self.cores = cpu, cores
        self.cgroup = ""

    def command(self) -> list[str]:
        return ["taskset", "-c", str(self.cpu), *super().command()]

    def start(self, timeout_s: float = 30.0, *, wait: bool = True) -> PinnedDaemon:
        super().start(timeout_s, wait=False)
        if self.cores < 1:
            assert self.proc is not None
            self.cgroup = os.path.join(CGROUP_CPU, f"tidemark-bench-{os.getpid()}-{os.path.basename(self.data_dir)}")
            os.makedirs(self.cgroup, exist_ok=True)
            with open(os.path.join(self.cgroup, "cpu.cfs_period_us"), "w") as f:
                f.write(str(CGROUP_PERIOD_US))
            with open(os.path.join(self.cgroup, "cpu.cfs_quota_us"), "w") as f:
                f.write(str(int(self.cores * CGROUP_PERIOD_US)))
            with open(os.path.join(self.cgroup, "cgroup.procs"), "w") as f:
                f.write(str(self.proc.pid))
        if wait:
            self.wait_ready(timeout_s)
        return self

    def kill9(self) -> None:
        super().kill9()
        if self.cgroup:
            for _ in range(50):
                try:
                    os.rmdir(self.cgroup)
                    break
                except OSError:  # the process not reaped yet
                    time.sleep(0.1)


def cgroup_quota_possible() -> bool:
    return os.access(CGROUP_CPU, os.W_OK) and os.path.exists(os.path.join(CGROUP_CPU, "cpu.cfs_quota_us"))


def keyed_producer(address: str, topic: str, ack: str, batch: int, body_bytes: int, start_at: float,
                   warmup_s: float, seconds: float, out: Any) -> None:
    """As ``load.window_producer``, but each message keyed (``KEYS`` keys): each call spans every shard."""
    body = os.urandom(body_bytes)
    messages = [Message(body=body, key=f"key-{i % KEYS}") for i in range(batch)]
    try:
        with BrokerClient(address) as client:
            client.send(topic, messages[:KEYS], ack=ack)
            report = load.send_window(lambda: client.send(topic, messages, ack=ack)[-1].commit_offset, batch,
                                      start_at, warmup_s, seconds)
    except Exception as exc:  # reported to the parent, which fails the run
        report = load.failed_window(exc)
    out.put(report)


def keyed_async_producer(address: str, topic: str, ack: str, batch: int, body_bytes: int, start_at: float,
                         warmup_s: float, seconds: float, out: Any) -> None:
    """As ``keyed_producer``, through ``BrokerClient.producer()``: each call answered by a future,
    ``PRODUCER_IN_FLIGHT`` of them outstanding (a call counts when it is made)."""
    body = os.urandom(body_bytes)
    messages = [Message(body=body, key=f"key-{i % KEYS}") for i in range(batch)]
    try:
        with BrokerClient(address) as client, client.producer(ack=ack) as producer:
            client.send(topic, messages[:KEYS], ack=ack)
            outstanding: collections.deque[Any] = collections.deque()

            def send() -> None:
                outstanding.append(producer.send(topic, messages))
                if len(outstanding) > PRODUCER_IN_FLIGHT:
                    outstanding.popleft().result()

            report = load.send_window(send, batch, start_at, warmup_s, seconds)
            producer.flush()
    except Exception as exc:  # reported to the parent, which fails the run
        report = load.failed_window(exc)
    out.put(report)


def raw_producer(address: str, topic: str, ack: str, batch: int, body_bytes: int, start_at: float,
                 warmup_s: float, seconds: float, out: Any) -> None:
    """Send one pre-encoded request per queue (``batch`` keyless records, no producer id: stored as
    sent, every time), rotating over the queues, each to its shard's master (learnt once from
    ``address``): the cheapest client of the daemons' send path."""
    body = os.urandom(body_bytes)
    records, _ = encode_messages([Message(body=body)] * batch, list(range(batch)))
    try:
        with BrokerClient(address) as client:
            queues = client.describe_topic(topic)["queues"]  # in a cluster of shards each names its master
        channels = {a: grpc.insecure_channel(a, options=[("grpc.max_send_message_length", 64 << 20)])
                    for a in {q["master"] or address for q in queues}}
        calls = []
        for q in queues:
            target = q["master"] or address
            request = pb.SendRequest(ack=ACKS[ack], batches=[pb.ProduceBatch(
                topic=topic, queue_id=q["queue_id"], producer_id=0, base_sequence=bf.NO_SEQUENCE, record_count=batch,
                records_crc=crc32c.crc32c(records), records=records)]).SerializeToString()
            method = channels[target].unary_unary("/tidemark.v1.Broker/Send", request_serializer=None,
                                                  response_deserializer=None)
            calls.append((method, request))
        turn = itertools.cycle(calls)
        for method, request in calls:
            method(request, timeout=30)  # connected, each queue written once before the window

        def send() -> None:
            method, request = next(turn)
            method(request, timeout=30)

        report = load.send_window(send, batch, start_at, warmup_s, seconds)
        for ch in channels.values():
            ch.close()
    except Exception as exc:  # reported to the parent, which fails the run
        report = load.failed_window(exc)
    out.put(report)


def _etcd(workdir: str) -> EtcdProcess:
    return EtcdProcess(os.path.join(workdir, "etcd")).start()


def _create(address: str, topic: str, queues: int) -> None:
    """Create and wait until every queue takes a send (each shard's master created it in its log)."""
    with BrokerClient(address) as c:
        c.create_topic(topic, queues=queues)
        probe = [Message(body=b"probe", key=f"key-{i}") for i in range(4 * queues)]

        def ready() -> bool:
            try:
                c.send(topic, probe, ack="leader")
            except BrokerError:
                return False
            return True

        common.wait_for(ready, 60, f"every queue of {topic} writable")


def _window(setup: dict[str, Any], kind: str, a: Any) -> dict[str, Any]:
    address = setup["nodes"][0].address
    if kind == "keyless":
        target: Any = load.window_producer
        args = [(address, TOPIC, QUEUES, a.ack, a.batch, 1024, 0.0, 0.0)] * a.producers
    elif kind == "raw":
        target = raw_producer
        args = [(address, TOPIC, a.ack, a.batch, 1024)] * a.producers
    else:
        target = keyed_producer if kind == "keyed" else keyed_async_producer
        args = [(address, TOPIC, a.ack, a.batch, 1024)] * a.producers
    pids = [d.proc.pid for d in setup["nodes"]]
    w = load.run_window(target, args, a.warmup, a.seconds, watch=pids)
    cpu = w["cpu"]
    return {"rate": w["rate"], "count": w["count"], "client_cpu": w["client_cpu"],
            "client_cpu_per_msg_us": 1e6 * sum(r["cpu"] for r in w["reports"]) / max(1, w["count"]),
            "daemon_cpu": [cpu.procs[p] / a.seconds for p in pids], "machine_cpu": cpu.machine / a.seconds}


def scale_and_routing(res: Results, a: Any, workdir: str, parts: set[str]) -> None:
    etcd = _etcd(workdir)
    setups: dict[str, dict[str, Any]] = {}
    try:
        def node(name: str, cpu: int, **config: object) -> DaemonProcess:
            # each window writes gigabytes: retention keeps every daemon's log within RETAINED_BYTES
            config = {**config, "retention.local_bytes": RETAINED_BYTES, "retention.check_interval_ms": 1000}
            return PinnedDaemon(os.path.join(workdir, name), cpu, cores, config=config).start(60)

        cores = a.daemon_cores if cgroup_quota_possible() else 1.0
        log(f"each daemon: taskset to one CPU{f', a CFS quota of {cores} of it' if cores < 1 else ''}")

        one = [node("one-s1", 0, **coordinated(etcd.endpoint, **{"coordinator.cluster": "one", "coordinator.shard": "s1"}))]
        two = [node("two-s1", 0, **coordinated(etcd.endpoint, **{"coordinator.cluster": "two", "coordinator.shard": "s1"})),
               node("two-s2", 1, **coordinated(etcd.endpoint, **{"coordinator.cluster": "two", "coordinator.shard": "s2"}))]
        pair = [node("pair", 0, **coordinated(etcd.endpoint, **{"coordinator.cluster": "pair"}))]
        for d in (*one, *two, *pair):  # each a shard (or pair) of one node
            wait_master([d], 60)
        setups = {"one": {"nodes": one}, "two": {"nodes": two}, "pair": {"nodes": pair}}
        for s in setups.values():
            _create(s["nodes"][0].address, TOPIC, QUEUES)
        with BrokerClient(two[0].address) as c:
            spread = sorted(c.cluster_status()["shards"], key=lambda s: s["shard"])
        log(f"two shards: {[(s['shard'], s['queues']) for s in spread]} queues")

        plan = []
        if "scale" in parts:
            plan += [(setup, kind) for kind in a.scale_clients.split(",") for setup in ("one", "two")]
        if "routing" in parts:
            kinds = a.kinds.split(",")
            plan += [(setup, kind) for kind in kinds for setup in ("pair", "two") if (setup, kind) not in plan]
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {k: [] for k in plan}
        for r in range(a.rounds):
            for name, kind in plan:
                common.wait_for_quiet(a.max_wait_quiet)
                w = _window(setups[name], kind, a)
                runs[(name, kind)].append(w)
                log(f"round {r + 1} {name} {kind}: {w['rate']:,.0f} msg/s, clients "
                    f"{w['client_cpu']:.2f} cores ({w['client_cpu_per_msg_us']:.2f} us/msg), daemons "
                    f"{', '.join(f'{c:.2f}' for c in w['daemon_cpu'])} cores, machine {w['machine_cpu']:.2f}")

        def med(key: tuple[str, str], field: str) -> float:
            return statistics.median(w[field] for w in runs[key])

        params = {"producers": a.producers, "batch": a.batch, "rounds": a.rounds, "seconds": a.seconds,
                  "daemon_cores": cores}
        for kind in a.scale_clients.split(",") if "scale" in parts else ():
            clients = SCALE_CLIENTS[kind]
            one_rate, two_rate = med(("one", kind), "rate"), med(("two", kind), "rate")
            for setup, what, rate in (("one", "one shard, one node on one core", one_rate),
                                      ("two", "two shards, a node each on its own core", two_rate)):
                res.add(f"{what}: ack=flush sends, {clients}", rate, "msg/s",
                        note=f"clients {med((setup, kind), 'client_cpu'):.2f} cores (not confined), daemons "
                             f"{statistics.median(sum(w['daemon_cpu']) for w in runs[(setup, kind)]):.2f}, machine "
                             f"{med((setup, kind), 'machine_cpu'):.2f}", **params)
            # each round's two windows run back to back: their ratio is less exposed to the machine's
            # drift between rounds than the ratio of medians (both are given)
            paired = [t["rate"] / o["rate"] for o, t in zip(runs[("one", kind)], runs[("two", kind)], strict=True)]
            ratio = statistics.median(paired)
            target, ok = common.at_least(ratio, SCALE_TARGET)
            res.add(f"scale-out: two shards / one shard, {clients}", ratio, "x", target=target, ok=ok,
                    note=f"median of the rounds' ratios ({', '.join(f'{x:.2f}' for x in paired)}; of the medians "
                         f"{two_rate / one_rate:.2f}); the clients share the two cores with the daemons", **params)
        if "routing" in parts:
            for kind in kinds:
                direct = med(("pair", kind), "client_cpu_per_msg_us")
                routed = med(("two", kind), "client_cpu_per_msg_us")
                what = KINDS[kind]
                res.add(f"client CPU per message, {what}: direct to one pair", direct, "us", **params)
                res.add(f"client CPU per message, {what}: routed over two shards", routed, "us", **params)
                target, ok = common.at_most(routed / direct, ROUTING_TARGET)
                res.add(f"routing cost, {what}: routed / direct client CPU per message", routed / direct, "x",
                        target=target, ok=ok, **params)
    finally:
        for s in setups.values():
            for d in s["nodes"]:
                d.kill9()
        etcd.kill9()


class Steady:
    """Back-to-back 10-message ack=replica sends to one queue; the time of each acknowledgement."""

    def __init__(self, client: BrokerClient, key: str) -> None:
        self.client, self.key = client, key
        self.acks: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        messages = [Message(body=b"x" * 100, key=self.key) for _ in range(10)]
        while not self._stop.is_set():
            try:
                self.client.send(TOPIC, messages, ack="replica")
                self.acks.append(time.monotonic())
            except BrokerError as exc:
                self.errors.append(str(exc)[:200])

    def first_after(self, t: float) -> float | None:
        return next((x for x in self.acks if x > t), None)

    def longest_gap(self, start: float, end: float) -> float:
        inside = [x for x in self.acks if start <= x <= end]
        return max((b - x for x, b in itertools.pairwise(inside)), default=end - start)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _key_on(client: BrokerClient, shard: str) -> str:
    owners = [q["shard"] for q in client.describe_topic(TOPIC)["queues"]]
    return next(k for k in (f"key-{i}" for i in range(100_000)) if owners[crc32c.crc32c(k.encode()) % len(owners)] == shard)


def isolation(res: Results, a: Any, workdir: str) -> None:
    etcd = _etcd(workdir)
    nodes: dict[str, list[DaemonProcess]] = {}
    try:
        for shard, names in (("s1", ("a", "b")), ("s2", ("c", "d"))):
            nodes[shard] = [DaemonProcess(os.path.join(workdir, n), config=coordinated(
                etcd.endpoint, **{"coordinator.cluster": "iso", "coordinator.shard": shard})).start(60) for n in names]
        for pair in nodes.values():
            master = wait_master(pair, 60)
            other = pair[1] if master is pair[0] else pair[0]
            common.wait_for(lambda m=master, o=other: in_sync(m, o), 60, "the slave in sync")
        _create(nodes["s2"][0].address, TOPIC, 4)
        gaps, failovers, stale = [], [], []
        with BrokerClient(nodes["s2"][0].address) as client:
            s1 = Steady(client, _key_on(client, "s1"))
            s2 = Steady(client, _key_on(client, "s2"))
            try:
                for k in range(a.kills):
                    time.sleep(2.0)
                    master = wait_master(nodes["s1"], 60)
                    slave = nodes["s1"][1] if master is nodes["s1"][0] else nodes["s1"][0]
                    common.wait_for(lambda m=master, s=slave: in_sync(m, s), 60, "the slave in sync")
                    killed = time.monotonic()
                    master.kill9()
                    common.wait_for(lambda s=slave: _serves_as_master(s), 30, "the slave promoted", poll_s=0.02)
                    promoted = time.monotonic()
                    common.wait_for(lambda p=promoted: s1.first_after(p) is not None, 30, "an s1 send acknowledged")
                    time.sleep(1.0)
                    first = s1.first_after(promoted)
                    assert first is not None
                    gaps.append(s2.longest_gap(killed - 1.0, promoted + 1.0))
                    failovers.append(promoted - killed)
                    stale.append(max(0.0, first - promoted))
                    log(f"kill {k + 1}: s2's longest gap {gaps[-1] * 1000:.0f} ms, failover {failovers[-1]:.2f} s, "
                        f"s1 served {stale[-1] * 1000:.0f} ms after it")
                    master.start(60)  # back as the slave
            finally:
                s1.stop()
                s2.stop()
        params = {"kills": a.kills}
        target, ok = common.at_most(max(gaps), GAP_TARGET_S)
        res.add("isolation: the other shard's longest gap between acks around a kill -9 (max)", max(gaps), "s",
                target=target, ok=ok, **params)
        res.add("isolation: the failed shard's failover, kill to its slave serving (median)",
                statistics.median(failovers), "s", **params)
        target, ok = common.at_most(max(stale), STALE_ROUTE_TARGET_S)
        res.add("isolation: the failed shard's queue served after its failover, stale routes (max)", max(stale), "s",
                target=target, ok=ok, note="the same client all along: its routes name the dead master", **params)
    finally:
        for pair in nodes.values():
            for d in pair:
                d.kill9()
        etcd.kill9()


def _serves_as_master(d: DaemonProcess) -> bool:
    try:
        st = status(d, 0.5)
    except BrokerError:
        return False
    return bool(st.get("role") == "master" and not st.get("fenced"))


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--parts", default="scale,routing,isolation")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--scale-clients", default="keyless", help=f"scale: the clients, of {', '.join(SCALE_CLIENTS)}")
    p.add_argument("--kinds", default="keyless,keyed,producer",
                   help=f"routing: the sends compared, of {', '.join(KINDS)}")
    p.add_argument("--ack", default="flush", choices=("flush", "leader"), help="scale and routing: the sends' ack")
    p.add_argument("--daemon-cores", type=float, default=0.4,
                   help="each daemon's share of its CPU (a cgroup quota; 1: the whole core). Below 1 so that the "
                        "clients, which run on the same two cores, leave the daemons the bottleneck")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.seconds, a.warmup, a.kills = 1, 3.0, 1.0, 1
    parts = set(a.parts.split(","))
    res = Results("shards", a.results, {"quick": a.quick})
    common.preflight(res, a.max_wait_quiet)
    with common.temp_dir("tm-shards-", a.workdir) as workdir:
        if parts & {"scale", "routing"}:
            scale_and_routing(res, a, workdir, parts)
        if "isolation" in parts:
            isolation(res, a, workdir)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
