"""Daemon memory: RssAnon after storing 10 million small messages, and again after kill -9 + restart.

Two producer processes send ``--messages`` messages of ``--body`` bytes (default 100) in ``send()`` calls
of ``--batch`` (default 5000) messages without a key, so each call spreads over the topic's ``--queues``
queues (default 8), ack=leader. RssAnon of the daemon (``DaemonProcess.rss_anon_bytes()``) is sampled
during the load (peak), read once every view has applied everything, read after one pull from every
queue, and read again after ``kill -9`` and a restart. Target: <= 300 MB.

Usage: .venv/bin/python bench/memory.py [--quick] [--messages 10000000]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any

import common
from common import MiB, Results, log

from tests.procs import DaemonProcess

TOPIC = "bench-memory"
TARGET_BYTES = 300 * 1000 * 1000


def producer(address: str, count: int, batch: int, body_bytes: int, out: Any) -> None:
    from broker.client import BrokerClient, Message

    rnd = os.urandom(body_bytes + batch)
    messages = [Message(body=rnd[i : i + body_bytes]) for i in range(batch)]
    sent = 0
    with BrokerClient(address) as client:
        while sent < count:
            n = min(batch, count - sent)
            client.send(TOPIC, messages[:n], ack="leader")
            sent += n
    out.put(sent)


class RssSampler(threading.Thread):
    def __init__(self, daemon: DaemonProcess, every_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.d = daemon
        self.every_s = every_s
        self.peak = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.peak = max(self.peak, self.d.rss_anon_bytes())
            except (OSError, AssertionError):
                return
            self.halt.wait(self.every_s)


def mb(n: float) -> float:
    return n / 1e6


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=None, help="messages to store (default 10,000,000; quick 500,000)")
    p.add_argument("--body", type=int, default=100)
    p.add_argument("--batch", type=int, default=5000)
    p.add_argument("--queues", type=int, default=8)
    a = p.parse_args()
    messages = a.messages or (500_000 if a.quick else 10_000_000)
    params = {"messages": messages, "body_bytes": a.body, "batch": a.batch, "queues": a.queues, "quick": a.quick}
    res = Results("memory", a.results, params)
    common.preflight(res, a.max_wait_quiet, a.malloc_tuned)
    parent = a.workdir or "/tmp"
    common.require_free_disk(parent, int(messages * (a.body + 8) * 1.3) + (512 << 20))
    ctx = mp.get_context("spawn")

    from broker.client import BrokerClient

    with common.temp_dir("tm-memory-", parent) as wd, common.running_daemon(wd, timeout_s=600) as daemon:
        idle = daemon.rss_anon_bytes()
        res.add("RssAnon, idle empty daemon", mb(idle), "MB")
        with BrokerClient(daemon.address) as c:
            c.create_topic(TOPIC, queues=a.queues)
        sampler = RssSampler(daemon)
        sampler.start()
        out = ctx.Queue()
        share = [messages // 2, messages - messages // 2]
        t0 = time.perf_counter()
        procs = [ctx.Process(target=producer, args=(daemon.address, n, a.batch, a.body, out)) for n in share]
        for pr in procs:
            pr.start()
        sent = sum(out.get(timeout=7200) for _ in procs)
        for pr in procs:
            pr.join()
        dt = time.perf_counter() - t0
        log(f"stored {sent:,} messages in {dt:.1f}s ({sent / dt:,.0f} msg/s)")
        with BrokerClient(daemon.address) as c:
            while True:
                st = c.status()
                if st["applied_offset"] >= st["max_offset"]:
                    break
                time.sleep(0.2)
            time.sleep(1.5)  # one checkpoint interval after the last append
            stored = sum(c.list_topics()[TOPIC]["max_offsets"])
            if stored != messages:
                raise SystemExit(f"stored {stored} messages, sent {messages}")
            sampler.halt.set()
            sampler.join()
            loaded = daemon.rss_anon_bytes()
            log_note = f"{stored:,} msgs, log {st['log_bytes'] / MiB:,.0f} MiB in {st['segments']} segments"
            res.add("fill rate (2 producers, ack=leader)", sent / dt, "msg/s", note=f"{a.batch} msgs of {a.body} B per send")
            res.add("RssAnon, peak while storing", mb(sampler.peak), "MB", target="<= 300",
                    ok=sampler.peak <= TARGET_BYTES, note="sampled every 0.25 s")
            res.add("RssAnon, after storing", mb(loaded), "MB", target="<= 300", ok=loaded <= TARGET_BYTES, note=log_note)
            for q in range(a.queues):
                c.pull(TOPIC, q, 0, max_messages=5000)
                c.pull(TOPIC, q, max(0, stored // a.queues - 5000), max_messages=5000)
            pulled = daemon.rss_anon_bytes()
            res.add("RssAnon, after pulls from every queue", mb(pulled), "MB", target="<= 300", ok=pulled <= TARGET_BYTES,
                    note="head and tail of each queue, 5000 msgs each")
        daemon.kill9()
        common.start_timed(daemon, timeout_s=600)
        with BrokerClient(daemon.address) as c:
            rec = c.status()["recovery"]
            if sum(c.list_topics()[TOPIC]["max_offsets"]) != messages:
                raise SystemExit("messages missing after kill -9 and restart")
        restarted = daemon.rss_anon_bytes()
        res.add("RssAnon, after kill -9 + restart", mb(restarted), "MB", target="<= 300", ok=restarted <= TARGET_BYTES,
                note=f"ready in {daemon.ready_seconds:.2f}s, recovery {rec['seconds']:.3f}s")
        daemon.stop()
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
