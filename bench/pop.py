"""Pop mode (issue 15): pop + ack throughput against plain pulls, and the cost of a million leases.

1. One daemon, a topic of 4 queues filled with ``--messages`` 1 KiB messages. Plain pull: 4
   processes, one per queue, each reads its queue to the end, 5,000 per pull
   (``PullResult.bodies()``). Then pop: ``--consumers`` (8) processes share the topic in one
   group, each ``pop(max_messages=--pop)`` (5,000: the same batching), read the bodies (``bodies()``),
   ``ack`` the result (one handle a run), until the topic is drained. A second topic is drained the
   same way with ``--small-pop`` (500) per pop, printed beside, twice: with an Ack call per pop, and
   with each pop carrying the acks of the one before (``pop(ack=...)``, one call instead of two;
   target: >= 30% of the plain pull rate, issue 40); small batches pay per call (pops and acks of
   the consumers that reach the master together share one ``__pop`` record). The carried phase
   runs ``--rounds`` (5) times, each round a plain pull of the first topic again and then a fresh
   group draining the carried topic: the figure is the median of the rounds' own ratios (a pull
   phase lasts under a second, and the machine drifts; one pair of phases swung 0.25-0.38x). Every (queue, offset) is
   counted: lost = never acked, duplicates = delivered more than once (only a lease that expired
   may cause one: its count is printed beside). Target: pop + ack >= 30% of the plain pull rate.
2. A fresh daemon, ``--inflight`` (1,000,000) small messages, all popped and none acked (one-hour
   leases). The daemon's RSS (target <= 300 MB) and, after kill -9, its time to serve again (target
   <= 2 s); then every message must still be leased (none poppable, describe shows them in flight).

Usage: .venv/bin/python bench/pop.py [--quick] [--messages 200000] [--inflight 1000000]
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import common
import load
import numpy as np
from common import KiB, MiB, Results, log

from broker.client import BrokerClient

TOPIC = "bench-pop"
BATCH = 5000  # messages per pull, and per pop unless --pop says otherwise: the same client batching
QUEUES = 4
GROUP = "bench"


def puller(address: str, queue_id: int, end: int, start_at: float, out: Any) -> None:
    n = 0
    with BrokerClient(address) as c:
        c.pull(TOPIC, queue_id, 0, max_messages=1)
        load.wait_until(start_at)
        t0 = time.perf_counter()
        offset = 0
        while offset < end:
            r = c.pull(TOPIC, queue_id, offset, max_messages=BATCH)
            n += sum(1 for _ in r.bodies())
            offset = r.next_offset
        out.put({"messages": n, "seconds": time.perf_counter() - t0})


def popper(address: str, topic: str, group: str, batch: int, invisible_ms: int, carry: bool, start_at: float,
           out: Any) -> None:
    """Pop, read the bodies, ack: with an Ack call per pop, or (``carry``) each pop carrying the acks
    of the one before (``pop(ack=...)``), the last one acked by the pop that finds nothing."""
    runs: list[tuple[int, int, int, int]] = []  # (queue, first offset, count, delivery count)
    refused = 0
    n = 0
    with BrokerClient(address) as c:
        load.wait_until(start_at)
        t0 = time.perf_counter()
        previous = None
        while True:
            msgs = c.pop(group, topic, max_messages=batch, invisible_ms=invisible_ms, max_wait_ms=300, start="earliest",
                         ack=previous if carry else None)
            refused += len(msgs.ack_failures)
            if not msgs:
                break
            n += sum(1 for _ in msgs.bodies())
            runs += [(r.queue_id, r.first_offset, r.count, r.delivery_count) for r in msgs.runs]
            if carry:
                previous = msgs
            else:
                refused += len(c.ack(group, msgs))
        out.put({"runs": runs, "messages": n, "refused": refused, "seconds": time.perf_counter() - t0 - 0.3})


def throughput(res: Results, a: Any, work: str) -> None:
    with common.running_daemon(work, "tp") as d, BrokerClient(d.address) as c:
        filled(c, d.address, TOPIC, a)
        ends = c.list_topics()[TOPIC]["max_offsets"]
        total = sum(ends)
        pull_rate = pull_phase(d.address, ends)
        res.add("plain pull, 4 processes (one per queue)", pull_rate, "msg/s", note=f"{total:,} msgs of {a.body} B")
        pop_rate = pop_phase(res, a, d.address, TOPIC, total, a.pop).rate
        target, ok = common.at_least(pop_rate / pull_rate, 0.30)
        res.add("pop + ack / plain pull (same batch size)" if a.pop == BATCH else "pop + ack / plain pull",
                pop_rate / pull_rate, "x", target=target, ok=ok)
        if not a.small_pop:
            return
        # how far a smaller batch falls: per call costs (one RPC, one record each way)
        small = pop_phase(res, a, d.address, filled(c, d.address, f"{TOPIC}-small", a), total, a.small_pop).rate
        res.add(f"pop + ack / plain pull, {a.small_pop} per pop, one Ack call per pop", small / pull_rate, "x")
        topic = filled(c, d.address, f"{TOPIC}-small-carried", a)
        rounds: list[tuple[float, Drained]] = []
        for i in range(a.rounds):  # each round: pulls again, then a fresh group drains the topic
            pulls = pull_phase(d.address, ends)
            pops = pop_phase(None, a, d.address, topic, total, a.small_pop, carry=True, group=f"{GROUP}-r{i + 1}")
            rounds.append((pulls, pops))
            log(f"round {i + 1}: plain pulls {pulls:,.0f} msg/s, carried pops {pops.rate:,.0f} msg/s "
                f"= {pops.rate / pulls:.2f}x")
        add_rows(res, a, [pops for _, pops in rounds], a.small_pop, True)
        ratio = float(np.median([pops.rate / pulls for pulls, pops in rounds]))
        target, ok = common.at_least(ratio, 0.30)
        res.add(f"pop + ack / plain pull, {a.small_pop} per pop, acks carried by the next pop", ratio, "x",
                target=target, ok=ok, note=f"median of {len(rounds)} rounds (pops/pulls msg/s): " + ", ".join(
                    f"{pops.rate:,.0f}/{pulls:,.0f}" for pulls, pops in rounds))


def filled(c: BrokerClient, address: str, topic: str, a: Any) -> str:
    """``topic`` created with ``QUEUES`` queues and ``a.messages`` messages, every view applied."""
    c.create_topic(topic, queues=QUEUES)
    load.fill(address, topic, load.halves(a.messages), 1000, a.body)
    common.wait_applied(c)
    return topic


def pull_phase(address: str, ends: list[int]) -> float:
    """One process per queue reads ``TOPIC`` from its start to ``ends``; the aggregate msg/s."""
    start_at = time.time() + 2.0  # every process connected, then all start at once
    rs = load.run_processes(puller, [(address, q, ends[q], start_at) for q in range(QUEUES)], timeout_s=1800)
    return sum(r["messages"] for r in rs) / max(r["seconds"] for r in rs)


@dataclass
class Drained:
    """What one pop phase measured."""

    rate: float  # distinct messages a second
    lost: int
    dups: int
    redelivered: int  # delivered again after a lease expired (the only duplicates allowed)
    refused: int  # acks refused
    counted: bool  # the consumers' message counts agree with the runs they reported


def pop_phase(res: Results | None, a: Any, address: str, topic: str, total: int, batch: int, carry: bool = False,
              group: str = GROUP) -> Drained:
    """``a.consumers`` poppers drain ``topic`` (``total`` messages) in ``group``; their rows are
    added to ``res`` (None: the caller adds them)."""
    start_at = time.time() + 2.0
    rs = load.run_processes(popper, [(address, topic, group, batch, a.invisible_ms, carry, start_at)] * a.consumers,
                            timeout_s=1800)
    seconds = max(r["seconds"] for r in rs)
    runs = [run for r in rs for run in r["runs"]]
    seen = np.concatenate([q * (1 << 40) + np.arange(first, first + n, dtype=np.int64) for q, first, n, _ in runs])
    distinct = int(np.unique(seen).size)
    got = Drained(distinct / seconds, total - distinct, int(seen.size) - distinct,
                  sum(n for _, _, n, count in runs if count > 1), sum(r["refused"] for r in rs),
                  sum(r["messages"] for r in rs) == seen.size)
    if res is not None:
        add_rows(res, a, [got], batch, carry)
    return got


def add_rows(res: Results, a: Any, phases: list[Drained], batch: int, carry: bool) -> None:
    """The rows of one pop phase, or the counts of several summed (rounds: their rates are in the
    note of their ratio)."""
    how = ("acks carried by the next pop" if carry else "one Ack call per pop") + (
        f", all {len(phases)} rounds" if len(phases) > 1 else "")
    lost, dups = sum(p.lost for p in phases), sum(p.dups for p in phases)
    redelivered = sum(p.redelivered for p in phases)
    res.add(f"lost (never acked), {batch} per pop, {how}", lost, "msgs", target="0",
            ok=lost == 0 and all(p.counted for p in phases))
    res.add(f"delivered twice, {batch} per pop, {how}", dups, "msgs", note=f"redelivered after a lease expired: "
            f"{redelivered}; refused acks: {sum(p.refused for p in phases)}", target="only after an expiry",
            ok=dups <= redelivered)
    if len(phases) == 1:
        res.add(f"pop + ack, {a.consumers} consumers on {QUEUES} queues, {how}", phases[0].rate, "msg/s",
                note=f"{batch} per pop, bodies read, one handle a run")


def inflight(res: Results, a: Any, work: str) -> None:
    with common.running_daemon(work, "leases") as d:
        assert d.proc is not None
        with BrokerClient(d.address) as c:
            c.create_topic(TOPIC, queues=QUEUES)
            load.fill(d.address, TOPIC, load.halves(a.inflight), 1000, 100)
            common.wait_applied(c)
            rss_before = common.rss_anon_of(d.proc.pid)
            leased = 0
            t0 = time.perf_counter()
            while leased < a.inflight:
                got = c.pop(GROUP, TOPIC, max_messages=10_000, invisible_ms=3_600_000, start="earliest")
                if not got:
                    break
                leased += len(got)
            pop_s = time.perf_counter() - t0
            log(f"{leased:,} leased in {pop_s:.1f}s")
            time.sleep(6)  # a checkpoint of the views
            rss = common.rss_anon_of(d.proc.pid)
            target, ok = common.at_most(rss / MiB, 300)
            res.add(f"RSS with {leased:,} leases in flight", rss / MiB, "MiB", target=target, ok=ok,
                    note=f"{rss_before / MiB:.0f} MiB before the pops")
        d.kill9()
        took = common.start_timed(d)
        target, ok = common.at_most(took, 2.0)
        res.add(f"restart after kill -9 with {leased:,} leases", took, "s", target=target, ok=ok)
        with BrokerClient(d.address) as c:
            in_flight = sum(q["in_flight"] for q in c.describe_group(GROUP)["queues"])
            again = len(c.pop(GROUP, TOPIC, max_messages=1000))
            res.add("leases kept across the crash", in_flight, "msgs", target=f"= {leased:,}, none poppable",
                    ok=in_flight == leased and again == 0)


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=400_000)
    p.add_argument("--inflight", type=int, default=1_000_000)
    p.add_argument("--body", type=int, default=KiB)
    p.add_argument("--consumers", type=int, default=8)
    p.add_argument("--pop", type=int, default=BATCH, help="max_messages per pop (default: as many as per pull)")
    p.add_argument("--small-pop", type=int, default=500, help="a second pop phase with this many per pop (0: none)")
    p.add_argument("--invisible-ms", type=int, default=60_000)
    p.add_argument("--rounds", type=int, default=5, help="rounds of plain pulls and carried pops at --small-pop")
    a = p.parse_args()
    if a.quick:
        a.messages, a.inflight, a.rounds = 20_000, 100_000, 1
    res = Results("pop", a.results, {"messages": a.messages, "inflight": a.inflight, "consumers": a.consumers,
                                     "pop": a.pop})
    common.preflight(res, a.max_wait_quiet)
    with common.temp_dir("tm-pop-", a.workdir) as work:
        throughput(res, a, work)
        inflight(res, a, work)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
