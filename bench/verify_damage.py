"""``tidemark log verify`` on a segment full of damage against an intact one: MiB/s of both and their ratio.

Issue 35, finding 14: the walk past damaged batches read a whole chunk again after each damaged batch, so
``log verify`` took time quadratic in the damage (16 MB of 64-byte invalid batches: 67 s in the issue,
38 s on the 2-core machine of these runs). It walks in one pass now (``scan.scan_past_damage``).

Two data directories, each with one segment of ``--size-mib`` (default 1 GiB; ``--quick``: 64 MiB):

- intact: valid batches written by a real store (``Store.open``, ``Appender.append``, the writer the
  daemon uses; ``--batch-records`` records of ``--body`` bytes per batch), stopped cleanly;
- damaged: 64-byte invalid batches back to back (a length field of 64, then no magic).

Each is checked by ``verify_data_dir`` (the function ``tidemark log verify`` runs) in this process, its
output discarded, page cache warm (the files were just written; ``--cold`` evicts them first). Printed:
MiB/s for both, the ratio intact / damaged, the damaged walk at a quarter of the size (linear: the same
MiB/s), and the peak RSS of ``tidemark log verify`` as a separate process on the damaged directory
(memory: one chunk, not one line per damaged batch).

Usage: .venv/bin/python bench/verify_damage.py [--quick] [--size-mib 1024] [--cold]
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import struct
import subprocess
import sys
import time

import common
import crc32c
from common import KiB, MiB, Results, log

from broker.cli.verify import verify_data_dir
from broker.config import Config
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.storage.segment import segment_name
from broker.store import IncomingBatch, Store

BAD_BATCH = struct.pack("<I", 64) + b"\xab" * 60  # whole (its length fits), but no magic: stepped over
TOPIC = "bench-verify"
APPEND_BATCHES = 32  # batches per Appender.append call


def write_intact(data_dir: str, size: int, batch_records: int, body: int) -> int:
    """A real store's log of at least ``size`` bytes in one segment; returns the segment's bytes."""
    cfg = Config.build({}, {"commitlog.segment_bytes": 2 * size + 64 * MiB, "checkpoint.interval_ms": 60_000}, environ={})
    s = Store.open(cfg, data_dir)
    s.start()
    try:
        end = s.appender.append_system([(system_records.TOPIC_CREATE, {"topic": TOPIC, "queues": 4})])
        s.watermarks.wait_ack(end, "flush", 30_000)
        if not s.wait_metadata_applied(end, 30):
            raise SystemExit("the topic was not applied in 30 s")
        records, _ = bf.encode_records([(os.urandom(body), b"", b"")] * batch_records)
        crc = crc32c.crc32c(records)
        n = 0
        while end < size:
            batches = [IncomingBatch(TOPIC, (n + i) % 4, records, batch_records, crc) for i in range(APPEND_BATCHES)]
            _, end = s.appender.append(batches)
            n += APPEND_BATCHES
        s.watermarks.wait_ack(end, "flush", 120_000)
    finally:
        s.stop()
    (seg,) = os.listdir(os.path.join(data_dir, "log"))
    return os.path.getsize(os.path.join(data_dir, "log", seg))


def write_damaged(data_dir: str, size: int) -> int:
    os.makedirs(os.path.join(data_dir, "log"))
    block = BAD_BATCH * (MiB // len(BAD_BATCH))
    with open(os.path.join(data_dir, "log", segment_name(0)), "wb") as f:
        for _ in range(size // MiB):
            f.write(block)
    return size // MiB * MiB


def timed_verify(data_dir: str, cold: bool) -> tuple[float, int, list[str]]:
    """Seconds ``verify_data_dir`` took, its exit code and its output lines."""
    if cold:
        common.evict_page_cache(data_dir)
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = verify_data_dir(data_dir)
    return time.perf_counter() - t0, code, out.getvalue().splitlines()


def cli_peak_rss(data_dir: str) -> tuple[int, float]:
    """Peak RSS (bytes) and wall seconds of ``tidemark log verify`` run as its own process (the largest
    child this script waited for: the others are ``git`` and nothing else)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "broker.cli", "log", "verify", data_dir], stdout=subprocess.DEVNULL,
                   cwd=common.REPO_DIR, check=False)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * KiB, time.perf_counter() - t0


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=None, help="segment size (default 1024; quick 64)")
    p.add_argument("--batch-records", type=int, default=100, help="records per valid batch (default 100)")
    p.add_argument("--body", type=int, default=KiB, help="bytes per record body (default 1024)")
    p.add_argument("--cold", action="store_true", help="evict each directory's pages before it is verified")
    a = p.parse_args()
    size = (a.size_mib or (64 if a.quick else 1024)) * MiB
    params = {"size_bytes": size, "batch_records": a.batch_records, "body_bytes": a.body, "cold": a.cold, "quick": a.quick}
    res = Results("verify_damage", a.results, params)
    common.preflight(res, a.max_wait_quiet, a.malloc_tuned)
    parent = a.workdir or "/tmp"
    common.require_free_disk(parent, int(size * 2.6) + 512 * MiB)
    cache = "cold page cache" if a.cold else "warm page cache"
    with common.temp_dir("tm-verify-", parent) as wd:
        intact, damaged, quarter = (os.path.join(wd, name) for name in ("intact", "damaged", "quarter"))
        log(f"writing {size // MiB} MiB of valid batches through a real store")
        intact_bytes = write_intact(intact, size, a.batch_records, a.body)
        log(f"writing {size // MiB} MiB (and a quarter of it) of 64-byte invalid batches")
        damaged_bytes = write_damaged(damaged, size)
        quarter_bytes = write_damaged(quarter, size // 4)

        seconds, code, lines = timed_verify(intact, a.cold)
        if code != 0:
            raise SystemExit(f"the intact directory failed verify: {lines[:5]}")
        intact_mbs = intact_bytes / MiB / seconds
        res.add(f"log verify, intact segment ({cache})", intact_mbs, "MiB/s",
                note=f"{intact_bytes / MiB:,.0f} MiB in {seconds:.2f} s; {lines[-1].split(': ', 1)[1]}")

        seconds, code, lines = timed_verify(damaged, a.cold)
        if code != 1 or len(lines) != 2:
            raise SystemExit(f"the damaged directory: exit {code}, expected 1 problem line: {lines[:5]}")
        damaged_mbs = damaged_bytes / MiB / seconds
        res.add(f"log verify, segment of 64-byte invalid batches ({cache})", damaged_mbs, "MiB/s",
                note=f"{damaged_bytes / MiB:,.0f} MiB ({damaged_bytes // len(BAD_BATCH):,} damaged batches) in {seconds:.2f} s; "
                     "one problem line")
        res.add("ratio intact / damaged", intact_mbs / damaged_mbs, "x", note="MiB/s of the intact walk over the damaged one")

        q_seconds, _, _ = timed_verify(quarter, a.cold)
        quarter_mbs = quarter_bytes / MiB / q_seconds
        res.add(f"log verify, a quarter of the damage ({quarter_bytes // MiB} MiB)", quarter_mbs, "MiB/s",
                note=f"{q_seconds:.2f} s; linear: the same MiB/s as the whole (quadratic: 4x the MiB/s)")
        res.add("linearity: damaged MiB/s at the full size / at a quarter", damaged_mbs / quarter_mbs, "x",
                target=">= 0.75", ok=damaged_mbs / quarter_mbs >= 0.75, note="1 = linear; 0.25 = quadratic")

        rss, wall = cli_peak_rss(damaged)
        res.add("tidemark log verify process on the damaged segment: peak RSS", rss / MiB, "MiB",
                note=f"{wall:.2f} s including the interpreter's start")
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
