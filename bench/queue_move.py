"""Moving a queue between shards (issue 39, docs/shards.md "Moving a queue"): the write pause of a
keyed ack=replica producer through 20 moves of its queue, and whether anything acknowledged was
lost, repeated or reordered; a rebalance onto a third shard.

Two shards of two nodes each (a real etcd, every process on this machine); one topic of two
queues; one client sends one message at a time, ack=replica, with a key of the queue that moves;
the queue moves back and forth between the shards (``move_queue``), a second apart. A move's pause
is the longest gap between two acknowledgements around it. At the end every acknowledged message
is read back from offset 0 (across every segment).

``rebalance``: two single-node shards hold 8 topics x 16 queues; 8 producers (one per topic, one
key each, ack=flush) send throughout; a third shard joins and ``rebalance()`` runs: the queues
moved against the fewest that even the shards out, the whole rebalance's time, and each
producer's longest pause.

``drain``: two single-node shards, 200 groups with offsets on 16 queues each; a committer of a
group s1 coordinates commits every 10 ms; ``rebalance(drain="s1")`` moves s1's queues and group
slots: slots moved, time, the committer's longest pause, offsets lost (every group read back).

Usage: .venv/bin/python bench/queue_move.py [--quick] [--parts moves,rebalance,drain] [--moves 20]
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import threading
import time
from typing import Any

import common
import crc32c
from common import Results, log

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, BrokerError, Message
from tests.failoverutil import coordinated, in_sync, wait_master
from tests.procs import DaemonProcess

TOPIC = "moving"
PAUSE_TARGET_S = 1.0


class KeyedSender:
    """One message at a time, ack=replica, one key: (ack time, queue offset, body) of each."""

    def __init__(self, client: BrokerClient, key: str, topic: str = TOPIC, ack: str = "replica") -> None:
        self.client, self.key, self.topic, self.ack = client, key, topic, ack
        self.acks: list[tuple[float, int, bytes]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for i in itertools.count():
            if self._stop.is_set():
                return
            body = f"m{i:08d}".encode()
            try:
                r = self.client.send(self.topic, [Message(body, key=self.key)], ack=self.ack)[0]
            except BrokerError as exc:
                self.errors.append(str(exc)[:200])
                continue
            self.acks.append((time.monotonic(), r.queue_offset, body))

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time without an acknowledgement from ``start`` (the move asked) until the
        first acknowledgement after ``end`` (its call answered)."""
        after = next((t for t, _, _ in self.acks if t >= end), end)
        times = [start, *(t for t, _, _ in self.acks if start < t < end), after]
        return max(b - a for a, b in itertools.pairwise(times))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def _percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def moves(res: Results, a: Any, workdir: str) -> None:
    etcd = EtcdProcess(os.path.join(workdir, "etcd")).start()
    nodes: dict[str, list[DaemonProcess]] = {}
    try:
        for shard, names in (("s1", ("a", "b")), ("s2", ("c", "d"))):
            nodes[shard] = [DaemonProcess(os.path.join(workdir, n), config=coordinated(
                etcd.endpoint, **{"coordinator.cluster": "moves", "coordinator.shard": shard})).start(60) for n in names]
        for pair in nodes.values():
            master = wait_master(pair, 60)
            other = pair[1] if master is pair[0] else pair[0]
            common.wait_for(lambda m=master, o=other: in_sync(m, o), 60, "the slave in sync")
        addresses = [d.address for pair in nodes.values() for d in pair]
        with BrokerClient(addresses) as client, BrokerClient(addresses) as admin:
            client.create_topic(TOPIC, queues=2)
            owners = [q["shard"] for q in client.describe_topic(TOPIC)["queues"]]
            queue = owners.index("s1")
            key = next(k for k in (f"k{i}" for i in range(10_000)) if crc32c.crc32c(k.encode()) % 2 == queue)
            common.wait_for(lambda: _sent(client, key), 30, "the topic created on both shards")
            sender = KeyedSender(client, key)
            pauses, durations = [], []
            try:
                time.sleep(1.0)
                for i in range(a.moves):
                    target = "s2" if i % 2 == 0 else "s1"
                    t0 = time.monotonic()
                    admin.move_queue(TOPIC, queue, target, timeout_ms=60_000)
                    t1 = time.monotonic()
                    time.sleep(a.between_s)
                    pauses.append(sender.longest_gap(t0, t1))
                    durations.append(t1 - t0)
                    log(f"move {i + 1} to {target}: {durations[-1] * 1000:.0f} ms, write pause {pauses[-1] * 1000:.0f} ms")
                quiet_end = time.monotonic()
            finally:
                sender.stop()
            steady = [b - x for (x, _, _), (b, _, _) in itertools.pairwise(sender.acks) if b < quiet_end]
            read = [(m.queue_offset, bytes(m.body)) for r in client.iter_pull(TOPIC, queue, 0) for m in r]
        mine = [(o, b) for o, b in read if b.startswith(b"m")]
        acked = [(o, b) for _, o, b in sender.acks]
        got = set(mine)
        lost = sum(1 for x in acked if x not in got)
        bodies = [b for _, b in mine]
        repeated = len(bodies) - len(set(bodies))
        order_kept = [x for x in mine if x in set(acked)] == acked and [o for o, _ in read] == list(range(len(read)))
        params = {"moves": a.moves, "between_s": a.between_s, "shards": "2 x (master + slave)", "ack": "replica"}
        target, ok = common.at_most(_percentile(pauses, 99), PAUSE_TARGET_S)
        res.add("write pause per move, p50", statistics.median(pauses), "s", **params)
        res.add("write pause per move, p99", _percentile(pauses, 99), "s", target=target, ok=ok, **params)
        res.add("write pause per move, max", max(pauses), "s", **params)
        res.add("a move's call (asked to target writing), p50 / p99", statistics.median(durations), "s",
                p99_s=round(_percentile(durations, 99), 3), **params)
        res.add("gap between acknowledgements outside moves, p99 (the producer's own pace)", _percentile(steady, 99),
                "s", messages_acked=len(acked), **params)
        res.add("acknowledged messages lost", lost, "", target="0", ok=lost == 0, **params)
        res.add("messages stored twice", repeated, "", target="0", ok=repeated == 0, **params)
        res.add("order kept and offsets contiguous over every segment", 1 if order_kept else 0, "", target="1",
                ok=order_kept, send_errors=len(sender.errors), **params)
    finally:
        for pair in nodes.values():
            for d in pair:
                d.kill9()
        etcd.kill9()


def rebalance(res: Results, a: Any, workdir: str) -> None:
    etcd = EtcdProcess(os.path.join(workdir, "etcd-rb")).start()
    nodes: list[DaemonProcess] = []

    def shard(name: str, s: str) -> DaemonProcess:
        d = DaemonProcess(os.path.join(workdir, name), config=coordinated(
            etcd.endpoint, **{"coordinator.cluster": "rebalance", "coordinator.shard": s})).start(60)
        nodes.append(d)
        wait_master([d], 60)
        return d

    try:
        first = shard("r1", "s1")
        shard("r2", "s2")
        topics = {f"t{i}": a.queues for i in range(a.topics)}
        with BrokerClient([d.address for d in nodes]) as client:
            client.create_topics(topics)
            senders = []
            for t in topics:
                key = f"{t}-key"
                common.wait_for(lambda t=t, key=key: _sent(client, key, t), 30, f"{t} created on both shards")
                senders.append(KeyedSender(client, key, topic=t, ack="flush"))
            time.sleep(2.0)
            third = shard("r3", "s3")
            counts = {s["shard"]: s["queues"] for s in client.cluster_status()["shards"]}
            total = sum(counts.values())
            fewest = sum(max(0, n - -(-total // 3)) for n in counts.values())  # the excess over ceil(total/3)
            t0 = time.monotonic()
            done = client.rebalance()
            t1 = time.monotonic()
            time.sleep(1.0)
            for s_ in senders:
                s_.stop()
            after = {s["shard"]: s["queues"] for s in client.cluster_status()["shards"]}
            pauses = [s_.longest_gap(t0, t1) for s_ in senders]
            errors = sum(1 for m in done if m["error"]) + sum(len(s_.errors) for s_ in senders)
            seconds = sorted(m["seconds"] for m in done)
        log(f"rebalance: {len(done)} moves in {t1 - t0:.2f} s; shards {counts} -> {after}; longest pauses "
            f"{[round(p, 3) for p in pauses]}")
        params = {"topics": a.topics, "queues": a.queues, "shards": "2 + 1 joining, one node each", "ack": "flush",
                  "producers": len(topics), "third": third.address, "first": first.address}
        res.add("rebalance onto a third shard: queues moved / the fewest that even out", len(done), "",
                target=str(fewest), ok=len(done) == fewest, after=str(after), **params)
        res.add("rebalance onto a third shard: total time", t1 - t0, "s",
                move_p50_s=round(statistics.median(seconds), 3), move_max_s=round(seconds[-1], 3), **params)
        res.add("rebalance onto a third shard: producers' longest pause (max over producers)", max(pauses), "s",
                median_over_producers_s=round(statistics.median(pauses), 3), errors=errors, **params)
    finally:
        for d in nodes:
            d.kill9()
        etcd.kill9()


def drain(res: Results, a: Any, workdir: str) -> None:
    """A shard coordinating groups drained away: its queues and its group slots move; a committer
    of one of its groups commits throughout; every group's offsets read back after."""
    etcd = EtcdProcess(os.path.join(workdir, "etcd-dr")).start()
    nodes: list[DaemonProcess] = []
    try:
        for name, s_ in (("d1", "s1"), ("d2", "s2")):
            d = DaemonProcess(os.path.join(workdir, name), config=coordinated(
                etcd.endpoint, **{"coordinator.cluster": "drain", "coordinator.shard": s_})).start(60)
            nodes.append(d)
            wait_master([d], 60)
        with BrokerClient([d.address for d in nodes]) as client:
            client.create_topic("work", queues=a.queues)
            common.wait_for(lambda: all(_sent(client, f"k{q}", "work") for q in range(a.queues)), 30, "work created")
            groups = [f"g{i}" for i in range(a.groups)]
            want = {g: {("work", q): 0 for q in range(a.queues)} for g in groups}  # 0: a queue may be empty
            for g in groups:
                client.commit_offsets(g, want[g])
            committer_group = next(g for g in groups if client.describe_group(g)["shard"] == "s1")
            stop = threading.Event()
            acks: list[float] = []
            errors: list[str] = []

            def commit() -> None:
                with client.clone() as own:
                    while not stop.is_set():
                        try:
                            own.commit_offsets(committer_group, {("work", 0): 0})
                            acks.append(time.monotonic())
                        except BrokerError as exc:
                            errors.append(str(exc)[:200])
                        time.sleep(0.01)

            thread = threading.Thread(target=commit, daemon=True)
            thread.start()
            time.sleep(1.0)
            slots_before = {s["shard"]: s["slots"] for s in client.cluster_status()["shards"]}
            t0 = time.monotonic()
            done = client.rebalance(drain="s1")
            t1 = time.monotonic()
            time.sleep(0.5)
            stop.set()
            thread.join(10)
            slot_moves = [m for m in done if not m["topic"]]
            status = next(s for s in client.cluster_status()["shards"] if s["shard"] == "s1")
            lost = sum(1 for g in groups for (t, q), o in want[g].items() if client.committed_offset(g, t, q) != o)
        around = [x for x in acks if x >= t0 - 0.5]
        pause = max((y - x for x, y in itertools.pairwise(around)), default=0.0)
        log(f"drain: {len(done)} moves ({len(slot_moves)} slots) in {t1 - t0:.2f} s; slots {slots_before}; "
            f"s1 drained={status['drained']}; committer's longest pause {pause:.3f} s; {lost} offsets lost")
        params = {"groups": a.groups, "queues": a.queues, "offsets": a.groups * a.queues,
                  "shards": "2, one node each", "drained": status["drained"]}
        res.add("drain of a shard coordinating groups: slots moved", len(slot_moves), "",
                target=str(slots_before.get("s1", 0)), ok=len(slot_moves) == slots_before.get("s1", 0)
                and status["drained"], **params)
        res.add("drain of a shard coordinating groups: total time (queues and slots)", t1 - t0, "s",
                slot_move_p50_s=round(statistics.median([m["seconds"] for m in slot_moves] or [0.0]), 3), **params)
        res.add("drain: a committer's longest pause", pause, "s", errors=len(errors), **params)
        res.add("drain: committed offsets lost", lost, "", target="0", ok=lost == 0, **params)
    finally:
        for d in nodes:
            d.kill9()
        etcd.kill9()


def _sent(client: BrokerClient, key: str, topic: str = TOPIC) -> bool:
    try:
        client.send(topic, [Message(b"probe", key=key)], ack="replica")
    except BrokerError:
        return False
    return True


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--parts", default="moves,rebalance,drain")
    p.add_argument("--groups", type=int, default=200, help="drain: groups with committed offsets")
    p.add_argument("--moves", type=int, default=20)
    p.add_argument("--topics", type=int, default=8, help="rebalance: topics")
    p.add_argument("--queues", type=int, default=16, help="rebalance: queues per topic")
    p.add_argument("--between-s", type=float, default=1.0, help="sends between two moves, in seconds")
    a = p.parse_args()
    if a.quick:
        a.moves, a.topics, a.queues, a.groups = 4, 4, 6, 20
    res = Results("queue_move", a.results, {"quick": a.quick})
    common.preflight(res, a.max_wait_quiet)
    parts = set(a.parts.split(","))
    with common.temp_dir("tm-moves-", a.workdir) as workdir:
        if "moves" in parts:
            moves(res, a, workdir)
        if "rebalance" in parts:
            rebalance(res, a, workdir)
        if "drain" in parts:
            drain(res, a, workdir)
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
