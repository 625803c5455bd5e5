"""The performance-round table: every figure users compare, its goal, and today's value from one run.

``make bench`` (bench/run_all.py) prints it after the per-benchmark tables and rewrites the table
section of bench/README.md with the date, the machine and the code revision. Each row names the
benchmark and the metric it reads from the run's JSON-lines file; a row whose benchmark did not run
(``--only``) shows "not run". Values come from one run: ratios were measured side by side.

Usage: .venv/bin/python bench/round_table.py RESULTS.jsonl [--readme bench/README.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import common
from common import Figure


@dataclass(frozen=True)
class Row:
    figure: str
    bench: str
    metric: str  # a regular expression, matched whole against Figure.metric
    goal: str
    met: Callable[[float], bool] | None  # None: reported for comparison, no goal of its own
    param: str = ""  # read this entry of Figure.params instead of Figure.value
    shown_as: Callable[[Figure, float], str] | None = None


def _pct(_: Figure, v: float) -> str:
    return f"{v:.0%}"


ROWS: tuple[Row, ...] = (
    Row("send 1 KiB ack=flush / Redis XADD appendfsync=always", "send_throughput",
        r"ratio tidemark_flush / redis_always", "≥ 6x", lambda v: v >= 6.0),
    Row("ack=flush payload MB/s / the disk's 1 MiB + fdatasync MB/s", "send_throughput",
        r"ratio ack=flush MB/s / disk 1 MiB \+ fdatasync MB/s", "≥ 0.9", lambda v: v >= 0.9),
    Row("ack=flush with 4x the bytes in flight (8 producers x 2000 messages) / the disk's", "send_throughput",
        r"ratio ack=flush deep MB/s / disk 1 MiB \+ fdatasync MB/s", "(for comparison)", None),
    Row("what both cores allow at the CPU per MB of that run (daemon + clients) / the disk's", "send_throughput",
        r"ratio CPU ceiling / disk 1 MiB \+ fdatasync MB/s", "(the floor)", None),
    Row("what both cores allow a broker whose only work is receiving (the null broker and its clients) and writing + "
        "fdatasync (the disk probe), at the machine's CPU per MB of each / the disk's", "send_throughput",
        r"ratio storage \+ transport CPU ceiling / disk 1 MiB \+ fdatasync MB/s", "(the floor)", None),
    Row("the same clients' MB/s to a server that stores nothing / the disk's (the ack=flush row's ceiling if storing cost nothing)",
        "send_throughput", r"ratio null broker MB/s / disk 1 MiB \+ fdatasync MB/s", "(for comparison)", None),
    Row("send 1 KiB ack=flush / the same clients to a server that stores nothing", "send_throughput",
        r"ratio tidemark_flush / null broker", "(for comparison)", None),
    Row("the daemon's CPU budget per payload MB for 0.9 of the disk: all cores over 0.9 x the disk's MB/s, less the "
        "clients' CPU per MB (ms)", "send_throughput", r"CPU ms per payload MB the daemon may spend for the disk row's goal",
        "(the floor)", None),
    Row("CPU per payload MB of a server that only receives (the null broker; ms)", "send_throughput",
        r"CPU ms per payload MB, null broker server", "(the floor)", None),
    Row("CPU per payload MB of the daemon at ack=flush (ms)", "send_throughput",
        r"CPU ms per payload MB, tidemark ack=flush daemon", "(for comparison)", None),
    Row("ack=replica / ack=flush on a pair", "replication", r"ratio ack=replica / ack=flush", "≥ 0.95",
        lambda v: v >= 0.95),
    Row("replication lag p99 at 50% load (ms)", "replication", r"replication lag p99 at 50% load", "≤ 20 ms",
        lambda v: v <= 20.0),
    Row("slave in the in-sync set under full ack=flush load", "replication", r"master\+slave ack=flush",
        "≥ 99% of samples", lambda v: v >= 0.99, param="in_sync_fraction", shown_as=_pct),
    Row("pull one queue, 1 KiB (msg/s, iter_pull + bodies)", "pull_throughput",
        r"iter_pull \+ PullResult\.bodies\(\) \(pipelined\)", "≥ 400,000", lambda v: v >= 400_000),
    Row("pull one queue, 1 KiB (msg/s, one pull at a time + bodies)", "pull_throughput",
        r"pull \+ PullResult\.bodies\(\)", "(for comparison)", None),
    Row("tiered upload to radosgw / boto3 transfer manager, same bytes", "tiered",
        r"upload to radosgw / boto3 transfer manager", "≥ 0.95x", lambda v: v >= 0.95),
    Row("tiered upload to radosgw / boto3 single-stream put_object, same bytes", "tiered",
        r"upload to radosgw / boto3 put rate", "(for comparison)", None),
    Row("Spark streaming read / pure-Arrow generator (noop sink)", "spark_read", r"tidemark / generator \(noop\)",
        "≥ 0.85x", lambda v: v >= 0.85),
    Row("Spark streaming read / pure-Arrow generator (parquet sink)", "spark_read",
        r"tidemark / generator \(parquet\)", "≥ 0.85x", lambda v: v >= 0.85),
    Row("Spark streaming read over gRPC (localReads=false) / generator (noop sink)", "spark_read",
        r"tidemark over gRPC / generator \(noop\)", "(for comparison)", None),
    Row("Spark streaming read over gRPC (localReads=false) / generator (parquet sink)", "spark_read",
        r"tidemark over gRPC / generator \(parquet\)", "(for comparison)", None),
    Row("timers scheduling (timers/s)", "timers", r"scheduling rate .*", "≥ 200,000", lambda v: v >= 200_000),
    Row("empty-slave bootstrap / Redis full sync (MB/s)", "replication", r"ratio bootstrap tidemark / redis", "≥ 6x",
        lambda v: v >= 6.0),
    Row("single node send 1 KiB ack=flush (msg/s, asyncio server)", "send_throughput", r"tidemark ack=flush",
        "not below 213.8k (before asyncio)", lambda v: v >= 213_800),
    Row("single node pull one queue (msg/s, asyncio server)", "pull_throughput", r"pull only \(len, no decode\)",
        "not below 272k (before asyncio)", lambda v: v >= 272_000),
)


def _find(figures: list[Figure], row: Row) -> Figure | None:
    pattern = re.compile(row.metric)
    found = [f for f in figures if f.bench == row.bench and pattern.fullmatch(f.metric)]
    return found[-1] if found else None


def _value(row: Row, fig: Figure) -> float | None:
    if not row.param:
        return fig.value
    v = fig.params.get(row.param)
    return float(v) if isinstance(v, (int, float)) else None


def lines(figures: list[Figure]) -> list[str]:
    """The table as Markdown lines: figure, today's value, goal, verdict."""
    out = ["| figure | today | goal | verdict |", "|---|---|---|---|"]
    for row in ROWS:
        fig = _find(figures, row)
        value = _value(row, fig) if fig is not None else None
        if fig is None or value is None:
            out.append(f"| {row.figure} | not run | {row.goal} | |")
            continue
        shown = row.shown_as(fig, value) if row.shown_as else (
            f"{value:.2f}x" if fig.unit == "x" and not row.param else f"{common.fmt_value(value, fig.unit)} {fig.unit}")
        verdict = "" if row.met is None else ("met" if row.met(value) else "**missed**")
        out.append(f"| {row.figure} | {shown} | {row.goal} | {verdict} |")
    return out


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.node()}: {os.cpu_count()} cores, {cpu}, {mem_gib:.0f} GiB, Python {platform.python_version()}"


BEGIN = "<!-- round-table:begin -->"
END = "<!-- round-table:end -->"


def update_readme(path: str, figures: list[Figure], results: str) -> None:
    """Replace the table section of ``path`` (between the markers) with today's table."""
    revisions = sorted({str(f.params.get("git", "?")) for f in figures})
    block = [BEGIN, f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} on {machine()}; code {', '.join(revisions)}; "
             f"results `{os.path.relpath(results, common.REPO_DIR)}` (gitignored).", "", *lines(figures), END]
    text = f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(path + ".tmp", "w") as f:
        f.write(head + "\n".join(block) + tail)
    os.replace(path + ".tmp", path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", help="a bench/results/*-all.jsonl file")
    p.add_argument("--readme", default="", help="also rewrite the table section of this file")
    a = p.parse_args()
    figures = common.load_figures(a.results)
    print("\n".join(lines(figures)))
    if a.readme:
        update_readme(a.readme, figures, a.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
