"""The any-language API against our client's fast path (issue 16): what encoding on the server
(plain messages) and decoding on the server (``Pull`` with ``decode``) cost.

One daemon, a topic of 4 queues. Sends: ``--procs`` processes each send ``--messages`` / procs
1 KiB messages, 1,000 per call, ack=flush: first with ``BrokerClient.send`` (records encoded by
the client), then with generated stubs and ``SendRequest.messages`` (the server encodes). Pulls:
the same processes read a queue each, 1,000 per call: ``PullResult.bodies()`` against
``decode = true``. Rates and ratios from one run; no targets (the plain path is for reach, not
speed).

Usage: .venv/bin/python bench/plain_api.py [--quick] [--messages 200000]
"""

from __future__ import annotations

import sys
import time
from typing import Any

import common
import grpc
import load
from common import KiB, Results

from broker.client import BrokerClient, Message
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

TOPIC = "bench-plain"
QUEUES = 4
PER_CALL = 1000


def sender(address: str, count: int, body_bytes: int, plain: bool, start_at: float, out: Any) -> None:
    body = b"x" * body_bytes
    calls = count // PER_CALL
    if plain:
        channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
        stub = pb_grpc.BrokerStub(channel)
        request = pb.SendRequest(ack=pb.ACK_FLUSH, messages=[pb.PlainMessage(topic=TOPIC, key=str(i), body=body)
                                                             for i in range(PER_CALL)])
        load.wait_until(start_at)
        t0 = time.perf_counter()
        for _ in range(calls):
            stub.Send(request)
        out.put({"messages": calls * PER_CALL, "seconds": time.perf_counter() - t0})
        channel.close()
        return
    messages = [Message(body, key=str(i)) for i in range(PER_CALL)]
    with BrokerClient(address) as c:
        c.list_topics()
        load.wait_until(start_at)
        t0 = time.perf_counter()
        for _ in range(calls):
            c.send(TOPIC, messages, ack="flush")
        out.put({"messages": calls * PER_CALL, "seconds": time.perf_counter() - t0})


def puller(address: str, queue_id: int, end: int, decode: bool, start_at: float, out: Any) -> None:
    n = 0
    with BrokerClient(address) as c:
        stub = pb_grpc.BrokerStub(grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]))
        load.wait_until(start_at)
        t0 = time.perf_counter()
        offset = 0
        while offset < end:
            if decode:
                r = stub.Pull(pb.PullRequest(topic=TOPIC, queue_id=queue_id, offset=offset, max_messages=PER_CALL,
                                             decode=True))
                n += sum(1 for m in r.messages if m.body)
                offset = r.next_offset
            else:
                got = c.pull(TOPIC, queue_id, offset, max_messages=PER_CALL)
                n += sum(1 for b in got.bodies() if b)
                offset = got.next_offset
        out.put({"messages": n, "seconds": time.perf_counter() - t0})


def rate(results: list[dict[str, float]]) -> float:
    return sum(r["messages"] for r in results) / max(r["seconds"] for r in results)


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--body", type=int, default=KiB)
    a = p.parse_args()
    if a.quick:
        a.messages = 20_000
    res = Results("plain_api", a.results, {"messages": a.messages, "procs": a.procs, "body": a.body})
    common.preflight(res, a.max_wait_quiet)
    each = a.messages // a.procs
    with common.temp_dir("tm-plain-", a.workdir) as work, common.running_daemon(work, "n") as d, \
            BrokerClient(d.address) as c:
        c.create_topic(TOPIC, queues=QUEUES)
        rates = {}
        for plain in (False, True):
            start_at = time.time() + 2.0
            rates[plain] = rate(load.run_processes(sender, [(d.address, each, a.body, plain, start_at)] * a.procs,
                                                   timeout_s=1800))
        res.add("send, client-encoded batches (BrokerClient.send)", rates[False], "msg/s",
                note=f"{a.procs} processes, {PER_CALL} x {a.body} B per call, ack=flush")
        res.add("send, plain messages (server encodes)", rates[True], "msg/s")
        res.add("plain / client-encoded send", rates[True] / rates[False], "x")
        common.wait_applied(c)
        ends = c.list_topics()[TOPIC]["max_offsets"]
        pulls = {}
        for decode in (False, True):
            start_at = time.time() + 2.0
            pulls[decode] = rate(load.run_processes(puller, [(d.address, q, ends[q], decode, start_at)
                                                             for q in range(QUEUES)], timeout_s=1800))
        res.add("pull, batches decoded by the client (bodies())", pulls[False], "msg/s",
                note=f"{QUEUES} processes, {PER_CALL} per call, {sum(ends):,} messages")
        res.add("pull, decode = true (server decodes)", pulls[True], "msg/s")
        res.add("decoded / batch pull", pulls[True] / pulls[False], "x")
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
