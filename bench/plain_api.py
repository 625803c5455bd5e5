"""The any-language API against our client's fast path (issues 16, 40): what encoding on the
server (plain messages) and decoding on the server (``Pull`` with ``decode``) cost, from Python
stubs and from Node.js.

One daemon, a topic of 4 queues. Sends: ``--procs`` (4) processes each send ``--messages`` / procs
1 KiB messages, 1,000 per call, ack=flush: with ``BrokerClient.send`` (records encoded by the
client), then with generated stubs and ``SendRequest.messages`` (the server encodes), ``--rounds``
(5) times, the ratio the median of the rounds' own (a phase lasts about a second), with the daemon's
CPU per message of each phase beside. The stub senders' processes get the allocator tuning our
client gives its own (``broker/alloc.py``): with glibc's defaults, serialising a request of 1 MiB
page-faults fresh buffers in each call (upb: 1.1 ms, against 0.1 ms tuned), a cost of the Python
sender's process that would hide the server's; one more phase without it is printed beside. Then
from one Node.js process with as many callers on its event loop (``examples/node/bench.js``,
@grpc/grpc-js, a new request each call): plain messages, then batches encoded in JS
(``examples/node/batches.js``, in ``--rounds`` alternating with a phase of our client's), then those
again from a process per caller. Pulls: one process per queue, 1,000 per call: ``PullResult.bodies()``
against ``decode = true`` from Python stubs, then from one Node process with a caller per queue both
ways (the batches read in JS in rounds, as the sends), and from a Node process per queue.
Targets (issue 40): plain sends >= 0.8x client-encoded batches, decoded pulls >= 0.7x batch
pulls, Node's send and pull >= 0.7x the Python client's, like for like (Node with the record
format in JS, one process; its plain and decoded figures and a process per caller are printed
beside: each Node process pays V8's collector and JIT warm-up on its own, and perf finds most of a
Node puller's CPU in V8's runtime, not in its JavaScript).
Node needs ``node`` and the example's packages (``npm ci`` in examples/node, run here if
missing); without them its rows say so.

Usage: .venv/bin/python bench/plain_api.py [--quick] [--messages 200000] [--procs 4] [--rounds 5]
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import grpc
import load
from common import KiB, Results

from broker import alloc
from broker.client import BrokerClient, Message
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

TOPIC = "bench-plain"
QUEUES = 4
PER_CALL = 1000
NODE_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "node"


def sender(address: str, count: int, body_bytes: int, plain: bool, start_at: float, untuned: bool, out: Any) -> None:
    """``count`` messages in calls of ``PER_CALL``: by our client, or ``plain`` by generated stubs,
    with the allocator tuning our client applies to its own process unless ``untuned`` (``main``)."""
    body = b"x" * body_bytes
    calls = count // PER_CALL
    if plain:
        if not untuned:
            alloc.tune()
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


def node_ready() -> tuple[str | None, str]:
    """The ``node`` binary with the example's packages installed from its lockfile (``npm ci`` when
    missing or older than the lockfile), or why not."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None:
        return None, "node not found (Debian: nodejs)"
    marker, lock = NODE_EXAMPLE / "node_modules" / ".package-lock.json", NODE_EXAMPLE / "package-lock.json"
    if not marker.exists() or marker.stat().st_mtime < lock.stat().st_mtime:
        if npm is None:
            return None, "npm not found (Debian: npm)"
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--prefer-offline"], cwd=NODE_EXAMPLE,
                           capture_output=True, text=True, timeout=600, check=False)
        if r.returncode != 0:
            return None, f"npm ci failed: {(r.stderr or r.stdout).strip()[-200:]}"
    return node, ""


def run_node(node: str, argvs: list[list[str]]) -> float:
    """One Node process per argv (``bench.js`` arguments before the start time), started together."""
    start_at_ms = str(int((time.time() + 2.0) * 1000))
    procs = [subprocess.Popen([node, str(NODE_EXAMPLE / "bench.js"), *argv, start_at_ms], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for argv in argvs]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"node bench.js failed: {err.strip()[-300:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return rate(results)


def sends(address: str, each: int, a: Any, plain: bool = False, untuned: bool = False) -> float:
    """One send phase: ``a.procs`` ``sender`` processes of ``each`` messages, started together (msg/s)."""
    start_at = time.time() + 2.0
    return rate(load.run_processes(sender, [(address, each, a.body, plain, start_at, untuned)] * a.procs,
                                   timeout_s=1800))


def python_pulls(address: str, ends: list[int]) -> float:
    """One phase of our client's pulls: a process per queue, each from 0 to its end (msg/s)."""
    start_at = time.time() + 2.0
    return rate(load.run_processes(puller, [(address, q, ends[q], False, start_at) for q in range(QUEUES)],
                                   timeout_s=1800))


def in_rounds(rounds: int, ours: Callable[[], float], node: Callable[[], float]) -> tuple[float, str]:
    """Node's phase against ours, alternating ``rounds`` times: the median of the rounds' ratios, and
    the rounds (a phase lasts about a second: one pair alone moved by 0.3x between runs)."""
    pairs = [(ours(), node()) for _ in range(rounds)]
    shown = ", ".join(f"{n:,.0f}/{p:,.0f}" for p, n in pairs)
    return statistics.median(n / p for p, n in pairs), f"median of {rounds} rounds (Node/Python msg/s): {shown}"


def node_rows(res: Results, node: str, address: str, each: int, a: Any, send_rate: float, pull_rate: float,
              ends: list[int]) -> None:
    """Node's sends and pulls against the Python client's fast path: from the proto alone (plain,
    decode = true; one phase each, against ``send_rate`` and ``pull_rate``) and with the record format
    in JS (examples/node/batches.js), which is what the targets compare, like for like, in rounds
    alternating with a phase of our client's. Node runs as one process whose ``a.procs`` callers
    share its event loop (how a Node service runs: one process, many requests in flight; Python
    needs a process each for its interpreter lock); the batch path is also printed as ``a.procs``
    processes of one caller each."""
    one_process = f"one node process, {a.procs} callers"
    send_argv = [address, "send", TOPIC, str(a.procs), str(each), str(PER_CALL), str(a.body)]
    got = run_node(node, [send_argv])
    res.add("send from Node.js, plain messages", got, "msg/s",
            note=f"{one_process}, @grpc/grpc-js, {PER_CALL} per call, ack=flush")
    res.add("Node send (plain messages) / Python client send", got / send_rate, "x")
    ratio, note = in_rounds(a.rounds, lambda: sends(address, each, a),
                            lambda: run_node(node, [[address, "send-batch", *send_argv[2:]]]))
    target, ok = common.at_least(ratio, 0.7)
    res.add("Node send (batches encoded in JS) / Python client send", ratio, "x", target=target, ok=ok,
            note=f"{one_process}; {note}")
    got = run_node(node, [[address, "send-batch", TOPIC, "1", str(each), str(PER_CALL), str(a.body)]] * a.procs)
    res.add("Node send (batches encoded in JS), a process per caller / Python client send", got / send_rate, "x",
            note=f"{a.procs} node processes: {got:,.0f} msg/s")
    queues = ",".join(f"{q}:{ends[q]}" for q in range(QUEUES))
    got = run_node(node, [[address, "pull", TOPIC, queues, str(PER_CALL)]])
    res.add("pull from Node.js, decode = true", got, "msg/s", note=f"one node process, a caller per queue ({QUEUES})")
    res.add("Node pull (decode = true) / Python client pull", got / pull_rate, "x")
    ratio, note = in_rounds(a.rounds, lambda: python_pulls(address, ends),
                            lambda: run_node(node, [[address, "pull-batch", TOPIC, queues, str(PER_CALL)]]))
    target, ok = common.at_least(ratio, 0.7)
    res.add("Node pull (batches read in JS) / Python client pull", ratio, "x", target=target, ok=ok,
            note=f"one node process, a caller per queue ({QUEUES}); {note}")
    got = run_node(node, [[address, "pull-batch", TOPIC, f"{q}:{ends[q]}", str(PER_CALL)] for q in range(QUEUES)])
    res.add("Node pull (batches read in JS), a process per queue / Python client pull", got / pull_rate, "x",
            note=f"{QUEUES} node processes: {got:,.0f} msg/s")


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--body", type=int, default=KiB)
    p.add_argument("--rounds", type=int, default=5, help="pairs of phases: batches then plain sends; our client then Node (batches in JS)")
    a = p.parse_args()
    if a.quick:
        a.messages, a.rounds = 20_000, 1
    res = Results("plain_api", a.results, {"messages": a.messages, "procs": a.procs, "body": a.body})
    common.preflight(res, a.max_wait_quiet)
    each = a.messages // a.procs
    with common.temp_dir("tm-plain-", a.workdir) as work, common.running_daemon(work, "n") as d, \
            BrokerClient(d.address) as c:
        c.create_topic(TOPIC, queues=QUEUES)
        assert d.proc is not None
        pid = d.proc.pid
        rounds: list[dict[bool, float]] = []
        cpu_rounds: list[dict[bool, float]] = []  # the daemon's CPU per message (us), each phase
        ends: list[int] = []
        for i in range(a.rounds):  # each round: client-encoded batches, then plain messages
            rates: dict[bool, float] = {}
            cpu: dict[bool, float] = {}
            for plain in (False, True):
                cpu0 = common.cpu_seconds_of(pid)
                rates[plain] = sends(d.address, each, a, plain)
                cpu[plain] = (common.cpu_seconds_of(pid) - cpu0) / (each * a.procs) * 1e6
            rounds.append(rates)
            cpu_rounds.append(cpu)
            common.log(f"round {i + 1}: batches {rates[False]:,.0f} msg/s, plain {rates[True]:,.0f} msg/s = "
                       f"{rates[True] / rates[False]:.2f}x; the daemon's CPU per message {cpu[False]:.2f} / "
                       f"{cpu[True]:.2f} us")
            if not ends:  # the pulls read what the first round stored
                common.wait_applied(c)
                ends = c.list_topics()[TOPIC]["max_offsets"]
        rates = {plain: statistics.median(r[plain] for r in rounds) for plain in (False, True)}
        ratio = statistics.median(r[True] / r[False] for r in rounds)
        res.add("send, client-encoded batches (BrokerClient.send)", rates[False], "msg/s",
                note=f"{a.procs} processes, {PER_CALL} x {a.body} B per call, ack=flush; median of {a.rounds} rounds")
        res.add("send, plain messages (server encodes)", rates[True], "msg/s")
        target, ok = common.at_least(ratio, 0.8)
        res.add("plain / client-encoded send", ratio, "x", target=target, ok=ok,
                note=f"median of {a.rounds} rounds' ratios (batches/plain msg/s): "
                     + ", ".join(f"{r[False]:,.0f}/{r[True]:,.0f}" for r in rounds))
        untuned = sends(d.address, each, a, plain=True, untuned=True)  # as a process with glibc's defaults sends
        res.add("plain sends from processes with glibc's allocator defaults / client-encoded", untuned / rates[False],
                "x", note=f"{untuned:,.0f} msg/s, one phase; upb serialises 1 MiB in about 1.1 ms then (page "
                          "faults of fresh buffers), 0.1 ms tuned")
        for plain, name in ((False, "client-encoded batches"), (True, "plain messages")):
            res.add(f"the daemon's CPU per message sent, {name}", statistics.median(r[plain] for r in cpu_rounds),
                    "us", note=f"median of {a.rounds} rounds (less noisy than the rates: the machine's other work "
                               "does not count)" if plain else "")
        pulls = {}
        for decode in (False, True):
            start_at = time.time() + 2.0
            pulls[decode] = rate(load.run_processes(puller, [(d.address, q, ends[q], decode, start_at)
                                                             for q in range(QUEUES)], timeout_s=1800))
        res.add("pull, batches decoded by the client (bodies())", pulls[False], "msg/s",
                note=f"{QUEUES} processes, {PER_CALL} per call, {sum(ends):,} messages")
        res.add("pull, decode = true (server decodes)", pulls[True], "msg/s")
        target, ok = common.at_least(pulls[True] / pulls[False], 0.7)
        res.add("decoded / batch pull", pulls[True] / pulls[False], "x", target=target, ok=ok)
        node, why = node_ready()
        if node is None:
            res.add("Node.js send and pull", 0, "msg/s", note=f"not measured: {why}")
        else:
            node_rows(res, node, d.address, each, a, rates[False], pulls[False], ends)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
