"""Daemon memory: RssAnon after storing 10 million small messages, and again after kill -9 + restart.

Two producer processes send ``--messages`` messages of ``--body`` bytes (default 100) in ``send()`` calls
of ``--batch`` (default 5000) messages without a key, so each call spreads over the topic's ``--queues``
queues (default 8), ack=leader. RssAnon of the daemon (``DaemonProcess.rss_anon_bytes()``) is sampled
during the load (peak), read once every view has applied everything, read after one pull from every
queue, and read again after ``kill -9`` and a restart. Target: <= 300 MB.

Usage: .venv/bin/python bench/memory.py [--quick] [--messages 10000000]
"""

from __future__ import annotations

import sys
import time

import common
import load
from common import MiB, Results, log
from measure import Sampler

from broker.client import BrokerClient

TOPIC = "bench-memory"
TARGET_BYTES = 300 * 1000 * 1000


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


    with common.temp_dir("tm-memory-", parent) as wd, common.running_daemon(wd, timeout_s=600) as daemon:
        idle = daemon.rss_anon_bytes()
        res.add("RssAnon, idle empty daemon", mb(idle), "MB")
        with BrokerClient(daemon.address) as c:
            c.create_topic(TOPIC, queues=a.queues)
        sampler = Sampler(daemon.rss_anon_bytes, 0.25)
        sampler.start()
        t0 = time.perf_counter()
        sent = load.fill(daemon.address, TOPIC, load.halves(messages), a.batch, a.body, distinct=True, timeout_s=7200)
        dt = time.perf_counter() - t0
        log(f"stored {sent:,} messages in {dt:.1f}s ({sent / dt:,.0f} msg/s)")
        with BrokerClient(daemon.address) as c:
            st = common.wait_applied(c, timeout_s=7200)
            time.sleep(1.5)  # one checkpoint interval after the last append
            stored = sum(c.list_topics()[TOPIC]["max_offsets"])
            if stored != messages:
                raise SystemExit(f"stored {stored} messages, sent {messages}")
            sampler.stop()
            peak = max((rss for _, rss in sampler.samples), default=0)
            loaded = daemon.rss_anon_bytes()
            log_note = f"{stored:,} msgs, log {st['log_bytes'] / MiB:,.0f} MiB in {st['segments']} segments"
            res.add("fill rate (2 producers, ack=leader)", sent / dt, "msg/s", note=f"{a.batch} msgs of {a.body} B per send")
            res.add("RssAnon, peak while storing", mb(peak), "MB", target="<= 300", ok=peak <= TARGET_BYTES,
                    note="sampled every 0.25 s")
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
