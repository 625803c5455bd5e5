"""Many queues on one node (issue 13): 25,000 topics x 4 queues under limits.open_files_max.

Steps on one daemon (``limits.open_files_max`` at its default, 1,024):
1. create the topics, one CreateTopic call per topic (target >= 1,000 topics/s), in two halves:
   the first from ``--clients`` processes that each make one call at a time (``BrokerClient``),
   the second from ``--inflight-clients`` processes that each keep ``--inflight`` calls in flight
   (``grpc.aio``), as many services creating their topics at once would; the second half is
   created on a node that already holds the first. With ``--batch N``: every topic in
   ``create_topics`` calls of N topics (the CreateTopics RPC) instead;
2. send one message to every queue (keys chosen so each of a topic's 4 queues gets one) and read
   every queue back: all 100,000 messages, exactly;
3. the daemon's open descriptors (``/proc/PID/fd``) and its open segment/queue files
   (``status()["open_files"]``; target <= the limit), and its RSS (target <= 500 MB);
4. kill -9, restart: spawn-to-serving time (target <= 2 s), then every queue read back again.

Usage: .venv/bin/python bench/many_queues.py [--quick] [--topics 25000] [--clients 8] [--inflight-clients 2]
       [--inflight 16] [--batch 1]
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from typing import Any

import common
import crc32c
import grpc
import load
from common import Results, log

from broker.client import BrokerClient, Message
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

QUEUES = 4


def keys_for_queues(queues: int) -> list[str]:
    """One key per queue: the client maps ``crc32c(key) % queues``."""

    out: dict[int, str] = {}
    i = 0
    while len(out) < queues:
        out.setdefault(crc32c.crc32c(b"k%d" % i) % queues, f"k{i}")
        i += 1
    return [out[q] for q in range(queues)]


def creator(address: str, names: list[str], batch: int, out: Any) -> None:

    t0 = time.time()
    with BrokerClient(address) as c:
        if batch == 1:
            for name in names:
                c.create_topic(name, queues=QUEUES)
        else:
            for i in range(0, len(names), batch):
                c.create_topics(dict.fromkeys(names[i : i + batch], QUEUES))
    out.put((t0, time.time()))


def creator_inflight(address: str, names: list[str], inflight: int, out: Any) -> None:
    """One CreateTopic call per topic, ``inflight`` of them at a time from this process."""

    async def run() -> tuple[float, float]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.BrokerStub(channel)
            await channel.channel_ready()
            t0 = time.time()
            todo = iter(names)

            async def caller() -> None:
                for name in todo:
                    await stub.CreateTopic(pb.CreateTopicRequest(name=name, queues=QUEUES), timeout=60)

            await asyncio.gather(*(caller() for _ in range(inflight)))
            return t0, time.time()

    out.put(asyncio.run(run()))


def created_per_s(spans: list[tuple[float, float]], topics: int) -> float:
    return topics / (max(e for _, e in spans) - min(s for s, _ in spans))


def sender(address: str, names: list[str], out: Any) -> None:

    keys = keys_for_queues(QUEUES)
    with BrokerClient(address) as c:
        for name in names:
            c._queues[name] = QUEUES  # known: skip one ListTopics per topic
            c.send(name, [Message(f"{name}/{q}".encode(), key=keys[q]) for q in range(QUEUES)], ack="flush")
    out.put(len(names))


def reader(address: str, names: list[str], out: Any) -> None:

    got: list[bytes] = []
    with BrokerClient(address) as c:
        for name in names:
            for q in range(QUEUES):
                got += c.pull(name, q, 0, max_messages=10).bodies()
    out.put(sorted(got))


def read_all(address: str, shares: list[list[str]]) -> list[bytes]:
    results = load.run_processes(reader, [(address, s) for s in shares], timeout_s=3600)
    return sorted(b for r in results for b in r)


def main() -> int:

    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--topics", type=int, default=None, help="default 25,000 (quick 2,000)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--inflight-clients", type=int, default=2)
    p.add_argument("--inflight", type=int, default=16, help="calls in flight per --inflight-clients process")
    p.add_argument("--batch", type=int, default=1, help="topics per call: 1 = CreateTopic (the issue's figure), "
                   "more = CreateTopics")
    a = p.parse_args()
    topics = a.topics or (2000 if a.quick else 25_000)
    res = Results("many_queues", a.results, {"topics": topics, "queues": topics * QUEUES, "clients": a.clients,
                                             "inflight_clients": a.inflight_clients, "inflight": a.inflight,
                                             "batch": a.batch, "quick": a.quick})
    common.preflight(res, a.max_wait_quiet)
    names = [f"t{i:06d}" for i in range(topics)]
    shares = [names[i :: a.clients] for i in range(a.clients)]
    want = sorted(f"{n}/{q}".encode() for n in names for q in range(QUEUES))
    with common.temp_dir("tm-many-queues-", a.workdir) as wd, common.running_daemon(wd) as d:
        assert d.proc is not None
        if a.batch == 1:
            first, second = names[: topics // 2], names[topics // 2 :]
            log(f"creating {len(first)} topics x {QUEUES} queues from {a.clients} processes, one call at a time each")
            spans = load.run_processes(creator, [(d.address, first[i :: a.clients], 1) for i in range(a.clients)],
                                       timeout_s=7200)
            target, ok = common.at_least(created_per_s(spans, len(first)), 1000)
            res.add(f"topics created one per call ({len(first)} x {QUEUES} queues, {a.clients} clients, one call at a time each)",
                    created_per_s(spans, len(first)), "topics/s", target=target, ok=ok)
            n = a.inflight_clients
            log(f"creating {len(second)} more from {n} processes, {a.inflight} calls in flight each")
            spans = load.run_processes(creator_inflight, [(d.address, second[i::n], a.inflight) for i in range(n)],
                                       timeout_s=7200)
            target, ok = common.at_least(created_per_s(spans, len(second)), 1000)
            res.add(f"topics created one per call ({len(second)} more, {n} clients x {a.inflight} calls in flight)",
                    created_per_s(spans, len(second)), "topics/s", target=target, ok=ok)
        else:
            log(f"creating {topics} topics x {QUEUES} queues from {a.clients} processes")
            spans = load.run_processes(creator, [(d.address, s, a.batch) for s in shares], timeout_s=7200)
            target, ok = common.at_least(created_per_s(spans, topics), 1000)
            res.add(f"topics created ({topics} x {QUEUES} queues, {a.clients} clients, {a.batch} per CreateTopics call)",
                    created_per_s(spans, topics), "topics/s", target=target, ok=ok)
        log("sending one message to every queue")
        t0 = time.perf_counter()
        load.run_processes(sender, [(d.address, s) for s in shares], timeout_s=7200)
        res.add("one message to every queue", topics * QUEUES / (time.perf_counter() - t0), "msg/s")
        with BrokerClient(d.address) as c:
            common.wait_applied(c)
        t0 = time.perf_counter()
        got = read_all(d.address, shares)
        res.add("every queue read back", topics * QUEUES / (time.perf_counter() - t0), "queues/s")
        res.add("messages read back equal those sent", 1.0 if got == want else 0.0, "yes", target="= 1", ok=got == want)
        with BrokerClient(d.address) as c:
            files = c.status()["open_files"]
        fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        target, ok = common.at_most(files["open"], files["max"])
        res.add("open segment and queue files", files["open"], "files", target=target, ok=ok, limit=files["max"])
        res.add("open descriptors of the process (sockets, LMDB, logs included)", fds, "fds")
        rss = common.proc_status_bytes(d.proc.pid, "VmRSS")
        target, ok = common.at_most(rss / 1e6, 500)
        res.add(f"RSS with {topics * QUEUES} queues", rss / 1e6, "MB", target=target, ok=ok)
        d.kill9()
        ready_s = common.start_timed(d)
        target, ok = common.at_most(ready_s, 2.0)
        res.add("kill -9 restart: spawn to serving", ready_s, "s", target=target, ok=ok)
        got = read_all(d.address, shares)
        res.add("after the restart, messages read back equal those sent", 1.0 if got == want else 0.0, "yes",
                target="= 1", ok=got == want)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
