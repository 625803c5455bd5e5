"""Transactions (issue 37, DESIGN §14): their cost against plain sends, read_committed reads, and restart.

1. On a pair (a master and a slave following it, in sync): 4 producer processes, 1 KiB messages.
   For each size N in (1000, 100, 10): windows of plain sends of N messages with ack=replica and
   windows of transactions of N messages, begun by their send and committed by it
   (``tx.send(..., commit=True)``: begin, batch and decision appended in one step, one call,
   answered at ack=replica once applied). Each window five times, interleaved, after a warm-up
   window; the mean of each (this machine drifts by ~10% from one window to the next). Messages per second each and
   their ratio (target >= 0.9 at N = 1,000; 100 and 10 printed). At N = 1,000 also the two-call
   shape (a send answered at ack=leader, then ``commit()``) and its commit call's p99 against the
   ack=replica send's p99 (target <= 2x).
2. A topic of 4 queues filled by transactions of 100 messages, every tenth one aborted: one
   process reads it whole with read_committed and with read_uncommitted (5,000 per pull, bodies
   iterated); messages per second each, and their ratio (target >= 0.9).
3. One node: 100,000 aborted transactions in the aborted index (``--aborted``) and 1,000 open
   ones (``--open``), then kill -9: the time until it serves again (target <= 2 s) and what
   ``status()["recovery"]`` replayed (bytes since the views' checkpoints, AKIP-2's point), with the
   aborted index's size. Every open transaction must still be open after the restart, every
   aborted one still skipped.

Usage: .venv/bin/python bench/transactions.py [--quick] [--seconds 8] [--aborted 100000] [--open 1000]
       [--parts throughput,read,restart]
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import common
import load
import numpy as np
from common import KiB, MiB, Results, log

from broker.client import BrokerClient, Message
from tests.procs import DaemonProcess

TOPIC = "bench-txn"
PRODUCERS = 4
QUEUES = 4
SIZES = (1000, 100, 10)
ROUNDS = 5  # windows per mode, interleaved
# 16 windows of ~270 MB/s fill more than the disk twice over (master and slave): old segments go
RETAIN = {"retention.local_bytes": 4 << 30, "retention.check_interval_ms": 1000}


@contextlib.contextmanager
def running_pair(workdir: str) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    with common.running_daemon(workdir, "master", RETAIN) as m, \
            common.running_daemon(workdir, "slave", {**RETAIN, "node.role": "slave", "node.master": m.address}) as s:
        common.wait_for(lambda: any(r.get("in_sync") for r in common.status(m.address).get("replicas") or []),
                        60, "the slave in sync")
        yield m, s


def producer(address: str, topic: str, mode: str, per_call: int, body_bytes: int, idx: int,
             start_at: float, warmup_s: float, seconds: float, out: Any) -> None:
    """``mode`` plain: one ack=replica send of ``per_call`` messages per call; txn: one transaction
    of them, begun and committed by one send; txn2: begun by a send (ack=leader), then ``commit()``
    (a counted transaction). Reports the window and the commit calls' latencies."""
    body = os.urandom(body_bytes)
    messages = [Message(body=body) for _ in range(per_call)]
    commits: list[float] = []
    try:
        with BrokerClient(address) as c:
            c.send(topic, messages[:1], ack="replica")  # connect, learn the queue count

            def plain() -> None:
                c.send(topic, messages, ack="replica")

            def txn() -> None:
                c.begin_transaction(f"bench-{idx}").send(topic, messages, commit=True)

            def txn2() -> None:
                tx = c.begin_transaction(f"bench-{idx}")
                tx.send(topic, messages)
                t0 = time.perf_counter()
                tx.commit()
                commits.append(time.perf_counter() - t0)

            report = load.send_window({"plain": plain, "txn": txn, "txn2": txn2}[mode], per_call, start_at,
                                      warmup_s, seconds)
            report["commits"] = commits[-len(report["latencies"]):] if report["latencies"] else []
    except Exception as exc:
        report = load.failed_window(exc)
        report["commits"] = []
    out.put(report)


def window(address: str, mode: str, per_call: int, a: Any) -> dict[str, Any]:
    args = [(address, TOPIC, mode, per_call, a.body, i) for i in range(PRODUCERS)]
    r = load.run_window(producer, args, a.warmup, a.seconds)
    r["commits"] = sorted(x for rep in r["reports"] for x in rep["commits"])
    return r


def mean_windows(address: str, modes: tuple[str, ...], per_call: int, a: Any) -> dict[str, dict[str, Any]]:
    """Each mode's window ``ROUNDS`` times, interleaved (a, b, a, b, ...), after one warm-up window
    that does not count (a new pair's first seconds run slower): per mode the mean rate and the
    latencies of all its windows. This machine drifts by ~10% between windows of the same code."""
    window(address, modes[0], per_call, a)
    runs: dict[str, list[dict[str, Any]]] = {}
    for mode in modes * ROUNDS:
        runs.setdefault(mode, []).append(window(address, mode, per_call, a))
    return {mode: {"rate": float(np.mean([r["rate"] for r in rs])),
                   "rates": [r["rate"] for r in rs],
                   "latencies": [x for r in rs for x in r["latencies"]],
                   "commits": [x for r in rs for x in r["commits"]]}
            for mode, rs in runs.items()}


def part_throughput(res: Results, a: Any, workdir: str) -> None:
    with running_pair(workdir) as (m, _s), BrokerClient(m.address) as c:
        c.create_topic(TOPIC, queues=QUEUES)
        for n in SIZES:
            w = mean_windows(m.address, ("plain", "txn", "txn2") if n == 1000 else ("plain", "txn"), n, a)
            plain, txn = w["plain"], w["txn"]
            ratio = txn["rate"] / plain["rate"]
            send_p99 = float(np.quantile(plain["latencies"], 0.99))
            shown = ", ".join(f"{r:,.0f}" for r in plain["rates"])
            res.add(f"ack=replica sends of {n}, {PRODUCERS} producers", plain["rate"], "msg/s",
                    note=f"mean of {ROUNDS} windows ({shown}); p99 {send_p99 * 1e3:.1f} ms per send")
            shown = ", ".join(f"{r:,.0f}" for r in txn["rates"])
            res.add(f"transactions of {n}, {PRODUCERS} producers", txn["rate"], "msg/s",
                    note=f"one call each, begun and committed by its send; mean of {ROUNDS} windows ({shown})")
            target, ok = common.at_least(ratio, 0.9) if n == 1000 else ("", None)
            res.add(f"transactions of {n} / ack=replica sends of {n}", ratio, "x", target=target, ok=ok,
                    note=f"call p99 {np.quantile(txn['latencies'], 0.99) * 1e3:.1f} ms")
            if n == 1000:
                two = w["txn2"]
                res.add(f"transactions of {n}, a send then commit() / ack=replica sends of {n}",
                        two["rate"] / plain["rate"], "x", note="two calls: send (ack=leader), commit (ack=replica)")
                commit_p99 = float(np.quantile(two["commits"], 0.99))
                target, ok = common.at_most(commit_p99 / send_p99, 2.0)
                res.add("commit() p99 / ack=replica send p99", commit_p99 / send_p99, "x", target=target, ok=ok,
                        note=f"commit p99 {commit_p99 * 1e3:.1f} ms (p50 {np.median(two['commits']) * 1e3:.1f}), "
                             f"send of {n} p99 {send_p99 * 1e3:.1f} ms")


def fill_transactions(address: str, topic: str, transactions: int, per_txn: int, body_bytes: int, idx: int,
                      out: Any) -> None:
    """``transactions`` transactions of ``per_txn`` keyless messages; every tenth is aborted."""
    messages = [Message(body=os.urandom(body_bytes)) for _ in range(per_txn)]
    aborted = 0
    with BrokerClient(address) as c:
        for i in range(transactions):
            tx = c.begin_transaction(f"fill-{idx}")
            tx.send(topic, messages)
            if i % 10 == 9:
                tx.abort()
                aborted += 1
            else:
                tx.commit()
    out.put(aborted)


def reader(address: str, topic: str, isolation: str, out: Any) -> None:
    n = 0
    with BrokerClient(address) as c:
        ends = c.list_topics()[topic]["max_offsets"]
        t0 = time.perf_counter()
        for q, end in enumerate(ends):
            offset = 0
            while offset < end:
                r = c.pull(topic, q, offset, max_messages=5000, isolation=isolation)
                n += sum(1 for _ in r.bodies())
                offset = r.next_offset
        out.put({"messages": n, "seconds": time.perf_counter() - t0})


def part_read(res: Results, a: Any, workdir: str) -> None:
    with common.running_daemon(workdir, "read") as d, BrokerClient(d.address) as c:
        c.create_topic(TOPIC, queues=QUEUES)
        per_producer = a.read_transactions // 4
        aborted = sum(load.run_processes(fill_transactions, [(d.address, TOPIC, per_producer, 100, a.body, i)
                                                             for i in range(4)], timeout_s=3600))
        common.wait_applied(c)
        rates = {}
        for isolation in ("read_uncommitted", "read_committed", "read_uncommitted", "read_committed"):
            r = load.run_processes(reader, [(d.address, TOPIC, isolation)], timeout_s=3600)[0]
            rates.setdefault(isolation, []).append(r["messages"] / r["seconds"])
            log(f"{isolation}: {r['messages']:,} msgs in {r['seconds']:.2f}s")
        uncommitted, committed = max(rates["read_uncommitted"]), max(rates["read_committed"])
        note = f"{4 * per_producer:,} transactions of 100 x {a.body} B, {aborted:,} aborted; best of 2"
        res.add("read_uncommitted pull", uncommitted, "msg/s", note=note)
        res.add("read_committed pull (aborted ones skipped)", committed, "msg/s", note=note)
        target, ok = common.at_least(committed / uncommitted, 0.9)
        res.add("read_committed / read_uncommitted", committed / uncommitted, "x", target=target, ok=ok)


def abort_many(address: str, topic: str, count: int, idx: int, out: Any) -> None:
    """``count`` aborted transactions of one message each: each begin (its first send) fences
    (aborts) the one before; the last is aborted."""
    with BrokerClient(address) as c:
        for _ in range(count):
            tx = c.begin_transaction(f"abort-{idx}")
            tx.send(topic, [Message(b"x")])
        tx.abort()
    out.put(count)


def part_restart(res: Results, a: Any, workdir: str) -> None:
    with common.running_daemon(workdir, "restart") as d:
        with BrokerClient(d.address) as c:
            c.create_topic(TOPIC, queues=QUEUES)
            t0 = time.perf_counter()
            load.run_processes(abort_many, [(d.address, TOPIC, a.aborted // 8, i) for i in range(8)], timeout_s=7200)
            log(f"{a.aborted:,} aborted in {time.perf_counter() - t0:.0f}s")
            for i in range(a.open):
                c.begin_transaction(f"open-{i}", timeout_ms=900_000).send(TOPIC, [Message(b"o")])
            # a counted begin is answered before the transactions view applies it (it applies what is confirmed)
            common.wait_for(lambda: c.status()["transactions"]["open"] == a.open, 30, f"{a.open} transactions open")
            committed_before = [c.pull(TOPIC, q, 0).max_offset for q in range(QUEUES)]
            common.wait_for(lambda: os.path.getsize(os.path.join(d.data_dir, "txn", "aborted.idx")) > 0, 30,
                            "the aborted index written")
            time.sleep(2)  # a checkpoint round or two (checkpoint.interval_ms 1 s by default)
            log_bytes = c.status()["max_offset"]
        idx_bytes = os.path.getsize(os.path.join(d.data_dir, "txn", "aborted.idx"))
        d.kill9()
        took = common.start_timed(d)
        with BrokerClient(d.address) as c:
            st = c.status()
            rec = st["recovery"]
            txns = st["transactions"]
            after = [c.pull(TOPIC, q, 0).max_offset for q in range(QUEUES)]
            visible = sum(len(r) for q in range(QUEUES) for r in c.iter_pull(TOPIC, q, 0))
        target, ok = common.at_most(took, 2.0)
        res.add(f"restart after kill -9, {a.open:,} open + {txns['aborted_ranges']:,} aborted ranges", took, "s",
                target=target, ok=ok and txns["open"] == a.open and after == committed_before and visible == 0,
                note=f"recovery {rec['seconds']:.3f}s; open after: {txns['open']:,}; read_committed visible: {visible}")
        res.add("bytes replayed at that restart", rec["replayed_bytes"] / KiB, "KiB",
                note=f"log {log_bytes / MiB:,.1f} MiB; aborted index {idx_bytes / MiB:,.2f} MiB "
                     f"({txns['aborted_ranges']:,} ranges), read at start, not rebuilt")


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--body", type=int, default=KiB)
    p.add_argument("--read-transactions", type=int, default=4000)
    p.add_argument("--aborted", type=int, default=100_000)
    p.add_argument("--open", type=int, default=1000)
    p.add_argument("--parts", default="throughput,read,restart", help="which parts to run (comma-separated)")
    a = p.parse_args()
    if a.quick:
        a.seconds, a.warmup, a.read_transactions, a.aborted, a.open = 3.0, 1.0, 400, 4000, 100
    res = Results("transactions", a.results, {"producers": PRODUCERS, "body": a.body, "seconds": a.seconds})
    common.preflight(res, a.max_wait_quiet)
    with common.temp_dir("tm-txn-", a.workdir) as work:
        parts = {"throughput": part_throughput, "read": part_read, "restart": part_restart}
        for name in a.parts.split(","):
            parts[name](res, a, work)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
