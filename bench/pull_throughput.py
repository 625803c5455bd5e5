"""Pull throughput: one queue holding ~1M 1 KiB messages, read back sequentially by one client process.

The queue is filled by two producer processes (``--fill-batch`` messages per send, ack=leader) and the
daemon is given time to apply every view. Then one separate client process reads the queue from
offset 0 to its end with ``pull(max_messages=--pull)`` three times:

1. ``PullResult.bodies()``: every body as bytes (the target: >= 400,000 msg/s);
2. iterating the ``PulledMessage`` objects and reading ``.body`` of each;
3. only ``len(result)``: no record is decoded (what the server and transport alone cost);
4. ``iter_pull`` + ``bodies()``: the streaming loop consumers and the Spark source use, which keeps
   the next pull in flight while the caller reads the current one (fetch pipelining).

Usage: .venv/bin/python bench/pull_throughput.py [--quick] [--messages 1000000] [--pull 5000]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import common
import load
from common import KiB, Results, log

from broker.client import BrokerClient

TOPIC = "bench-pull"
TARGET_MSG_S = 400_000  # the performance round's goal for one queue


def consumer(address: str, end: int, max_messages: int, mode: str, out: Any) -> None:

    total = 0
    body_bytes = 0
    pulls = 0
    with BrokerClient(address) as client:
        client.pull(TOPIC, 0, 0, max_messages=1)  # connect before the clock starts
        offset = 0
        t0 = time.perf_counter()
        if mode == "stream":
            for res in client.iter_pull(TOPIC, 0, 0, max_messages=max_messages):
                pulls += 1
                for b in res.bodies():
                    body_bytes += len(b)
                total += len(res)
                offset = res.next_offset
                if offset >= end:
                    break
        while offset < end:
            res = client.pull(TOPIC, 0, offset, max_messages=max_messages)
            pulls += 1
            n = len(res)
            if n == 0:
                break
            if mode == "bodies":
                for b in res.bodies():
                    body_bytes += len(b)
            elif mode == "objects":
                for m in res:
                    body_bytes += len(m.body)
            total += n
            offset = res.next_offset
        dt = time.perf_counter() - t0
    out.put({"messages": total, "seconds": dt, "body_bytes": body_bytes, "pulls": pulls})


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=None, help="messages in the queue (default 1,000,000; quick 100,000)")
    p.add_argument("--body", type=int, default=KiB)
    p.add_argument("--fill-batch", type=int, default=1000, help="messages per send() while filling")
    p.add_argument("--pull", type=int, default=5000, help="max_messages per pull()")
    a = p.parse_args()
    messages = a.messages or (100_000 if a.quick else 1_000_000)
    params = {"messages": messages, "body_bytes": a.body, "fill_batch": a.fill_batch, "max_messages": a.pull,
              "quick": a.quick}
    res = Results("pull_throughput", a.results, params)
    common.preflight(res, a.max_wait_quiet, a.malloc_tuned)
    parent = a.workdir or "/tmp"
    common.require_free_disk(parent, int(messages * (a.body + 64) * 1.5) + (256 << 20))


    with common.temp_dir("tm-pull-", parent) as wd, common.running_daemon(wd) as daemon:
        assert daemon.proc is not None
        with BrokerClient(daemon.address) as c:
            c.create_topic(TOPIC, queues=1)
            t0 = time.perf_counter()
            filled = load.fill(daemon.address, TOPIC, load.halves(messages), a.fill_batch, a.body, timeout_s=1800)
            fill_s = time.perf_counter() - t0
            log(f"filled {filled:,} messages in {fill_s:.1f}s; waiting for the views to catch up")
            st = common.wait_applied(c, timeout_s=300)
            end = c.list_topics()[TOPIC]["max_offsets"][0]
            log(f"queue {TOPIC}/0 holds {end:,} messages, log {st['log_bytes'] / common.MiB:,.0f} MiB")
        res.add("fill rate (2 producers, ack=leader)", filled / fill_s, "msg/s", note=f"{a.fill_batch} msgs per send")

        labels = {
            "bodies": "pull + PullResult.bodies()",
            "objects": "pull + PulledMessage.body",
            "count": "pull only (len, no decode)",
            "stream": "iter_pull + PullResult.bodies() (pipelined)",
        }
        for mode in ("bodies", "objects", "count", "stream"):
            cpu0 = common.cpu_seconds_of(daemon.proc.pid)
            [r] = load.run_processes(consumer, [(daemon.address, end, a.pull, mode)], timeout_s=1800)
            cpu = common.cpu_seconds_of(daemon.proc.pid) - cpu0
            rate = r["messages"] / r["seconds"]
            if r["messages"] != end:
                raise SystemExit(f"{mode}: read {r['messages']} messages, the queue holds {end}")
            if mode != "count" and r["body_bytes"] != end * a.body:
                raise SystemExit(f"{mode}: read {r['body_bytes']} body bytes, expected {end * a.body}")
            target, ok = common.at_least(rate, TARGET_MSG_S) if mode != "count" else ("", None)
            res.add(labels[mode], rate, "msg/s", target=target, ok=ok,
                    note=f"{r['messages']:,} msgs in {r['seconds']:.2f}s, {r['pulls']} pulls, "
                         f"{rate * a.body / 1e6:,.0f} MB/s, daemon CPU {cpu:.1f}s",
                    seconds=r["seconds"], daemon_cpu_s=cpu)
        daemon.stop()
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
