"""The floor under the send path: how many MB/s a Python gRPC server receives when it does nothing.

(``null_broker`` below is the other floor, measured by ``send_throughput.py`` in every round: a
Broker service that stores nothing, sent to by the same Python clients as the daemon.)

A ``grpc.aio`` server on uvloop (as the daemon's) with one unary method that takes the raw request
bytes (no protobuf parse) and answers ``b"ok"``; 4 client processes, each sending 1 MiB requests one
at a time through a plain ``grpc`` channel, for ``--seconds``. Then the same with the handler as a
plain function run in the server's thread pool (what the daemon's ``Send`` was before it became a
coroutine). The daemon's ack=flush send rate (``send_throughput.py``) compares against the first:
it is what the machine's 2 cores give one Python gRPC process receiving these bytes, with the
clients on the same cores.

Then the floor under a call's cost to the client (issue 38's routing cost): two such servers, and
one client in this process, one call at a time. Its CPU (``time.process_time``: gRPC's threads
included) per tiny call, per call of 1 MiB, and per pair of 512 KiB calls to the two servers side
by side (``future`` for one, the other blocking: what a keyed send spanning two shards makes),
against one 1 MiB call to one server (what the same send makes to a single pair).

Usage: .venv/bin/python bench/grpc_floor.py [--seconds 10] [--producers 4] [--calls 2000]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from concurrent import futures
from typing import Any

import common
import grpc
import uvloop
from common import Results, log

from broker.daemon.send_wire import parse_send
from proto import tidemark_pb2 as pb

METHOD = "/floor.Floor/Take"
LIMIT = 64 << 20
BLOCK = 1 << 20


def _identity(data: bytes) -> bytes:
    return data


def _run_server(ports: Any, service: str, methods: dict[str, Any]) -> None:
    """Serve ``methods`` (name -> handler taking and returning raw bytes) on a ``grpc.aio`` server on
    uvloop, as the daemon's; the port goes to ``ports``."""
    async def main() -> None:
        server = grpc.aio.server(migration_thread_pool=futures.ThreadPoolExecutor(8),
                                 options=[("grpc.max_receive_message_length", LIMIT)])
        handlers = {name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_identity, response_serializer=_identity)
                    for name, fn in methods.items()}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        await server.wait_for_termination()

    uvloop.install()
    asyncio.run(main())


def serve(ports: Any, in_pool: bool) -> None:
    async def take_async(request: bytes, context: Any) -> bytes:
        return b"ok"

    def take(request: bytes, context: Any) -> bytes:
        return b"ok"

    _run_server(ports, "floor.Floor", {"Take": take if in_pool else take_async})


def null_broker(ports: Any, topic: str, queues: int) -> None:
    """A process serving the two Broker methods a producer calls, storing nothing: ``ListTopics``
    names ``topic`` with ``queues`` queues, ``Send`` reads the request as the daemon does
    (``send_wire``, records left in place) and answers a receipt per batch. What the machine's 2
    cores give the same client processes when the server's own work costs nothing."""
    topics = pb.ListTopicsResponse(topics=[pb.TopicInfo(name=topic, queues=queues, queue_max_offsets=[0] * queues)])
    offset = 0

    async def send(data: bytes, context: Any) -> bytes:
        nonlocal offset
        receipts = []
        for b in parse_send(data).batches:
            receipts.append(pb.BatchReceipt(commit_offset=offset, record_count=b.record_count))
            offset += len(b.records)
        return pb.SendResponse(receipts=receipts).SerializeToString()

    async def list_topics(data: bytes, context: Any) -> bytes:
        return topics.SerializeToString()

    _run_server(ports, pb.DESCRIPTOR.services_by_name["Broker"].full_name, {"Send": send, "ListTopics": list_topics})


def produce(port: int, seconds: float, out: Any) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", LIMIT)]) as ch:
        call = ch.unary_unary(METHOD)
        body = os.urandom(BLOCK)
        call(body)  # connected before the window starts
        sent, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            call(body)
            sent += 1
    out.put(sent)


def _start_server(in_pool: bool) -> tuple[mp.Process, int]:
    """A ``serve`` process and its port."""
    ports: Any = mp.Queue()
    server = mp.Process(target=serve, args=(ports, in_pool), daemon=True)
    server.start()
    return server, ports.get(timeout=30)


def measure(in_pool: bool, producers: int, seconds: float) -> tuple[float, float]:
    """(MB/s received, server CPU in cores) over one window."""
    server, port = _start_server(in_pool)
    try:
        out: Any = mp.Queue()
        procs = [mp.Process(target=produce, args=(port, seconds, out)) for _ in range(producers)]
        cpu0, t0 = common.cpu_seconds_of(server.pid or 0), time.monotonic()
        for p in procs:
            p.start()
        sent = sum(out.get(timeout=seconds + 60) for _ in procs)
        cpu, elapsed = common.cpu_seconds_of(server.pid or 0) - cpu0, time.monotonic() - t0
        for p in procs:
            p.join()
        return sent * BLOCK / 1e6 / seconds, cpu / elapsed
    finally:
        server.kill()


def call_costs(calls: int) -> dict[str, float]:
    """Client CPU in us per call (or pair of calls) against two do-nothing servers."""
    servers = [_start_server(False) for _ in range(2)]
    options = [("grpc.max_send_message_length", LIMIT)]
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=options) for _, port in servers]
    try:
        one, other = (ch.unary_unary(METHOD) for ch in channels)
        tiny, whole, half = b"x" * 16, os.urandom(BLOCK), os.urandom(BLOCK // 2)

        def side_by_side() -> None:
            pending = other.future(half)
            one(half)
            pending.result()

        shapes = {"tiny": lambda: one(tiny), "whole": lambda: one(whole), "halves": side_by_side}
        costs: dict[str, list[float]] = {name: [] for name in shapes}
        for _ in range(3):  # interleaved rounds: the machine drifts; the median of each
            for name, fn in shapes.items():
                for _ in range(20):
                    fn()
                cpu0 = time.process_time()
                for _ in range(calls):
                    fn()
                costs[name].append((time.process_time() - cpu0) / calls * 1e6)
        return {name: sorted(v)[1] for name, v in costs.items()}
    finally:
        for ch in channels:
            ch.close()
        for server, _ in servers:
            server.kill()


def main() -> int:
    p = common.base_parser(__doc__ or "")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000, help="calls per shape and round of the call-cost part")
    a = p.parse_args()
    seconds = 3.0 if a.quick else a.seconds
    res = Results("grpc_floor", a.results)
    common.preflight(res, a.max_wait_quiet)
    for name, in_pool in (("coroutine handler", False), ("handler in the thread pool", True)):
        rate, cpu = measure(in_pool, a.producers, seconds)
        log(f"{name}: {rate:,.0f} MB/s, server CPU {cpu:.2f} cores")
        res.add(f"null gRPC server, {name}: 1 MiB requests received", rate, "MB/s",
                note=f"{a.producers} producers one call at a time; server CPU {cpu:.2f} cores; raw bytes, no parse")
    costs = call_costs(200 if a.quick else a.calls)
    log(f"client CPU per call: {costs}")
    res.add("client CPU per unary call, 16 B request", costs["tiny"], "us", note="grpc sync stub, median of 3 rounds")
    res.add("client CPU per 1 MiB call to one server", costs["whole"], "us")
    res.add("client CPU per two 512 KiB calls to two servers side by side", costs["halves"], "us",
            note="a keyed send spanning two shards, gRPC's part only")
    res.add("two calls side by side / one call, the same bytes", costs["halves"] / costs["whole"], "x",
            note="the floor under the routing cost of a split send (issue 38)")
    res.print_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
