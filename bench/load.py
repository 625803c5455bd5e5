"""Producer processes for the benchmarks: fill a topic, or send through one measured window.

Clients run in processes of their own (``multiprocessing`` spawn context), so that they do not share
the benchmark script's interpreter lock. Every target takes its arguments and, last, a queue on which
it puts one result.

- ``fill()``: N processes send a given number of messages (ack=leader) as fast as they can.
- ``run_window()``: N processes start sending at one wall-clock instant; what they send in
  ``[start + warm-up, + seconds)`` counts. ``window_producer`` is the Tidemark sender; another
  system's sender calls ``send_window()`` with its own send function.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from measure import CpuTimes

from broker.client import BrokerClient, Message

SPAWN_S = 2.0  # time to spawn the first producer process and import its modules ...
SPAWN_EACH_S = 0.3  # ... and each further one


def run_processes(target: Callable[..., None], args_for: Sequence[tuple[Any, ...]], timeout_s: float | None) -> list[Any]:
    """Run ``target(*args, out)`` in one spawned process per ``args`` tuple; the results they put on ``out``
    (waiting ``timeout_s`` at most for each, or without a bound)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, out)) for args in args_for]
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout_s) for _ in procs]
    for p in procs:
        p.join()
    return results


def wait_until(t: float) -> None:
    """Sleep until wall-clock time ``t``."""
    while (d := t - time.time()) > 0:
        time.sleep(min(d, 0.05))


# -- filling a topic -----------------------------------------------------------------------------
def fill_producer(address: str, topic: str, count: int, batch: int, body_bytes: int, distinct: bool, keys: int,
                  out: Any) -> None:
    """Send ``count`` messages, ``batch`` per call, ack=leader; every call carries the same messages:
    one random body (or ``batch`` distinct ones), keyless (or keyed ``k0`` .. ``k{keys - 1}``)."""
    if distinct:
        bodies = [os.urandom(body_bytes) for _ in range(batch)]
    else:
        bodies = [os.urandom(body_bytes)] * batch
    messages = [Message(body=body, key=f"k{i % keys}" if keys else None) for i, body in enumerate(bodies)]
    sent = 0
    with BrokerClient(address) as client:
        while sent < count:
            n = min(batch, count - sent)
            client.send(topic, messages[:n], ack="leader")
            sent += n
    out.put(sent)


def fill(address: str, topic: str, shares: Sequence[int], batch: int, body_bytes: int, *, distinct: bool = False,
         keys: int = 0, timeout_s: float = 3600.0) -> int:
    """One ``fill_producer`` process per share (its message count); the messages sent in all."""
    args = [(address, topic, n, batch, body_bytes, distinct, keys) for n in shares]
    return sum(run_processes(fill_producer, args, timeout_s))


def halves(count: int) -> list[int]:
    """``count`` split over two producer processes."""
    return [count // 2, count - count // 2]


def whole_sends(nbytes: int, batch: int, message_bytes: int) -> int:
    """Messages in the fewest sends of ``batch`` that carry ``nbytes``, counting ``message_bytes`` a message."""
    return -(-nbytes // (batch * message_bytes)) * batch


# -- one measured window -------------------------------------------------------------------------
def send_window(send: Callable[[], int | None], per_send: int, start_at: float, warmup_s: float, seconds: float,
                interval_s: float = 0.0, phase: float = 0.0) -> dict[str, Any]:
    """Call ``send()`` (it sends ``per_send`` messages) from ``start_at`` until the window ends: back to back,
    or every ``interval_s`` (open loop, first at ``start_at + phase * interval_s``). Reports the calls begun
    inside the window: messages, first start and last end, each call's latency, this process's CPU seconds,
    and (ack wall time, offset) for each call whose ``send()`` returned an offset."""
    count = 0
    latencies: list[float] = []
    acked: list[tuple[float, int]] = []
    first = last = cpu0 = 0.0
    next_at = start_at + interval_s * phase
    wait_until(start_at)
    window_start = start_at + warmup_s
    window_end = window_start + seconds
    while True:
        if interval_s:
            wait_until(next_at)
            next_at += interval_s
        t0 = time.time()
        if t0 >= window_end:
            break
        offset = send()
        t1 = time.time()
        if t0 >= window_start:
            if not count:
                first = t0
                cpu0 = time.process_time()
            count += per_send
            last = t1
            latencies.append(t1 - t0)
            if offset is not None:
                acked.append((t1, offset))
    cpu = time.process_time() - cpu0 if count else 0.0
    return {"count": count, "first": first, "last": last, "latencies": latencies, "acked": acked, "cpu": cpu, "error": ""}


def failed_window(exc: Exception) -> dict[str, Any]:
    """What a window producer reports when it fails (the parent then fails the run)."""
    return {"count": 0, "first": 0.0, "last": 0.0, "latencies": [], "acked": [], "cpu": 0.0,
            "error": f"{type(exc).__name__}: {exc}"}


def window_producer(address: str, topic: str, queues: int, ack: str, batch: int, body_bytes: int, sends_per_s: float,
                    phase: float, start_at: float, warmup_s: float, seconds: float, out: Any) -> None:
    """Send ``batch`` keyless messages per call through one window (``send_window``); each acknowledged
    call is reported with the commit offset of its last record."""
    body = os.urandom(body_bytes)
    messages = [Message(body=body) for _ in range(batch)]
    try:
        with BrokerClient(address) as client:
            client.send(topic, messages[:queues], ack=ack)  # connect, learn the queue count
            report = send_window(lambda: client.send(topic, messages, ack=ack)[-1].commit_offset, batch, start_at,
                                 warmup_s, seconds, 1.0 / sends_per_s if sends_per_s > 0 else 0.0, phase)
    except Exception as exc:  # reported to the parent, which fails the run
        report = failed_window(exc)
    out.put(report)


def run_window(target: Callable[..., None], args_for: Sequence[tuple[Any, ...]], warmup_s: float, seconds: float,
               watch: Sequence[int] = (), at_start: Callable[[], None] | None = None) -> dict[str, Any]:
    """One window: a spawned process per ``args`` tuple runs ``target(*args, start_at, warmup_s, seconds, out)``
    and reports a ``send_window`` dict; all start at the same instant. ``at_start`` is called as the window
    opens. Returns the messages counted, the window as measured (first start to last end), the rate,
    every latency (sorted) and acked offset (sorted), the clients' CPU in cores, and the ``CpuTimes``
    over the nominal window of the ``watch`` processes, the machine and this script."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + SPAWN_S + SPAWN_EACH_S * len(args_for)
    procs = [ctx.Process(target=target, args=(*args, start_at, warmup_s, seconds, out)) for args in args_for]
    for p in procs:
        p.start()
    wait_until(start_at + warmup_s)
    if at_start is not None:
        at_start()
    cpu0 = CpuTimes.now(*watch)
    wait_until(start_at + warmup_s + seconds)
    cpu = CpuTimes.now(*watch) - cpu0
    try:
        results = [out.get(timeout=seconds + warmup_s + 120) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results if r["error"]]
    if errors:
        raise RuntimeError(f"producer failed: {errors[0]}")
    count = sum(r["count"] for r in results)
    window = max(r["last"] for r in results) - (start_at + warmup_s)
    return {
        "count": count,
        "window_s": window,
        "window_start": start_at + warmup_s,
        "rate": count / window if window > 0 else 0.0,
        "latencies": sorted(x for r in results for x in r["latencies"]),
        "acked": sorted(a for r in results for a in r["acked"]),
        "client_cpu": sum(r["cpu"] for r in results) / window if window > 0 else 0.0,
        "cpu": cpu,
        "reports": results,  # each process's own report (extra keys a target added stay there)
    }
