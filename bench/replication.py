"""Replication: ack=replica vs ack=flush, lag at half load, metadata visibility, empty-slave bootstrap vs Redis.

Every Tidemark figure comes from a master with one slave attached (two ``tidemark serve`` processes on
loopback, default configuration, fresh temp directories):

1. Send throughput, ack=replica against ack=flush on the same pair: ``--producers`` processes, each
   with its own ``BrokerClient``, each ``send()`` carrying ``--batch`` keyless 1 KiB messages (the same
   shape as bench/send_throughput.py). Each round measures both modes, the order alternating, each
   window on a new pair: a pair's second window ran slower than its first (its log several GB
   long, the page cache full), so with both modes on one pair the ratio leaned towards whichever
   mode ran first, and with an odd number of rounds that was ack=flush twice out of three (in 11
   such rounds, 2026-11-26: ack=replica / ack=flush 0.92 when ack=flush ran first, 0.99 when
   ack=replica did). Figures are medians over ``--rounds``. While it runs the
   master's ``status()`` is sampled every 100 ms: if the slave ever leaves the in-sync set, ack=replica
   confirms without it (min_insync_replicas=1) and the figure is flagged.
2. Replication lag at half of the maximum load: the same producers with ack=leader, rate-limited to 50%
   of the median ack=flush rate of part 1. Every acknowledged send is timed from its ack until the
   slave's ``status()["max_offset"]`` passes the receipt's ``commit_offset`` (the slave is polled every
   ``--poll-ms``; the first poll that shows it ends the interval, so the figure is an upper bound
   within one poll). The same is reported up to the slave's ``flushed_offset`` (fsynced there), and
   the master's sampled ``replicas[0]["lag_bytes"]``.
3. Metadata visibility: create a topic on the master / commit a consumer offset on the master, then
   poll the slave (``list_topics()`` / ``committed_offset()``, every 1 ms) until it shows it; a random
   pause of 0-100 ms before each sample spreads them over the offsets' flush interval
   (``offsets.flush_interval_ms``, 100 ms by design: a commit is buffered that long before it is
   written to the log at all). Topic times run from the CreateTopic call on the master (which itself
   waits for ack=replica); the time after the call returned is reported in the note.
4. Empty-slave bootstrap: fill a master with ``--bootstrap-gib`` of log (4000 x 1 KiB per send,
   ack=leader; the log stays in the page cache unless ``--cold``), then start an empty slave and time
   from spawning its process until its ``max_offset`` and ``confirm_offset`` equal the master's (a
   snapshot bundle, which carries the whole log [L, S), then the stream). Then Redis 7 with the same
   volume: two ``redis-server`` (bench/common.py ``RedisServer``, AOF everysec, no RDB saves) on
   loopback, ``repl-diskless-sync no``, the primary filled with pipelined ``SET`` of 1 KiB values
   (incompressible), then ``REPLICAOF`` on the second, timed until ``master_link_status:up``, no sync
   in progress and the replica's ``DBSIZE`` equal to the primary's. Rates are bytes moved (Tidemark:
   log bytes; Redis: the RDB file) per second; the ratio is Tidemark MB/s / Redis MB/s.

Before measuring (and before each part) the script waits until no other benchmark script (a process
running ``bench/*.py``), daemon, test run or redis-server is alive and the CPUs are quiet.
``--profile-dir DIR`` records py-spy stacks (raw/collapsed format) of master and slave during the
first ack=replica window and during the bootstrap.

Usage: .venv/bin/python bench/replication.py [--quick] [--only throughput,lag,metadata,bootstrap]
       [--rounds 3] [--seconds 15] [--bootstrap-gib 1] [--skip-redis] [--profile-dir DIR]
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import json
import os
import random
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import common
import load
import redis
from common import GiB, KiB, MiB, Results, log
from measure import CpuTimes, Sampler, Spy, quantile, redo_while_disturbed

from broker.client import BrokerClient, BrokerError, Message
from tests.procs import DaemonProcess

TOPIC = "bench-repl"
QUEUES = 4
PARTS = ("throughput", "lag", "metadata", "bootstrap")
REPLICA_TARGET = 0.95  # ack=replica >= 95% of ack=flush (issue 18; the round table reads the same goal)
LAG_P99_TARGET_MS = 20.0  # issue 18
VISIBILITY_P99_TARGET_MS = 200.0
BOOTSTRAP_TARGET_MBS = 150.0
REDIS_RATIO_TARGET = 6.0  # bootstrap vs Redis full sync (issue 18)
FILL_BATCH = 4000  # messages per send while filling the bootstrap master (4 MiB requests)
REDIS_PIPELINE = 1000


def wait_for_quiet(a: Any) -> dict[str, Any]:
    """No other benchmark script alive (bounded wait), then no daemons, test runs or CPU load."""
    return common.wait_for_quiet(a.max_wait_quiet, other_benches=True)


# -- a master and its slave ------------------------------------------------------------------------
def _in_sync(master: str) -> bool:
    reps = common.status(master).get("replicas") or []
    return bool(reps) and all(r["in_sync"] for r in reps)


def _caught_up(master: str, slave: str) -> bool:
    sm, ss = common.status(master), common.status(slave)
    return int(ss["max_offset"]) == int(sm["max_offset"]) and int(ss["confirm_offset"]) == int(sm["confirm_offset"])


def _wait_caught_up(m: DaemonProcess, s: DaemonProcess, timeout_s: float, what: str = "the slave to catch up") -> None:
    common.wait_for(lambda: _caught_up(m.address, s.address), timeout_s, what)


@contextlib.contextmanager
def running_pair(workdir: str, label: str) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    """A master and a slave following it (default configuration), the slave in sync; both killed at exit."""
    with common.temp_dir(f"tm-repl-{label}-", workdir) as wd, common.running_daemon(wd, "master") as m, \
            common.running_daemon(wd, "slave", {"node.role": "slave", "node.master": m.address}) as s:
        common.wait_for(lambda: _in_sync(m.address), 60, "the slave to join the in-sync set")
        yield m, s


def run_load(m: DaemonProcess, s: DaemonProcess, ack: str, producers: int, batch: int, body: int, warmup_s: float,
             seconds: float, sends_per_s: float = 0.0, samplers: list[Sampler] | None = None,
             spy_prefix: str = "") -> dict[str, Any]:
    """One window of ``producers`` processes against master ``m`` (``load.window_producer``; with
    ``sends_per_s`` > 0 on a fixed schedule, phases spread over the processes); CPU of both daemons;
    samplers run from the window's start until every producer has reported."""
    assert m.proc is not None and s.proc is not None
    mpid, spid = m.proc.pid, s.proc.pid
    per_proc = sends_per_s / producers if sends_per_s else 0.0
    args = [(m.address, TOPIC, QUEUES, ack, batch, body, per_proc, i / producers) for i in range(producers)]
    samplers = samplers or []
    spies: list[Spy] = []

    def at_start() -> None:
        for smp in samplers:
            smp.start()
        if spy_prefix:
            spies.extend([Spy(mpid, f"{spy_prefix}-master.txt", seconds), Spy(spid, f"{spy_prefix}-slave.txt", seconds)])

    try:
        w = load.run_window(load.window_producer, args, warmup_s, seconds, watch=[mpid, spid], at_start=at_start)
    except Exception:
        for smp in samplers:
            smp.stop()
        raise
    finally:
        for spy in spies:
            spy.stop()
    cpu = w["cpu"]
    master_cpu, slave_cpu = cpu.procs[mpid] / seconds, cpu.procs[spid] / seconds
    machine_cpu = cpu.machine / seconds
    return {
        "count": w["count"],
        "window_s": w["window_s"],
        "rate": w["rate"],
        "p50_ms": 1000 * quantile(w["latencies"], 0.5),
        "p99_ms": 1000 * quantile(w["latencies"], 0.99),
        "master_cpu": master_cpu,
        "slave_cpu": slave_cpu,
        "client_cpu": w["client_cpu"],
        "bench_cpu": cpu.own / seconds,
        "machine_cpu": machine_cpu,
        "other_cpu": max(0.0, cpu.other_seconds() / seconds - w["client_cpu"]),
        "acked": w["acked"],
        "window_start": w["window_start"],
    }


def _replica_probe(address: str) -> Callable[[], Any]:
    client = BrokerClient(address)

    def probe() -> Any:
        reps = client.status().get("replicas") or []
        return (bool(reps) and all(r["in_sync"] for r in reps), max((int(r["lag_bytes"]) for r in reps), default=0))

    return probe


# -- part 1: ack=replica vs ack=flush --------------------------------------------------------------
def throughput_window(a: Any, m: DaemonProcess, s: DaemonProcess, ack: str, round_no: int, attempt: int) -> dict[str, Any]:
    """One ack=``ack`` window on a caught-up pair; the master's view of the slave (in sync? lag) every 100 ms."""
    _wait_caught_up(m, s, 120)
    sampler = Sampler(_replica_probe(m.address), 0.1)
    spy = ""
    if a.profile_dir and round_no == 1 and ack == "replica":
        spy = os.path.join(a.profile_dir, f"ack-replica-{attempt}")
    log(f"round {round_no}: ack={ack}: {a.producers} producer processes x {a.batch} msgs/send, {a.seconds}s window")
    r = run_load(m, s, ack, a.producers, a.batch, a.body, a.warmup, a.seconds, samplers=[sampler], spy_prefix=spy)
    sampler.stop()
    flags = [x for _, x in sampler.samples]
    r["in_sync_fraction"] = sum(1 for ok, _ in flags if ok) / len(flags) if flags else 0.0
    r["lag_bytes_max"] = max((lb for _, lb in flags), default=0)
    r["lag_bytes_p50"] = quantile([float(lb) for _, lb in flags], 0.5)
    return r


def part_throughput(res: Results, a: Any, workdir: str) -> float:
    runs: dict[str, list[dict[str, Any]]] = {"flush": [], "replica": []}
    for round_no in range(1, a.rounds + 1):
        order = ["flush", "replica"] if round_no % 2 else ["replica", "flush"]
        for ack in order:
            with running_pair(workdir, f"tput{round_no}{ack}") as (m, s):  # a fresh pair per window (see above)
                with BrokerClient(m.address) as c:
                    c.create_topic(TOPIC, queues=QUEUES)
                r = redo_while_disturbed(functools.partial(throughput_window, a, m, s, ack, round_no),
                                         lambda: wait_for_quiet(a))
                log(f"round {round_no}: ack={ack}: {r['rate']:,.0f} msg/s, p50 {r['p50_ms']:.0f} ms p99 {r['p99_ms']:.0f} ms "
                    f"per send; CPU master {r['master_cpu']:.2f} slave {r['slave_cpu']:.2f} clients {r['client_cpu']:.2f} "
                    f"machine {r['machine_cpu']:.2f} (others {r['other_cpu']:.2f}); slave in sync {r['in_sync_fraction']:.0%} of samples, "
                    f"lag p50 {r['lag_bytes_p50'] / MiB:.1f} MiB max {r['lag_bytes_max'] / MiB:.1f} MiB")
                runs[ack].append(r)
                m.stop()
                s.stop()
    median: dict[str, float] = {}
    for ack, rs in runs.items():
        rates = [r["rate"] for r in rs]
        median[ack] = statistics.median(rates)
        mid = sorted(rs, key=lambda r: r["rate"])[len(rs) // 2]
        insync = min(r["in_sync_fraction"] for r in rs)
        note = (f"median of {len(rates)}: " + " / ".join(f"{x:,.0f}" for x in rates)
                + f"; p50 {mid['p50_ms']:.0f} ms p99 {mid['p99_ms']:.0f} ms per send of {a.batch}; CPU master "
                f"{mid['master_cpu']:.2f}, slave {mid['slave_cpu']:.2f}, clients {mid['client_cpu']:.2f}, machine "
                f"{mid['machine_cpu']:.2f} cores; slave in sync in {insync:.0%} of samples (min over rounds), "
                f"lag max {max(r['lag_bytes_max'] for r in rs) / MiB:.0f} MiB; max other {max(r['other_cpu'] for r in rs):.2f} cores")
        if ack == "replica" and insync < 1.0:
            note = "SLAVE LEFT THE IN-SYNC SET: ack=replica confirmed without it part of the time; " + note
        res.add(f"master+slave ack={ack}", median[ack], "msg/s", note=note, rates=rates, p50_ms=mid["p50_ms"],
                p99_ms=mid["p99_ms"], master_cpu_cores=mid["master_cpu"], slave_cpu_cores=mid["slave_cpu"],
                client_cpu_cores=mid["client_cpu"], machine_cpu_cores=mid["machine_cpu"], in_sync_fraction=insync,
                other_cpu_cores=[r["other_cpu"] for r in rs], in_sync_fractions=[r["in_sync_fraction"] for r in rs],
                lag_bytes_p50=[r["lag_bytes_p50"] for r in rs], lag_bytes_max=[r["lag_bytes_max"] for r in rs])
        res.add(f"master+slave ack={ack} MB/s", median[ack] * a.body / 1e6, "MB/s", note="payload bytes only")
    ratio = median["replica"] / median["flush"] if median["flush"] else 0.0
    paired = [r["rate"] / f["rate"] for r, f in zip(runs["replica"], runs["flush"], strict=True) if f["rate"]]
    insync_all = min(r["in_sync_fraction"] for r in runs["replica"])
    target, ok = common.at_least(ratio, REPLICA_TARGET)
    res.add("ratio ack=replica / ack=flush", ratio, "x", target=target, ok=ok and insync_all >= 1.0,
            note="of the medians; per round: " + " / ".join(f"{x:.2f}" for x in paired)
                 + ("" if insync_all >= 1.0 else "; INVALID: the slave left the in-sync set during ack=replica"),
            paired=paired)
    return median["flush"]


# -- part 2: replication lag at half load -----------------------------------------------------------
def _lags(acked: list[tuple[float, int]], samples: list[tuple[float, Any]], field: int) -> list[float | None]:
    """Per acked send: seconds from its ack until the first sample whose offset ``field`` passed it (None: never)."""
    times = [t for t, _ in samples]
    offsets = [v[field] for _, v in samples]
    for i in range(1, len(offsets)):  # offsets never go back; guard against a reordered sample anyway
        offsets[i] = max(offsets[i], offsets[i - 1])
    out: list[float | None] = []
    for t_ack, off in acked:
        i = bisect.bisect_right(offsets, off)  # first sample with offset > off
        out.append(max(0.0, times[i] - t_ack) if i < len(times) else None)
    return out


def part_lag(res: Results, a: Any, workdir: str, max_flush_rate: float) -> None:
    with running_pair(workdir, "lag") as (m, s):
        with BrokerClient(m.address) as c:
            c.create_topic(TOPIC, queues=QUEUES)
        source = "part 1 (median ack=flush on a pair)"
        if not max_flush_rate:
            source = "a 10 s ack=flush window on this pair"
            log("lag: measuring the maximum ack=flush rate on this pair first")
            max_flush_rate = run_load(m, s, "flush", a.producers, a.batch, a.body, a.warmup, min(10.0, a.seconds))["rate"]
            _wait_caught_up(m, s, 120)
        target_rate = 0.5 * max_flush_rate
        sends_per_s = target_rate / a.batch
        slave_client = BrokerClient(s.address)
        master_client = BrokerClient(m.address)

        def slave_probe() -> tuple[int, int]:
            st = slave_client.status()
            return int(st["max_offset"]), int(st["flushed_offset"])

        def master_probe() -> tuple[int, int]:
            reps = master_client.status().get("replicas") or [{"lag_bytes": -1, "acked_offset": -1}]
            return int(reps[0]["lag_bytes"]), int(reps[0]["acked_offset"])

        def lag_window(attempt: int) -> dict[str, Any]:
            _wait_caught_up(m, s, 120)
            slave_sampler = Sampler(slave_probe, a.poll_ms / 1000.0)
            master_sampler = Sampler(master_probe, 0.01)
            log(f"lag: ack=leader at 50% of {max_flush_rate:,.0f} msg/s = {target_rate:,.0f} msg/s "
                f"({sends_per_s:.1f} sends/s of {a.batch}), {a.lag_seconds}s window; slave polled every {a.poll_ms} ms")
            spy = os.path.join(a.profile_dir, f"lag-{attempt}") if a.profile_dir else ""
            r = run_load(m, s, "leader", a.producers, a.batch, a.body, a.warmup, a.lag_seconds, sends_per_s=sends_per_s,
                         samplers=[slave_sampler, master_sampler], spy_prefix=spy)
            _wait_caught_up(m, s, 60, "the slave to catch up after the lag window")
            time.sleep(0.1)
            slave_sampler.stop()
            master_sampler.stop()
            r["slave_samples"], r["master_samples"] = slave_sampler.samples, master_sampler.samples
            return r

        r = redo_while_disturbed(lag_window, lambda: wait_for_quiet(a))
        slave_client.close()
        master_client.close()
        m.stop()
        s.stop()
    acked, slave_samples, master_samples = r["acked"], r["slave_samples"], r["master_samples"]
    per_send_a = _lags(acked, slave_samples, 0)
    per_send_f = _lags(acked, slave_samples, 1)
    appended = [x for x in per_send_a if x is not None]
    flushed = [x for x in per_send_f if x is not None]
    miss_a, miss_f = len(per_send_a) - len(appended), len(per_send_f) - len(flushed)
    if a.dump_lags:

        with open(a.dump_lags, "w") as f:
            json.dump({"window_start": r["window_start"], "sends": [[t - r["window_start"], off, la, lf] for (t, off), la, lf
                                                                    in zip(acked, per_send_a, per_send_f, strict=True)],
                       "slave_samples": [[t - r["window_start"], *v] for t, v in slave_samples],
                       "master_samples": [[t - r["window_start"], *v] for t, v in master_samples]}, f)
        log(f"lag: per-send lags written to {a.dump_lags}")
    gaps = [b[0] - a_[0] for a_, b in itertools.pairwise(slave_samples)]
    lag_bytes = [float(v[0]) for t, v in master_samples if v[0] >= 0 and t <= r["window_start"] + a.lag_seconds]
    resolution = 1000 * statistics.median(gaps) if gaps else 0.0
    common_params = {"offered_msgs_per_s": target_rate, "achieved_msgs_per_s": r["rate"], "max_flush_rate": max_flush_rate,
                     "sends": len(acked), "poll_resolution_ms": resolution, "missing": miss_a, "other_cpu_cores": r["other_cpu"],
                     "lags_over_50ms": sum(1 for x in appended if x > 0.05)}
    note = (f"{len(appended)} sends of {a.batch} x {a.body} B, ack=leader at {r['rate']:,.0f} msg/s (50% of {max_flush_rate:,.0f} "
            f"from {source}); ack -> slave max_offset passes the receipt; slave polled every {resolution:.1f} ms "
            f"(median gap); CPU master {r['master_cpu']:.2f} slave {r['slave_cpu']:.2f} machine {r['machine_cpu']:.2f} "
            f"(others {r['other_cpu']:.2f})")
    if miss_a:
        note = f"{miss_a} sends never seen on the slave; " + note
    res.add("replication lag p50 at 50% load", 1000 * quantile(appended, 0.5), "ms", note=note, **common_params)
    target, ok = common.at_most(1000 * quantile(appended, 0.99), LAG_P99_TARGET_MS)
    res.add("replication lag p99 at 50% load", 1000 * quantile(appended, 0.99), "ms", target=target, ok=ok and not miss_a,
            note=f"max {1000 * max(appended, default=0):.1f} ms, {common_params['lags_over_50ms']} sends over 50 ms; " + note,
            **common_params)
    res.add("replication lag to slave fsync p50", 1000 * quantile(flushed, 0.5), "ms",
            note="ack -> slave flushed_offset passes the receipt (durable on the slave)", missing=miss_f)
    res.add("replication lag to slave fsync p99", 1000 * quantile(flushed, 0.99), "ms",
            note=f"max {1000 * max(flushed, default=0):.1f} ms", missing=miss_f)
    res.add("master lag_bytes sampled p99 at 50% load", quantile(lag_bytes, 0.99) / KiB, "KiB",
            note=f"master status replicas[0].lag_bytes every 10 ms, {len(lag_bytes)} samples; p50 "
                 f"{quantile(lag_bytes, 0.5) / KiB:,.0f} KiB, max {max(lag_bytes, default=0) / KiB:,.0f} KiB")


# -- part 3: metadata visibility on the slave ---------------------------------------------------------
def _poll_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> float | None:
    """time.monotonic() when ``cond`` first held (polled back to back with 1 ms pauses), None on timeout."""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return time.monotonic()
        except BrokerError:  # e.g. NOT_FOUND: the slave has not applied the topic yet
            pass
        time.sleep(0.001)
    return None


def part_metadata(res: Results, a: Any, workdir: str) -> None:
    rng = random.Random(42)
    with running_pair(workdir, "meta") as (m, s), BrokerClient(m.address) as cm, BrokerClient(s.address) as cs:
        assert m.proc is not None and s.proc is not None
        pids = m.proc.pid, s.proc.pid
        cpu0 = CpuTimes.now(*pids)
        # topics
        from_call: list[float] = []
        from_return: list[float] = []
        failed = 0
        log(f"metadata: {a.samples} topic creations on the master, polling the slave's list_topics()")
        for i in range(a.samples):
            time.sleep(rng.uniform(0.0, 0.1))
            name = f"vis-{i:05d}"
            t0 = time.monotonic()
            cm.create_topic(name)
            t1 = time.monotonic()
            t2 = _poll_until(lambda name=name: name in cs.list_topics())
            if t2 is None:
                failed += 1
                continue
            from_call.append(t2 - t0)
            from_return.append(max(0.0, t2 - t1))
        other = (CpuTimes.now(*pids) - cpu0).other_cores()
        target, ok = common.at_most(1000 * quantile(from_call, 0.99), VISIBILITY_P99_TARGET_MS)
        note = (f"{len(from_call)} samples, CreateTopic call on the master -> in the slave's list_topics(); after the "
                f"call returned: p50 {1000 * quantile(from_return, 0.5):.1f} ms p99 {1000 * quantile(from_return, 0.99):.1f} ms; "
                f"other processes {other:.2f} cores")
        if failed:
            note = f"{failed} NEVER VISIBLE within 10 s; " + note
        res.add("topic create visible on slave p50", 1000 * quantile(from_call, 0.5), "ms", note=note, samples=len(from_call))
        res.add("topic create visible on slave p99", 1000 * quantile(from_call, 0.99), "ms", target=target,
                ok=ok and not failed, note=f"max {1000 * max(from_call, default=0):.1f} ms; " + note,
                samples=len(from_call), failed=failed)

        # consumer offsets
        topic = "vis-offsets"
        cm.create_topic(topic)
        body = [Message(body=b"o" * 100)] * 1000
        for _ in range((a.samples + 999) // 1000):
            cm.send(topic, body, ack="replica")
        _wait_caught_up(m, s, 60)
        vis: list[float] = []
        failed = 0
        log(f"metadata: {a.samples} offset commits on the master, polling the slave's committed_offset()")
        cpu0 = CpuTimes.now(*pids)
        for i in range(1, a.samples + 1):
            time.sleep(rng.uniform(0.0, 0.1))
            t0 = time.monotonic()
            cm.commit_offset("bench-group", topic, 0, i)
            t2 = _poll_until(lambda i=i: cs.committed_offset("bench-group", topic, 0) == i)
            if t2 is None:
                failed += 1
                continue
            vis.append(t2 - t0)
        target, ok = common.at_most(1000 * quantile(vis, 0.99), VISIBILITY_P99_TARGET_MS)
        other = (CpuTimes.now(*pids) - cpu0).other_cores()
        note = (f"{len(vis)} samples, CommitOffset call on the master -> the slave's committed_offset() returns it; "
                f"includes the master's offsets.flush_interval_ms=100 buffering; other processes {other:.2f} cores")
        if failed:
            note = f"{failed} NEVER VISIBLE within 10 s; " + note
        res.add("offset commit visible on slave p50", 1000 * quantile(vis, 0.5), "ms", note=note, samples=len(vis))
        res.add("offset commit visible on slave p99", 1000 * quantile(vis, 0.99), "ms", target=target, ok=ok and not failed,
                note=f"max {1000 * max(vis, default=0):.1f} ms; " + note, samples=len(vis), failed=failed)
        m.stop()
        s.stop()


# -- part 4: empty-slave bootstrap against a Redis full sync --------------------------------------------
def _fill_tidemark(address: str, volume: int) -> float:
    t0 = time.monotonic()
    with BrokerClient(address, timeout_s=120) as c:
        c.create_topic(TOPIC, queues=QUEUES)
        pool = os.urandom(1 << 20)
        batch = [Message(body=pool[i * 97 % (len(pool) - KiB):][:KiB]) for i in range(FILL_BATCH)]
        end = 0
        while end < volume:
            end = c.send(TOPIC, batch, ack="leader")[-1].commit_offset
    return time.monotonic() - t0


def _log_value(path: str, event: str, key: str) -> str:
    """The last ``key=value`` of a console log line naming ``event`` ('' if none)."""
    try:
        with open(path, errors="replace") as f:
            lines = [line for line in f if event in line]
    except OSError:
        return ""
    if not lines:
        return ""
    found = re.search(rf"\b{key}=(\S+)", re.sub(r"\x1b\[[0-9;]*m", "", lines[-1]))
    return found.group(1) if found else ""


def bootstrap_tidemark(a: Any, workdir: str, volume: int) -> dict[str, Any]:
    with common.temp_dir("tm-repl-boot-", workdir) as wd, common.running_daemon(wd, "master") as m:
        assert m.proc is not None
        fill_s = _fill_tidemark(m.address, volume)
        log(f"bootstrap: master filled in {fill_s:.1f}s; waiting for it to be idle (flushed, applied, checkpointed)")

        def idle() -> bool:
            st = common.status(m.address)
            return int(st["max_offset"]) == int(st["flushed_offset"]) == int(st["confirm_offset"]) == int(st["applied_offset"])

        common.wait_for(idle, 120, "the master to be idle")
        time.sleep(2.0)  # a checkpoint interval (1 s) and then some
        st = common.status(m.address)
        log_bytes = int(st["max_offset"]) - int(st["min_offset"])

        def bootstrap(attempt: int) -> dict[str, Any]:
            if a.cold:
                evicted = common.evict_page_cache(m.data_dir)
                log(f"bootstrap: evicted {evicted / MiB:,.0f} MiB of the master's files from the page cache")
            quiet = wait_for_quiet(a)
            out = _bootstrap_once(a, wd, m, attempt, log_bytes)
            out.update(fill_s=fill_s, quiet=quiet, attempts=attempt)
            return out

        out = redo_while_disturbed(bootstrap)
        m.stop()
        return out


def _bootstrap_once(a: Any, wd: str, m: DaemonProcess, attempt: int, log_bytes: int) -> dict[str, Any]:
    """Start an empty slave of ``m``, time it until converged, check both logs hold the same bytes, stop it."""
    assert m.proc is not None
    s = DaemonProcess(os.path.join(wd, f"slave{attempt}"), config={"node.role": "slave", "node.master": m.address})
    spies: list[Spy] = []
    try:
        log(f"bootstrap: starting an empty slave of a master with {log_bytes / MiB:,.0f} MiB of log")
        cpu0 = CpuTimes.now(m.proc.pid)
        t0 = time.monotonic()
        s.start(wait=False)
        assert s.proc is not None
        if a.profile_dir:
            time.sleep(0.05)
            spies = [Spy(s.proc.pid, os.path.join(a.profile_dir, f"bootstrap-slave-{attempt}.txt")),
                     Spy(m.proc.pid, os.path.join(a.profile_dir, f"bootstrap-master-{attempt}.txt"))]
        ready_s = common.wait_serving(s, t0)
        with BrokerClient(m.address) as cm, BrokerClient(s.address) as cs:
            def converged() -> bool:
                sm, ss = cm.status(), cs.status()
                return sm["max_offset"] == ss["max_offset"] and sm["confirm_offset"] == ss["confirm_offset"]

            converged_s = common.wait_for(converged, 600, "the slave to converge", 0.02)
        total_s = time.monotonic() - t0
        cpu = CpuTimes.now(m.proc.pid, s.proc.pid) - cpu0  # the slave's from its start
        cpu_m, cpu_s, other = cpu.procs[m.proc.pid], cpu.procs[s.proc.pid], cpu.other_cores(total_s)
        for spy in spies:
            spy.stop()
        spies = []
        sm, ss = common.status(m.address), common.status(s.address)
        slave_log_bytes = common.dir_bytes(os.path.join(s.data_dir, "log"))
        master_log_bytes = common.dir_bytes(os.path.join(m.data_dir, "log"))
        if slave_log_bytes != master_log_bytes:
            raise RuntimeError(f"slave log holds {slave_log_bytes} bytes, the master's {master_log_bytes}")
        bundle_s = _log_value(s.log_path, "bootstrapped", "seconds")
        snapshot_offset = _log_value(s.log_path, "bootstrapped", "snapshot_offset")
        log(f"bootstrap: converged {total_s:.2f}s after spawning the slave ({log_bytes / total_s / 1e6:,.0f} MB/s): "
            f"serving after {ready_s:.2f}s (bundle {bundle_s or '?'}s), then {converged_s:.2f}s of streaming; "
            f"CPU master {cpu_m:.1f}s slave {cpu_s:.1f}s, other processes {other:.2f} cores")
        s.stop()
        return {"seconds": total_s, "ready_s": ready_s, "stream_s": converged_s, "bytes": float(log_bytes),
                "bundle_s": float(bundle_s or 0.0), "snapshot_offset": float(snapshot_offset or 0),
                "master_cpu_s": cpu_m, "slave_cpu_s": cpu_s, "other_cpu": other,
                "max_offset": float(sm["max_offset"]), "slave_min_offset": float(ss["min_offset"])}
    finally:
        for spy in spies:
            spy.stop()
        s.kill9()
        shutil.rmtree(s.data_dir, ignore_errors=True)
        shutil.rmtree(s.data_dir + ".bootstrap", ignore_errors=True)


def _fill_redis(port: int, keys: int) -> float:

    t0 = time.monotonic()
    r = redis.Redis(host="127.0.0.1", port=port)
    pool = os.urandom(1 << 20)
    for start in range(0, keys, REDIS_PIPELINE):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(keys, start + REDIS_PIPELINE)):
            at = i * 97 % (len(pool) - KiB)
            pipe.set(f"k{i:09d}", pool[at:at + KiB])
        pipe.execute()
    r.close()
    return time.monotonic() - t0


def bootstrap_redis(a: Any, workdir: str, volume: int) -> dict[str, Any]:

    primary = common.RedisServer(workdir, "everysec")
    try:
        primary.start()
        assert primary.proc is not None
        version = primary.version()
        p = redis.Redis(host="127.0.0.1", port=primary.port)
        p.config_set("repl-diskless-sync", "no")
        keys = volume // KiB
        log(f"redis {version}: filling the primary with {keys:,} SET of 1 KiB values (pipelines of {REDIS_PIPELINE})")
        fill_s = _fill_redis(primary.port, keys)

        def idle() -> bool:
            info = p.info("persistence")
            return not (info["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"] or info["rdb_bgsave_in_progress"])

        common.wait_for(idle, 300, "the Redis primary to finish background rewrites")
        dbsize = int(p.dbsize())
        used = int(p.info("memory")["used_memory"])

        def full_sync(attempt: int) -> dict[str, Any]:
            """REPLICAOF on a new replica, timed until it holds every key; the replica stopped again."""
            assert primary.proc is not None
            common.wait_for(idle, 300, "the Redis primary to finish background saves")
            replica = common.RedisServer(workdir, "everysec")
            try:
                replica.start()
                assert replica.proc is not None
                rr = redis.Redis(host="127.0.0.1", port=replica.port)
                rr.config_set("repl-diskless-load", "disabled")
                quiet = wait_for_quiet(a)
                log(f"redis: primary holds {dbsize:,} keys, used_memory {used / MiB:,.0f} MiB (filled in {fill_s:.1f}s); "
                    "REPLICAOF on a new replica")
                cpu0 = CpuTimes.now(primary.proc.pid, with_children=[primary.proc.pid])  # with its BGSAVE child
                t0 = time.monotonic()
                rr.replicaof("127.0.0.1", primary.port)

                def synced() -> bool:
                    try:
                        info = rr.info("replication")
                        if info.get("master_link_status") != "up" or info.get("master_sync_in_progress"):
                            return False
                        return int(rr.dbsize()) == dbsize
                    except redis.exceptions.BusyLoadingError:
                        return False

                common.wait_for(synced, 900, "the Redis replica full sync", 0.01)
                seconds = time.monotonic() - t0
                # the replica's children (the AOF rewrite) are not counted
                cpu = CpuTimes.now(primary.proc.pid, replica.proc.pid, with_children=[primary.proc.pid]) - cpu0
                cpu_p, cpu_r, other = cpu.procs[primary.proc.pid], cpu.procs[replica.proc.pid], cpu.other_cores(seconds)
                rdb_path = os.path.join(primary.dir, "dump.rdb")
                rdb_bytes = os.path.getsize(rdb_path) if os.path.exists(rdb_path) else 0
                replica_used = int(rr.info("memory")["used_memory"])
                rr.replicaof("NO", "ONE")
                rr.close()
            finally:
                t_stop = time.monotonic()
                replica.stop()
                log(f"redis: replica stopped in {time.monotonic() - t_stop:.1f}s")
            log(f"redis: replica synced in {seconds:.2f}s: RDB {rdb_bytes / MiB:,.0f} MiB ({rdb_bytes / seconds / 1e6:,.0f} MB/s); "
                f"replica used_memory {replica_used / MiB:,.0f} MiB; CPU primary {cpu_p:.1f}s (with its BGSAVE child) "
                f"replica {cpu_r:.1f}s, other processes {other:.2f} cores")
            return {"seconds": seconds, "rdb_bytes": rdb_bytes, "replica_used_memory": replica_used, "quiet": quiet,
                    "other_cpu": other, "primary_cpu_s": cpu_p, "replica_cpu_s": cpu_r, "attempts": attempt}

        r = redo_while_disturbed(full_sync)
        p.close()
        return {"keys": dbsize, "used_memory": used, "version": version, "fill_s": fill_s, **r}
    finally:
        t_stop = time.monotonic()
        primary.stop()
        log(f"redis: primary stopped in {time.monotonic() - t_stop:.1f}s")


def part_bootstrap(res: Results, a: Any, workdir: str) -> None:
    volume = int(a.bootstrap_gib * GiB)
    t = bootstrap_tidemark(a, workdir, volume)
    mbs = t["bytes"] / t["seconds"] / 1e6
    target, ok = common.at_least(mbs, BOOTSTRAP_TARGET_MBS)
    note = (f"{t['bytes'] / MiB:,.0f} MiB of log in {t['seconds']:.2f}s from spawning the empty slave to max/confirm offsets "
            f"equal: serving after {t['ready_s']:.2f}s (snapshot bundle {t['bundle_s']:.2f}s of it), converged "
            f"{t['stream_s']:.2f}s later; CPU master {t['master_cpu_s']:.1f}s slave {t['slave_cpu_s']:.1f}s, other processes "
            f"{t['other_cpu']:.2f} cores"
            + ("; master's page cache evicted first" if a.cold else "; master's log in the page cache"))
    res.add("tidemark empty-slave bootstrap", mbs, "MB/s", target=target, ok=ok, note=note,
            **{k: v for k, v in t.items() if k != "quiet"}, quiet=t["quiet"])
    res.add("tidemark empty-slave bootstrap time", t["seconds"], "s", note=f"{t['bytes'] / GiB:.2f} GiB of log")
    if a.skip_redis:
        return
    r = bootstrap_redis(a, workdir, int(t["bytes"]))
    rmbs = r["rdb_bytes"] / r["seconds"] / 1e6
    res.add(f"redis {r['version']} replica full sync", rmbs, "MB/s",
            note=f"{r['keys']:,} keys x 1 KiB, RDB {r['rdb_bytes'] / MiB:,.0f} MiB (used_memory {r['used_memory'] / MiB:,.0f} MiB) "
                 f"in {r['seconds']:.2f}s from REPLICAOF to link up + DBSIZE equal; repl-diskless-sync no; CPU primary "
                 f"{r['primary_cpu_s']:.1f}s (with BGSAVE) replica {r['replica_cpu_s']:.1f}s, other {r['other_cpu']:.2f} cores",
            **{k: v for k, v in r.items() if k != "quiet"}, quiet=r["quiet"])
    res.add(f"redis {r['version']} replica full sync time", r["seconds"], "s")
    ratio = mbs / rmbs if rmbs else 0.0
    target, ok = common.at_least(ratio, REDIS_RATIO_TARGET)
    res.add("ratio bootstrap tidemark / redis", ratio, "x", target=target, ok=ok,
            note=f"MB/s over MB/s; times {t['seconds']:.2f}s for {t['bytes'] / 1e9:.2f} GB vs {r['seconds']:.2f}s for "
                 f"{r['rdb_bytes'] / 1e9:.2f} GB")


# -- main ----------------------------------------------------------------------------------------------
def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(PARTS))
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--batch", type=int, default=1000, help="messages per send() call")
    p.add_argument("--body", type=int, default=KiB)
    p.add_argument("--seconds", type=float, default=None, help="throughput window per mode (default 15, quick 3)")
    p.add_argument("--warmup", type=float, default=None, help="unmeasured warm-up per window (default 2, quick 1)")
    p.add_argument("--rounds", type=int, default=None, help="pairs for the throughput part; medians (default 3, quick 1)")
    p.add_argument("--lag-seconds", type=float, default=None, help="lag window (default 20, quick 4)")
    p.add_argument("--poll-ms", type=float, default=2.0, help="pause between slave status polls in the lag part")
    p.add_argument("--samples", type=int, default=None, help="metadata samples of each kind (default 300, quick 30)")
    p.add_argument("--bootstrap-gib", type=float, default=None, help="log volume for the bootstrap (default 1, quick 0.0625)")
    p.add_argument("--cold", action="store_true", help="evict the master's files from the page cache before the bootstrap")
    p.add_argument("--skip-redis", action="store_true")
    p.add_argument("--profile-dir", default="", help="write py-spy stacks (collapsed) of master and slave here")
    p.add_argument("--dump-lags", default="", help="write the lag part's per-send lags and samples (JSON) here")
    a = p.parse_args()
    parts = [x for x in a.only.split(",") if x] or list(PARTS)
    unknown = [x for x in parts if x not in PARTS]
    if unknown:
        p.error(f"unknown part(s): {', '.join(unknown)}")
    a.seconds = a.seconds or (3.0 if a.quick else 15.0)
    a.warmup = a.warmup if a.warmup is not None else (1.0 if a.quick else 2.0)
    a.rounds = a.rounds or (1 if a.quick else 3)
    a.lag_seconds = a.lag_seconds or (4.0 if a.quick else 20.0)
    a.samples = a.samples or (30 if a.quick else 300)
    a.bootstrap_gib = a.bootstrap_gib or (1 / 16 if a.quick else 1.0)
    if a.profile_dir:
        os.makedirs(a.profile_dir, exist_ok=True)
    workdir = a.workdir or "/tmp"
    params = {"producers": a.producers, "batch": a.batch, "body_bytes": a.body, "seconds": a.seconds, "rounds": a.rounds,
              "queues": QUEUES, "lag_seconds": a.lag_seconds, "samples": a.samples, "bootstrap_gib": a.bootstrap_gib,
              "quick": a.quick, "parts": parts}
    res = Results("replication", a.results, params)
    res.params.update(wait_for_quiet(a))  # benchmark scripts first, then daemons and CPU
    common.preflight(res, 30.0, a.malloc_tuned)
    need = int(4 * 200_000 * a.body * (a.seconds + a.warmup)) if "throughput" in parts else 0
    need = max(need, int(5 * a.bootstrap_gib * GiB) if "bootstrap" in parts else 0, 1 << 30)
    common.require_free_disk(workdir, need)

    max_flush = 0.0
    if "throughput" in parts:
        max_flush = part_throughput(res, a, workdir)
    if "lag" in parts:
        wait_for_quiet(a)
        part_lag(res, a, workdir, max_flush)
    if "metadata" in parts:
        wait_for_quiet(a)
        part_metadata(res, a, workdir)
    if "bootstrap" in parts:
        wait_for_quiet(a)
        part_bootstrap(res, a, workdir)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
