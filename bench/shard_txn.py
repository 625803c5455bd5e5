"""Transactions across shards (issue 38, docs/shards.md "Transactions across shards"): what the
two-phase commit costs against a transaction that stays on its coordinator's shard.

One real etcd and three single-node shards (``s1``..``s3``, one ``tidemark serve`` each), a topic of
6 queues (two per shard). ``--producers`` threads of one process, each with its own transactional
id and ``BrokerClient``, run transactions back to back: begin, one send of ``--messages`` 1 KiB
messages (ack=leader, counted), commit. Two shapes, windows interleaved over ``--rounds``:

- ``local``: every message keyed to a queue of the transactional id's coordinator shard (one
  shard: no participant, the one-pair commit);
- ``spread``: the messages keyed over all 6 queues (three shards: two participants registered,
  prepared and told the decision).

Printed: transactions per second and messages per second of each, their ratio, and the latency
of one transaction (begin to commit answered) p50/p99. Every transaction must commit.

Usage: .venv/bin/python bench/shard_txn.py [--quick] [--rounds 3] [--seconds 6] [--producers 4] [--messages 100]
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from typing import Any

import common
from common import Results, log

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, Message
from broker.client.sharded_txn import ShardedTransaction
from tests.failoverutil import coordinated, wait_master
from tests.procs import DaemonProcess

TOPIC = "tx"
QUEUES = 6
SHARDS = ("s1", "s2", "s3")
BODY = b"x" * 1024


def _keys_by_shard(c: BrokerClient) -> dict[str, list[str]]:
    owners = [q["shard"] for q in c.describe_topic(TOPIC)["queues"]]
    keys: dict[str, list[str]] = {s: [] for s in SHARDS}
    i = 0
    while min(len(k) for k in keys.values()) < 32:
        key = f"k{i}"
        keys[owners[c.pick_queue(TOPIC, key)]].append(key)
        i += 1
    return keys


class Producer:
    def __init__(self, address: str, tid: str, messages: int) -> None:
        self.client = BrokerClient(address)
        self.tid = tid
        tx = self.client.begin_transaction(tid, fence=True)
        assert isinstance(tx, ShardedTransaction)
        self.coordinator = tx.coordinator
        tx.abort()
        keys = _keys_by_shard(self.client)
        local = keys[self.coordinator]
        spread = [k for group in zip(*keys.values(), strict=False) for k in group]
        self.batches = {
            "local": [Message(BODY, key=local[i % len(local)]) for i in range(messages)],
            "spread": [Message(BODY, key=spread[i % len(spread)]) for i in range(messages)],
        }

    def window(self, shape: str, until: float, latencies: list[float]) -> None:
        batch = self.batches[shape]
        while time.monotonic() < until:
            t0 = time.perf_counter()
            with self.client.transaction(self.tid) as tx:
                tx.send(TOPIC, batch, ack="leader")
            assert tx.state == "committed"
            latencies.append(time.perf_counter() - t0)


def _window(producers: list[Producer], shape: str, seconds: float) -> tuple[int, list[float]]:
    latencies: list[float] = []
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=p.window, args=(shape, until, latencies)) for p in producers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(latencies), latencies


def run(res: Results, a: Any, workdir: str) -> None:
    etcd = EtcdProcess(os.path.join(workdir, "etcd")).start()
    nodes: list[DaemonProcess] = []
    try:
        for shard in SHARDS:
            node = DaemonProcess(os.path.join(workdir, shard), config=coordinated(
                etcd.endpoint, **{"coordinator.cluster": "bench", "coordinator.shard": shard}))
            node.start()
            nodes.append(node)
            wait_master([node])
        with BrokerClient(nodes[0].address) as c:
            c.create_topic(TOPIC, queues=QUEUES)
        producers = [Producer(nodes[i % len(nodes)].address, f"bench-tx-{i}", a.messages) for i in range(a.producers)]
        log(f"coordinators: {sorted(p.coordinator for p in producers)}")
        for shape in ("local", "spread"):
            _window(producers, shape, a.warmup)
        counts: dict[str, list[float]] = {"local": [], "spread": []}
        latencies: dict[str, list[float]] = {"local": [], "spread": []}
        for r in range(a.rounds):
            for shape in ("local", "spread") if r % 2 == 0 else ("spread", "local"):
                n, lat = _window(producers, shape, a.seconds)
                counts[shape].append(n / a.seconds)
                latencies[shape].extend(lat)
                log(f"round {r + 1} {shape}: {n / a.seconds:.1f} transactions/s")
        for p in producers:
            p.client.close()
        rate = {s: statistics.mean(v) for s, v in counts.items()}
        for shape in ("local", "spread"):
            lat = sorted(latencies[shape])
            res.add(f"{shape}: transactions per second", rate[shape], "tx/s", producers=a.producers,
                    messages=a.messages)
            res.add(f"{shape}: messages per second", rate[shape] * a.messages, "msg/s")
            res.add(f"{shape}: transaction latency p50", lat[len(lat) // 2] * 1000, "ms")
            res.add(f"{shape}: transaction latency p99", lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, "ms")
        res.add("spread over three shards / on one shard, transactions per second", rate["spread"] / rate["local"],
                "x", note="two-phase commit: two participants registered, prepared, told the decision")
    finally:
        for node in nodes:
            node.kill9()
        etcd.stop()


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--messages", type=int, default=100)
    a = p.parse_args()
    if a.quick:
        a.rounds, a.seconds, a.warmup = 1, 2.0, 1.0
    res = Results("shard_txn", a.results, {"quick": a.quick})
    common.preflight(res, a.max_wait_quiet)
    with common.temp_dir("tm-shard-txn-", a.workdir) as workdir:
        run(res, a, workdir)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
