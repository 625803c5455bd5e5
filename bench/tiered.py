"""Tiered storage: upload throughput (posix, radosgw beside boto3), read-through rate, upload lag.

1. Fill: one queue, 1 KiB messages (two producer processes, 1000 per send, ack=leader) into a daemon
   without tiered storage (64 MiB segments), ``--log-gib`` of log; then stop it.
2. Upload to posix: restart the same data directory with ``tieredstore.backend = "posix"``
   (64 MiB objects; ``upload_interval_ms = 10`` so that the backlog's last, partial object does not
   wait 1 s); time from SERVING until the uploaded offset reaches the confirm offset. The log was
   just written, so it is read from the page cache.
3. Upload to radosgw: a copy of the filled data directory (taken before step 2) and a fresh
   one-node radosgw (tests/s3server.py), ``backend = "s3"``. Beside it, in the same run,
   boto3's own single-stream ``put_object`` of the same object size (random bytes, the same
   client settings as the backend: path-style, no extra checksum), measured before and after the
   daemon's upload (radosgw's rate drifts as its fresh OSD fills); the ratio to their mean is one
   figure. Then boto3's transfer manager (``upload_fileobj``: parallel multipart, 8 MiB parts, 10
   threads) on the same object size: the ratio to it is the performance round's figure.
4. Read-through (posix): restart with ``retention.local_bytes`` = one segment, so every uploaded
   segment is deleted; evict the object files from the page cache; one consumer process pulls
   the whole queue from offset 0 (``max_messages=5000``, ``PullResult.bodies()``).
5. Upload lag: a fresh daemon with posix tiering on defaults; one producer paced at ``--lag-mbps``
   for ``--lag-seconds``; status sampled every 20 ms. For each byte offset x the lag is the time the
   uploaded offset passed x minus the time the confirm offset passed x; p50/p99/max over x.

Usage: .venv/bin/python bench/tiered.py [--quick] [--log-gib 1.0] [--no-radosgw]
(run it under ``flock /tmp/tidemark-bench.lock``: the machine is shared.)
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import shutil
import sys
import time
from typing import Any

import common
import load
from boto3.s3.transfer import TransferConfig
from common import GiB, KiB, MiB, Results, log

from broker.client import BrokerClient, Message
from tests.procs import DaemonProcess
from tests.s3server import ACCESS_KEY, SECRET_KEY, RadosGateway, s3_config
from tieredstore.s3 import S3Backend

TOPIC = "bench-tiered"
TARGET_POSIX_MBPS = 300.0
TARGET_TRANSFER_RATIO = 0.95  # the performance round's goal
TARGET_READ_MSG_S = 100_000
TARGET_LAG_P99_S = 2.0
SEGMENT_BYTES = 64 * MiB


def consumer(address: str, end: int, out: Any) -> None:

    total = body_bytes = 0
    with BrokerClient(address) as client:
        offset = 0
        t0 = time.perf_counter()
        while offset < end:
            res = client.pull(TOPIC, 0, offset, max_messages=5000)
            n = len(res)
            if n == 0:
                break
            body_bytes += sum(len(b) for b in res.bodies())
            total += n
            offset = res.next_offset
        dt = time.perf_counter() - t0
    out.put({"messages": total, "seconds": dt, "body_bytes": body_bytes})


def paced_producer(address: str, mbps: float, seconds: float, out: Any) -> None:

    messages = [Message(body=os.urandom(KiB)) for _ in range(100)]
    per_send = 100 * KiB
    sent = 0
    with BrokerClient(address) as client:
        t0 = time.monotonic()
        while (now := time.monotonic()) - t0 < seconds:
            ahead = sent / (mbps * 1e6) - (now - t0)
            if ahead > 0:
                time.sleep(ahead)
            client.send(TOPIC, messages, ack="flush")
            sent += per_send
    out.put(sent)


def wait_uploaded(d: DaemonProcess, timeout_s: float = 1800) -> tuple[float, dict[str, Any]]:
    """Seconds from now until everything confirmed is uploaded (but a trailing progress record)."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    while True:
        st = common.status(d.address)
        if int(st["confirm_offset"]) - int(st["tiered_uploaded_offset"]) <= 1024:
            return time.perf_counter() - t0, st
        if time.monotonic() > deadline:
            raise SystemExit(f"upload did not finish: {st['tiered']}")
        time.sleep(0.02)


def fill(workdir: str, nbytes: int) -> tuple[str, int]:

    d = DaemonProcess(os.path.join(workdir, "node"), config={"commitlog.segment_bytes": SEGMENT_BYTES,
                                                             "tieredstore.backend": "none"})
    common.start_timed(d)
    try:
        with BrokerClient(d.address) as c:
            c.create_topic(TOPIC, queues=1)
        count = load.whole_sends(nbytes // 2, 1000, KiB + 8)  # per process
        t0 = time.perf_counter()
        load.fill(d.address, TOPIC, [count, count], 1000, KiB, distinct=True)
        log(f"filled {nbytes / MiB:,.0f} MiB in {time.perf_counter() - t0:.1f}s")
        with BrokerClient(d.address) as c:
            queue_end = int(c.list_topics()[TOPIC]["max_offsets"][0])
        d.stop()
    finally:
        d.kill9()
    return d.data_dir, queue_end


def upload_run(res: Results, data_dir: str, label: str, config: dict[str, Any], target_mbps: float | None) -> float:
    # a short upload interval: the backlog is full objects anyway; only its last, partial object
    # would otherwise wait for the default 1000 ms and end up in the figure
    d = DaemonProcess(data_dir, config={"commitlog.segment_bytes": SEGMENT_BYTES, "tieredstore.upload_interval_ms": 10,
                                        **config})
    common.start_timed(d)
    try:
        seconds, st = wait_uploaded(d)
        assert d.proc is not None
        mbps = int(st["tiered_uploaded_offset"]) / seconds / 1e6
        objects = st["tiered"]["objects"]
        note = f"{int(st['tiered_uploaded_offset']) / MiB:,.0f} MiB in {seconds:.2f}s, {objects} objects of 64 MiB"
        tgt, ok = common.at_least(mbps, target_mbps) if target_mbps else ("", None)
        res.add(f"upload to {label}", mbps, "MB/s", target=tgt, ok=ok, note=note, seconds=seconds)
        d.stop()
    finally:
        d.kill9()
    return mbps


def boto3_put_rate(endpoint: str, object_bytes: int, count: int, tag: str) -> float:
    """boto3's own single-stream put_object rate (MB/s), with the backend's client settings."""

    bucket = f"baseline-{tag}"
    b = S3Backend(bucket=bucket, endpoint=endpoint, region="us-east-1", access_key_id=ACCESS_KEY,
                  secret_access_key=SECRET_KEY)
    b.ensure_bucket()
    bodies = [os.urandom(object_bytes) for _ in range(2)]
    b.client.put_object(Bucket=bucket, Key="warm", Body=bodies[0])
    t0 = time.perf_counter()
    for i in range(count):
        b.client.put_object(Bucket=bucket, Key=f"obj-{i}", Body=bodies[i % 2])
    return count * object_bytes / (time.perf_counter() - t0) / 1e6


def boto3_transfer_rate(endpoint: str, object_bytes: int, count: int) -> float:
    """boto3's transfer manager (``upload_fileobj``: parallel multipart, its default 8 MiB parts and
    10 threads) on the same objects, with the backend's client settings (MB/s)."""
    bucket = "baseline-transfer"
    b = S3Backend(bucket=bucket, endpoint=endpoint, region="us-east-1", access_key_id=ACCESS_KEY,
                  secret_access_key=SECRET_KEY)
    b.ensure_bucket()
    bodies = [os.urandom(object_bytes) for _ in range(2)]
    config = TransferConfig()
    b.client.upload_fileobj(io.BytesIO(bodies[0]), bucket, "warm", Config=config)
    t0 = time.perf_counter()
    for i in range(count):
        b.client.upload_fileobj(io.BytesIO(bodies[i % 2]), bucket, f"obj-{i}", Config=config)
    return count * object_bytes / (time.perf_counter() - t0) / 1e6


def lag_run(res: Results, workdir: str, mbps: float, seconds: float) -> None:

    root = os.path.join(workdir, "lag-tiered")
    d = DaemonProcess(os.path.join(workdir, "lag"), config={"tieredstore.root": root})
    common.start_timed(d)
    try:
        with BrokerClient(d.address) as c:
            c.create_topic(TOPIC, queues=1)
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            p = ctx.Process(target=paced_producer, args=(d.address, mbps, seconds, out))
            p.start()
            samples: list[tuple[float, int, int]] = []
            while p.is_alive() or not samples or samples[-1][2] < samples[-1][1] - 1024:
                st = c.status()
                samples.append((time.monotonic(), int(st["confirm_offset"]), int(st["tiered_uploaded_offset"])))
                if time.monotonic() - samples[0][0] > seconds + 60:
                    break
                time.sleep(0.02)
            sent = out.get(timeout=60)
            p.join()
        lags = upload_lags(samples)
        lags.sort()
        p50, p99, worst = lags[len(lags) // 2], lags[int(len(lags) * 0.99)], lags[-1]
        tgt, ok = common.at_most(p99, TARGET_LAG_P99_S)
        note = (f"{sent / seconds / 1e6:.1f} MB/s for {seconds:.0f}s, ack=flush, objects 64 MiB / every 1000 ms; "
                f"p50 {p50:.2f}s, max {worst:.2f}s")
        res.add("upload lag behind confirm offset p99", p99, "s", target=tgt, ok=ok, note=note, p50_s=p50, max_s=worst)
        d.stop()
    finally:
        d.kill9()


def upload_lags(samples: list[tuple[float, int, int]], points: int = 2000) -> list[float]:
    """Per byte offset x (on an even grid): time uploaded passed x minus time confirm passed x."""
    end = samples[-1][2]
    start = samples[0][2]
    out: list[float] = []
    ci = ui = 0
    for k in range(1, points + 1):
        x = start + (end - start) * k // points
        while ci < len(samples) and samples[ci][1] < x:
            ci += 1
        while ui < len(samples) and samples[ui][2] < x:
            ui += 1
        if ci < len(samples) and ui < len(samples):
            out.append(samples[ui][0] - samples[ci][0])
    return out


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--log-gib", type=float, default=None, help="log to fill (default 1.0; quick 0.25)")
    p.add_argument("--no-radosgw", action="store_true", help="skip the radosgw part")
    p.add_argument("--lag-mbps", type=float, default=20.0)
    p.add_argument("--lag-seconds", type=float, default=None, help="default 30; quick 10")
    a = p.parse_args()
    log_bytes = int((a.log_gib or (0.25 if a.quick else 1.0)) * GiB)
    lag_s = a.lag_seconds or (10.0 if a.quick else 30.0)
    res = Results("tiered", a.results, {"log_bytes": log_bytes, "quick": a.quick})
    common.preflight(res, a.max_wait_quiet, a.malloc_tuned)
    parent = a.workdir or "/tmp"
    common.require_free_disk(parent, log_bytes * 4 + 6 * GiB)
    with common.temp_dir("tm-tiered-", parent) as wd:
        data_dir, queue_end = fill(wd, log_bytes)
        root = os.path.join(wd, "tiered")
        s3_dir = data_dir + "-s3"
        if not a.no_radosgw:
            shutil.copytree(data_dir, s3_dir)
        upload_run(res, data_dir, "posix", {"tieredstore.root": root}, TARGET_POSIX_MBPS)
        if not a.no_radosgw:

            gw = RadosGateway(wd)
            try:
                t0 = time.perf_counter()
                gw.start()
                log(f"radosgw up in {time.perf_counter() - t0:.1f}s on {gw.endpoint}")
                count = 4 if a.quick else 8
                before = boto3_put_rate(gw.endpoint, 64 * MiB, count, "before")
                rgw = upload_run(res, s3_dir, "radosgw (s3 backend)", s3_config(gw.endpoint, "tiered"), None)
                shutil.rmtree(s3_dir, ignore_errors=True)
                after = boto3_put_rate(gw.endpoint, 64 * MiB, count, "after")
                base = (before + after) / 2
                res.add("boto3 put_object, one stream, 64 MiB objects", base, "MB/s",
                        note=f"same radosgw, same run: {before:.0f} MB/s before the daemon's upload, {after:.0f} after; mean",
                        before_mbps=before, after_mbps=after)
                res.add("upload to radosgw / boto3 put rate", rgw / base, "x",
                        note="for comparison: the goal is against the transfer manager, below")
                transfer = boto3_transfer_rate(gw.endpoint, 64 * MiB, count)
                res.add("boto3 transfer manager (parallel multipart), 64 MiB objects", transfer, "MB/s",
                        note="upload_fileobj, default TransferConfig: 8 MiB parts, 10 threads")
                tgt, ok = common.at_least(rgw / transfer, TARGET_TRANSFER_RATIO)
                res.add("upload to radosgw / boto3 transfer manager", rgw / transfer, "x", target=tgt, ok=ok)
            finally:
                gw.stop()
        # read-through: delete every uploaded segment locally, evict the objects, read from offset 0
        d = DaemonProcess(data_dir, config={"commitlog.segment_bytes": SEGMENT_BYTES, "tieredstore.root": root,
                                            "retention.local_bytes": SEGMENT_BYTES, "retention.check_interval_ms": 100})
        common.start_timed(d)
        try:
            deadline = time.monotonic() + 120
            while int(common.status(d.address)["min_offset"]) < log_bytes // 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            st = common.status(d.address)
            log(f"local log now starts at {int(st['min_offset']) / MiB:,.0f} MiB; {st['segments']} segment(s)")
            evicted = common.evict_page_cache(root)
            assert d.proc is not None
            cpu0 = common.cpu_seconds_of(d.proc.pid)
            [r] = load.run_processes(consumer, [(d.address, queue_end)], timeout_s=1800)
            cpu = common.cpu_seconds_of(d.proc.pid) - cpu0
            if r["messages"] != queue_end or r["body_bytes"] != queue_end * KiB:
                raise SystemExit(f"read {r['messages']} messages / {r['body_bytes']} bytes, expected {queue_end}")
            rate = r["messages"] / r["seconds"]
            tgt, ok = common.at_least(rate, TARGET_READ_MSG_S)
            below = int(st["min_offset"]) / max(1, int(st["max_offset"]))
            res.add("read-through from posix (1 KiB, pull + bodies)", rate, "msg/s", target=tgt, ok=ok,
                    note=f"{r['messages']:,} msgs in {r['seconds']:.2f}s, {below:.0%} of the log below the local start, "
                         f"{evicted / MiB:,.0f} MiB of objects evicted from the page cache, daemon CPU {cpu:.1f}s")
            d.stop()
        finally:
            d.kill9()
        lag_run(res, wd, a.lag_mbps, lag_s)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
