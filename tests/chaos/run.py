"""One chaos run: ``python -m tests.chaos.run --duration 3m --seed 42 --dir /tmp/chaos-42``.

Starts etcd, an S3 server and a pair (tests/chaos/cluster.py), the workload's client processes
(tests/chaos/workload.py) and the nemesis (tests/chaos/faults.py) for ``--duration``; then heals
everything, lets the pair converge, stops the clients, reads the final state (every stored message
from the master, each node's metadata and log digest) and runs the offline checkers
(tests/chaos/checkers.py) on the history. Prints the seed first and the summary table last, and
writes both, the history, ``final.json`` and every process's log into the run's directory.
Exit status 0 when every checker passed, 1 otherwise.

``--shards 2``: two pairs as two shards of one cluster (nodes a, b and c, d), the workload's topics
placed over both and its groups coordinated by one of them; node faults strike a pair drawn from
the seed; each pair's logs and metadata are compared on their own. The transactional topic's two queues
are placed one on each shard, so each transaction spans both shards (a two-phase commit,
docs/shards.md), and its coordinator shard is the transactional id's slot's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from broker.client import BrokerClient, BrokerError
from broker.errors import OWNER_SHARD_KEY
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.chaos import checkers, workload
from tests.chaos.cluster import Cluster, Node
from tests.chaos.faults import KINDS, SHARD_KINDS, Nemesis
from tests.chaos.history import Recorder, client_ops, load, now_ms, write_json
from tests.chaos.workload import (
    POP_GROUP,
    QUEUES,
    SUB_GROUP,
    TOPIC,
    TXN_POP_GROUP,
    TXN_QUEUES,
    TXN_TOPIC,
    body_id,
)

CLIENTS = (("producer", "p1"), ("producer", "p2"), ("subscriber", "s1"), ("subscriber", "s2"), ("popper", "q1"),
           ("carrier", "q2"), ("creator", "c1"), ("sampler", "sampler"), ("transactor", "t1"), ("txreader", "r1"),
           ("txpopper", "x1"))
CONVERGE_S = 120.0
ROOT = Path(workload.__file__).resolve().parents[2]


@dataclass
class Outcome:
    seed: int
    run_dir: Path
    verdicts: list[checkers.Verdict]
    table: str

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)


def duration_s(text: str) -> float:
    """``180``, ``180s``, ``3m``, ``1h``."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 180, 3m, 30m, 1h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] chaos: {msg}", flush=True)


def run(duration: float, seed: int, run_dir: Path, *, kinds: tuple[str, ...] = KINDS, mount: bool = True,
        rto_p99_max_ms: float = 3000.0, shards: int = 1) -> Outcome:
    run_dir.mkdir(parents=True, exist_ok=True)
    log(f"seed {seed}; run directory {run_dir}; {duration:.0f} s of faults: {', '.join(kinds)}"
        + (f"; {shards} shards" if shards > 1 else ""))
    cluster = Cluster(run_dir, mount=mount, shards=tuple(f"s{i + 1}" for i in range(shards)) if shards > 1 else ("",))
    clients: dict[str, subprocess.Popen[bytes]] = {}
    roles = list(CLIENTS)
    final: dict[str, Any] = {}
    try:
        _wait(lambda: all(cluster.master(s) is not None for s in cluster.shards), 60, "a master elected (each shard)")
        with BrokerClient(cluster.addresses, timeout_s=30) as c:
            if cluster.sharded:  # the creating node's copy of etcd must see every shard's master
                _wait(lambda: sum(bool(s["master"]) for s in c.cluster_status()["shards"]) == len(cluster.shards), 60,
                      "every shard's master in the cluster's routes")
            c.create_topic(TOPIC, queues=QUEUES)
            c.create_topic(TXN_TOPIC, queues=TXN_QUEUES)
            placed = {q["shard"] for q in c.describe_topic(TOPIC)["queues"]} if cluster.sharded else {""}
            assert placed == set(cluster.shards), f"the workload's topic placed on {sorted(placed)}, not on every shard"
        for role, name in roles:
            clients[name] = _start_client(role, name, cluster, run_dir, seed)
        nemesis = Nemesis(cluster, Recorder(run_dir, "nemesis"), seed, kinds)
        stop = threading.Event()
        nemesis.run(duration, stop)
        log(f"faults done ({sum(nemesis.counts.values())}: {nemesis.counts}); healing")
        nemesis.heal_all()
        healed_ms = now_ms()
        _wait(lambda: _converged(cluster), CONVERGE_S, "a master with its slave in sync")
        # the producers run until a send invoked after the last heal succeeded: the last fault's
        # recovery is measured, not cut off (a fault that never recovers still shows as inf)
        _wait(lambda: _sent_ok_since(run_dir, healed_ms), rto_p99_max_ms / 1000.0 + 2.0,
              "a send succeeded after the last heal", fatal=False)
        _stop_clients(clients, tuple(n for n in ("p1", "p2", "c1", "t1") if n in clients))
        _wait(lambda: _no_open_transactions(cluster), 60, "every transaction ended (a lost abort times out)",
              fatal=False)
        _wait_timers_fired(run_dir)
        if not _wait(lambda: _drained(cluster), 60, "the groups caught up", fatal=False):
            _log_groups(cluster, run_dir)
        _stop_clients(clients, tuple(clients))
        exits = {name: proc.returncode for name, proc in clients.items()}
        final = _final_state(cluster)
        final["client_exit_codes"] = exits
        write_json(run_dir / "final.json", final)
    finally:
        for proc in clients.values():
            if proc.poll() is None:
                proc.kill()
        cluster.close()
    ops = load(run_dir)
    final["clock_skews"] = clock_skews(ops)
    verdicts = checkers.check_all(ops, final, rto_p99_max_ms=rto_p99_max_ms)
    table = f"seed {seed}, {duration:.0f} s\n" + checkers.summary_table(ops, verdicts)
    (run_dir / "summary.txt").write_text(table + "\n")
    return Outcome(seed, run_dir, verdicts, table)


def clock_skews(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The clock_jump windows of a run's history: node, start, end (None: never healed), offset."""
    out: list[dict[str, Any]] = []
    for op in ops:
        v = op["value"]
        if op["op"] != "fault" or v["kind"] != "clock_jump":
            continue
        if v["phase"] == "start":
            out.append({"node": v["node"], "start_ms": op["invoke_ms"], "end_ms": None, "offset_ms": v["offset_ms"]})
        else:
            for w in out:
                if w["node"] == v["node"] and w["end_ms"] is None:
                    w["end_ms"] = op["invoke_ms"]
    return out


def _wait(cond: Any, timeout_s: float, what: str, *, fatal: bool = True) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if cond():
                return True
        except BrokerError:
            pass
        time.sleep(0.3)
    if fatal:
        raise TimeoutError(f"chaos: not reached within {timeout_s:.0f} s: {what}")
    log(f"not reached within {timeout_s:.0f} s: {what}")
    return False


def _start_client(role: str, name: str, cluster: Cluster, run_dir: Path, seed: int) -> subprocess.Popen[bytes]:
    out = open(run_dir / f"client-{name}.log", "ab")  # noqa: SIM115 - handed to the child
    cmd = [sys.executable, "-m", "tests.chaos.workload", role, "--run", str(run_dir), "--name", name,
           "--addresses", ",".join(cluster.addresses), "--names", ",".join(cluster.nodes), "--seed", str(seed)]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    out.close()
    return proc


def _stop_clients(clients: dict[str, subprocess.Popen[bytes]], names: tuple[str, ...]) -> None:
    for name in names:
        if clients[name].poll() is None:
            clients[name].send_signal(signal.SIGTERM)
    for name in names:
        try:
            clients[name].wait(30)
        except subprocess.TimeoutExpired:
            clients[name].send_signal(signal.SIGUSR1)  # its threads' stacks go to its log
            time.sleep(1.0)
            log(f"client {name} did not stop on SIGTERM; killed (its threads' stacks are in client-{name}.log)")
            clients[name].kill()
            clients[name].wait()


def _converged(cluster: Cluster) -> bool:
    for shard in cluster.shards:
        master = cluster.master(shard)
        st = master.status() if master is not None else None
        if not (st and st["replicas"] and all(r["in_sync"] for r in st["replicas"])):
            return False
    return True


def _sent_ok_since(run_dir: Path, t_ms: float) -> bool:
    return any(op["op"] == "send" and op["outcome"] == "ok" and op["invoke_ms"] >= t_ms
               for name in ("p1", "p2") for op in client_ops(run_dir / "history" / f"{name}.jsonl"))


def _wait_timers_fired(run_dir: Path) -> None:
    latest = 0
    for op in load(run_dir):
        if op["op"] == "send":
            latest = max([latest, *(m["deliver_at_ms"] or 0 for m in op["value"]["msgs"])])
    left_s = latest / 1000.0 - time.time() + 3.0
    if left_s > 0:
        log(f"waiting {left_s:.1f} s for the last timer to be due")
        time.sleep(left_s)


def _drained(cluster: Cluster) -> bool:
    """Each group's lag is 0 on every queue (described queue by queue: over shards, a group's listed
    lag counts only the queues of the shard that reports it)."""
    with BrokerClient(cluster.addresses, timeout_s=5) as c:
        for g, topic, queues_n in ((SUB_GROUP, TOPIC, QUEUES), (POP_GROUP, TOPIC, QUEUES),
                                   (TXN_POP_GROUP, TXN_TOPIC, TXN_QUEUES)):
            queues = {q["queue_id"]: q for q in c.describe_group(g)["queues"] if q["topic"] == topic}
            if sorted(queues) != list(range(queues_n)) or any(q["lag"] or q["shard"] for q in queues.values()):
                return False  # a queue not told (its shard did not answer) is not drained
        return True


def _no_open_transactions(cluster: Cluster) -> bool:
    with BrokerClient(cluster.addresses, timeout_s=5) as c:
        return not c.list_transactions()


def _read_all(c: BrokerClient, topic: str, queues: int, unreadable: list[list[Any]]) -> list[Any]:
    """(queue, offset, message) of every record a read_committed reader sees in ``topic``. A queue
    whose start no read reaches any more (retention with tiered storage keeps every offset
    readable) is read from where it can be, and goes into ``unreadable`` as [topic, queue, min
    offset] for the ``readable`` checker: one verdict, not a run without any. A moved queue's start
    is its first segment's (``describe_topic`` gives the writer's segment's)."""
    out: list[Any] = []
    lows = {}
    for row in c.describe_topic(topic)["queues"]:
        lows[row["queue_id"]] = row["min_offset"]
        if len(row.get("segments", ())) > 1:  # moved: the writer's segment starts where the move cut it;
            # the earliest offset is its oldest segment's, told by the shard that wrote it
            lows[row["queue_id"]] = c.earliest_offset(topic, row["queue_id"])
    for q in range(queues):
        if lows.get(q, 0):
            unreadable.append([topic, q, lows[q]])
        out += [(q, m) for r in c.iter_pull(topic, q, lows.get(q, 0), max_messages=5000) for m in r]
    return out


def _log_groups(cluster: Cluster, run_dir: Path) -> None:
    """What a group that did not catch up holds (lag, leases in flight per queue), for the reader."""
    try:
        with BrokerClient(cluster.addresses, timeout_s=5) as c:
            described = {g: c.describe_group(g) for g in (SUB_GROUP, "chaos-pop")}
    except BrokerError as exc:
        log(f"groups: describe failed: {exc}")
        return
    write_json(run_dir / "groups.json", described)
    for g, d in described.items():
        log(f"group {g}: " + "; ".join(f"q{q['queue_id']} lag {q['lag']} in flight {q['in_flight']} "
                                       f"pop offset {q['pop_offset']} end {q['end_offset']}" for q in d["queues"]))


def _final_state(cluster: Cluster) -> dict[str, Any]:
    """Every message of the workload's topics (from the master; over shards, through a client
    routed to each queue's shard), then each pair's metadata and log digest once both its nodes
    have applied the same confirm offset."""
    for shard in cluster.shards:
        assert cluster.master(shard) is not None, f"no master of {shard or 'the pair'} at the end of the run"
    master = cluster.master()
    assert master is not None
    unreadable: list[list[Any]] = []
    with BrokerClient(cluster.addresses if cluster.sharded else master.address, timeout_s=30) as c:
        messages = [[TOPIC, q, m.queue_offset, body_id(m.body), m.store_time_ms, m.deliver_at_ms or 0,
                     m.timer_offset or 0] for q, m in _read_all(c, TOPIC, QUEUES, unreadable)]
        txn_messages = [[q, m.queue_offset, body_id(m.body)] for q, m in _read_all(c, TXN_TOPIC, TXN_QUEUES, unreadable)]
        open_transactions = len(c.list_transactions())
        queue_shards = [q["shard"] for q in c.describe_topic(TOPIC)["queues"]]
        if cluster.sharded:
            _wait(lambda: not c.cluster_status()["moves"], 60, "every queue move ended", fatal=False)
            moves_in_flight = c.cluster_status()["moves"]
            txn_segments = [q["segments"] for q in c.describe_topic(TXN_TOPIC)["queues"]]
    pairs = {shard: _pair_state(cluster, shard) for shard in cluster.shards}
    out: dict[str, Any] = {"messages": messages, "txn_messages": txn_messages, "open_transactions": open_transactions,
                           "unreadable": unreadable, "group_topics": [TOPIC], "clock_skews": [],
                           # each pop group, and which of the messages above its topic's are
                           "pop_groups": {POP_GROUP: "messages", TXN_POP_GROUP: "txn_messages"}}
    if cluster.sharded:
        out["shards"] = pairs
        out["node_shards"] = {n.name: n.shard for n in cluster.nodes.values()}  # RTO per shard (checkers.rto)
        out["queue_shards"] = queue_shards
        out["moves_in_flight"] = moves_in_flight
        out["txn_segments"] = txn_segments
    else:
        out.update(pairs[""])
    return out


def _pair_state(cluster: Cluster, shard: str) -> dict[str, Any]:
    """One pair's metadata and log digest below its common confirm offset (its nodes stopped)."""
    pair = cluster.of(shard)
    _wait(lambda: _same_applied(pair), 60, f"both nodes of {shard or 'the pair'} applied the same confirm offset")
    statuses = {n.name: n.status() for n in pair}
    compare_below = min(int(st["confirm_offset"]) for st in statuses.values() if st)
    nodes: dict[str, Any] = {n.name: {"metadata": _metadata(n)} for n in pair}
    for node in pair:
        node.daemon.stop()
    logs = {n.name: _log_bytes(n) for n in pair}
    low = max(first for first, _ in logs.values())
    for name, (first, data) in logs.items():
        nodes[name]["digest"] = hashlib.sha256(data[low - first : compare_below - first]).hexdigest()
        nodes[name]["log_range"] = [first, first + len(data)]
    return {"nodes": nodes, "compare_below": compare_below, "compare_from": low}


def _same_applied(pair: list[Node]) -> bool:
    sts = [n.status() for n in pair]
    if not all(sts):
        return False
    confirm = {int(st["confirm_offset"]) for st in sts if st}
    return len(confirm) == 1 and all(int(st["applied_offset"]) >= min(confirm) for st in sts if st)


def _metadata(node: Node) -> dict[str, Any]:
    """What this one node holds (never routed elsewhere): its topics, and the subscribe group's
    committed offsets where its shard coordinates the group (``None`` where another does)."""
    with grpc.insecure_channel(node.address) as channel:
        stub = pb_grpc.BrokerStub(channel)
        topics = {t.name: t.queues for t in _retried(lambda: stub.ListTopics(pb.ListTopicsRequest(), timeout=10)).topics}
        committed: dict[str, int | None] = {}
        for q in range(QUEUES):
            request = pb.GetOffsetRequest(group=SUB_GROUP, topic=TOPIC, queue_id=q)
            try:
                got = _retried(lambda request=request: stub.GetOffset(request, timeout=10))
            except grpc.RpcError as exc:
                owner = dict(exc.trailing_metadata() or ()).get(OWNER_SHARD_KEY)  # type: ignore[attr-defined]
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or not node.shard or not owner:  # type: ignore[attr-defined]
                    raise
                return {"topics": topics, "committed": f"coordinated by {owner}"}
            committed[str(q)] = int(got.offset) if got.found else None
    return {"topics": topics, "committed": committed}


def _retried(call: Any, attempts: int = 5) -> Any:
    """A read of one node, retried while it answers UNAVAILABLE (as the client would)."""
    for attempt in range(attempts):
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == attempts - 1:  # type: ignore[attr-defined]
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def _log_bytes(node: Node) -> tuple[int, bytes]:
    segs = sorted((Path(node.daemon.data_dir) / "log").glob("*.log"))
    return int(segs[0].name[:20]), b"".join(p.read_bytes() for p in segs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=duration_s, default=180.0, help="how long faults go on (180, 3m, 30m)")
    p.add_argument("--seed", type=int, default=None, help="replays a run (default: a new one, printed)")
    p.add_argument("--dir", type=Path, default=None, help="the run's directory (default /tmp/tidemark-chaos-<seed>)")
    p.add_argument("--kinds", default="", help=f"fault kinds, comma-separated (of {', '.join(KINDS + SHARD_KINDS)}; "
                   "default: all, the shard kinds with --shards)")
    p.add_argument("--no-mount", action="store_true", help="no tmpfs per node (no root): disk_full is left out")
    p.add_argument("--shards", type=int, default=1, choices=(1, 2, 3), help="pairs, as shards of one cluster")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    kinds = tuple(k for k in args.kinds.split(",") if k) or KINDS + (SHARD_KINDS if args.shards > 1 else ())
    unknown = set(kinds) - set(KINDS + SHARD_KINDS)
    if unknown:
        p.exit(2, f"chaos: unknown fault kinds: {', '.join(sorted(unknown))}\n")
    mount = not args.no_mount and os.geteuid() == 0
    if not mount:
        kinds = tuple(k for k in kinds if k != "disk_full")
    outcome = run(args.duration, seed, args.dir or Path(f"/tmp/tidemark-chaos-{seed}"), kinds=kinds, mount=mount,
                  shards=args.shards)
    print(outcome.table, flush=True)
    shards = f" --shards {args.shards}" if args.shards > 1 else ""
    print(f"replay: python -m tests.chaos.run --seed {seed} --duration {args.duration:.0f}{shards}", flush=True)
    sys.exit(0 if outcome.ok else 1)


if __name__ == "__main__":
    main()
