"""Run every benchmark as its own process, in sequence, then print all result tables (``make bench``).

Each script appends its figures to one JSON-lines file, ``bench/results/<timestamp>-all.jsonl``
(gitignored); its output also goes to ``bench/results/<timestamp>-<name>.log``.

At the end it prints the performance-round table (bench/round_table.py) and, after a full run of
every benchmark the table reads, rewrites that table in bench/README.md.

Usage: .venv/bin/python bench/run_all.py [--quick] [--only send_throughput,pull_throughput] [--strict]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import common
import round_table

BENCHES = ("send_throughput", "send_profile", "grpc_floor", "pull_throughput",
           "restart_time", "memory", "replication", "spark_read", "timers", "tiered",
           "longpoll", "many_queues", "failover", "groups", "pop", "plain_api", "verify_damage", "hostile",
           "transactions", "shards", "shard_sim", "groups_shards", "shard_txn", "queue_move")
# a benchmark run again with other arguments, under a name of its own
VARIANTS = {"groups_shards": ("groups", ["--shards", "2"])}


def command(name: str, results: str) -> list[str]:
    script, extra = VARIANTS.get(name, (name, []))
    return [sys.executable, os.path.join(common.BENCH_DIR, f"{script}.py"), *extra, "--results", results]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small-scale smoke run of every benchmark")
    p.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(BENCHES))
    p.add_argument("--workdir", default=None, help="parent directory for temporary data (default /tmp)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    p.add_argument("--max-wait-quiet", type=float, default=None,
                   help="per benchmark, wait up to this many seconds for other CPU load to end (default 600, quick 30)")
    a = p.parse_args()
    names = [n for n in a.only.split(",") if n] or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(unknown)}")

    os.makedirs(common.RESULTS_DIR, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S") + ("-quick" if a.quick else "")
    results = os.path.join(common.RESULTS_DIR, f"{stamp}-all.jsonl")
    failed: list[str] = []
    durations: dict[str, float] = {}
    for name in names:
        cmd = command(name, results)
        if a.quick:
            cmd.append("--quick")
        if a.workdir:
            cmd += ["--workdir", a.workdir]
        wait = a.max_wait_quiet if a.max_wait_quiet is not None else (30.0 if a.quick else 600.0)
        cmd += ["--max-wait-quiet", str(wait)]
        log_path = os.path.join(common.RESULTS_DIR, f"{stamp}-{name}.log")
        common.log(f"== {name}: {' '.join(cmd)} (output also in {log_path})")
        t0 = time.monotonic()
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=common.REPO_DIR)
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                log_file.write(line)
            rc = proc.wait()
        durations[name] = time.monotonic() - t0
        if rc != 0:
            failed.append(f"{name} (exit {rc})")
            common.log(f"== {name} FAILED with exit code {rc}")

    figures = common.load_figures(results) if os.path.exists(results) else []
    print("\n" + "=" * 100)
    print(f"All results ({'quick' if a.quick else 'full'} run; {results})")
    for name in names:
        mine = [f for f in figures if f.bench == name]
        if mine:
            common.print_table(mine, title=f"{name} ({durations.get(name, 0):.0f}s)")
        else:
            print(f"\n== {name}: no results")
    missed = [f for f in figures if f.ok is False]
    print()
    for name in names:
        first = next((f for f in figures if f.bench == name), None)
        if first is not None:
            pr = first.params
            others = pr.get("foreign_processes") or []
            print(f"{name}: code {pr.get('git', '?')}, CPU busy before start {pr.get('cpu_busy_before', 0):.0%}, "
                  f"other daemons/tests running at start: {len(others)}" + (f" ({'; '.join(others)[:300]})" if others else ""))
    print("\nPerformance round (bench/round_table.py):")
    print("\n".join(round_table.lines(figures)))
    if not a.quick and {row.bench for row in round_table.ROWS} <= set(names):
        if failed:
            print("bench/README.md left as it was: a benchmark failed, so this table is incomplete")
        else:
            round_table.update_readme(os.path.join(common.BENCH_DIR, "README.md"), figures, results)
            print("bench/README.md updated with this table")
    if not figures:
        print("Nothing was measured.")
    elif missed:
        print("Targets missed: " + "; ".join(f"{f.bench}: {f.metric} = {common.fmt_value(f.value, f.unit)} {f.unit} "
                                             f"(target {f.target})" for f in missed))
    elif failed:
        print("Every target that was measured was met (some benchmarks failed; see below).")
    else:
        print("Every target met.")
    if failed:
        print("Benchmarks that failed: " + ", ".join(failed))
        return 1
    return 1 if (a.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
