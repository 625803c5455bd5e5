"""The nemesis: faults on a schedule drawn from the run's seed, each recorded (start and end) in
the history as client ``nemesis``.

Every fault is applied to the node that holds a role when it starts (``master`` or ``slave``), or
to a shared part (etcd, object storage, the replication link), held for a few seconds, then healed;
the next one waits until the pair has a master again (or a settle timeout, recorded). With two
shards a node fault (and ``power_loss_both``) strikes a pair drawn from the seed, and the run
settles when every shard has a master.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from broker.client import BrokerClient, BrokerError
from broker.group_slots import slot_of
from tests.chaos.cluster import Cluster, Node
from tests.chaos.history import Recorder, now_ms
from tests.chaos.workload import SUB_GROUP, TXN_QUEUES, TXN_TOPIC

KINDS = ("kill9", "sigstop", "isolate", "link_delay", "disk_full", "power_loss", "power_loss_both", "s3_fail",
         "s3_slow", "etcd_kill", "etcd_pause", "clock_jump")
NODE_KINDS = {"kill9", "sigstop", "isolate", "disk_full", "power_loss", "clock_jump"}
# kinds only a cluster of shards has, drawn only there (so a pair's seeds replay as before):
# ``queue_move`` moves a queue of the transactions' topic to another shard (docs/shards.md), in the
# background, so that the faults after it may strike the move itself; that topic has a pop group
# of its own (``txpopper``: its leases follow the queues away and back, ``pops_complete`` checks
# it). The first topic is not moved (its RTO and order checkers take a queue's shard as fixed).
# ``slot_move`` moves the group slot of the subscribe group to another shard (its committed offsets
# go along; its members join the new coordinator), also in the background.
SHARD_KINDS = ("queue_move", "slot_move")
SETTLE_S = 30.0
RESTART_SEC_S = 2.0  # deploy/systemd/tidemark-*.service RestartSec


@dataclass
class Fault:
    kind: str
    target: str  # a node ("a"/"b", "c"/"d" of a second shard), "both" ("both:<shard>"), or "etcd", "s3", "link"
    role: str  # the target's role when the fault started ("" for shared parts)
    heal: Callable[[], None]
    detail: dict[str, object]


class Nemesis:
    def __init__(self, cluster: Cluster, rec: Recorder, seed: int, kinds: tuple[str, ...] = KINDS,
                 hold_s: tuple[float, float] = (2.0, 7.0), quiet_s: tuple[float, float] = (2.0, 5.0)) -> None:
        self.cluster, self.rec, self.kinds = cluster, rec, kinds
        self.rng = random.Random(seed)
        self.hold_s, self.quiet_s = hold_s, quiet_s
        self.counts: dict[str, int] = {}
        self.unsettled = 0

    def run(self, duration_s: float, stop: threading.Event) -> None:
        end = time.monotonic() + duration_s
        while not stop.is_set() and time.monotonic() < end:
            if stop.wait(self.rng.uniform(*self.quiet_s)):
                return
            kind = self.rng.choice(self.kinds)
            role = self.rng.choice(("master", "slave"))
            hold = self.rng.uniform(*self.hold_s)
            fault = self.inject(kind, role)
            stop.wait(min(hold, max(0.0, end - time.monotonic()) + 1.0))
            self.heal(fault)
            if self.settle():
                self.check_convergence()

    def _shard(self) -> str:
        """The pair a fault strikes (drawn only with several, so a pair's seeds replay as before)."""
        shards = self.cluster.shards
        return shards[0] if len(shards) == 1 else self.rng.choice(shards)

    def _target(self, role: str) -> tuple[Node, str]:
        shard = self._shard()
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            master = self.cluster.master(shard)
            if master is not None:
                return (master, "master") if role == "master" else (self.cluster.other(master), "slave")
            time.sleep(0.2)
        node = self.cluster.of(shard)[0]
        return node, "unknown"

    def inject(self, kind: str, role: str) -> Fault:
        c = self.cluster
        detail: dict[str, object] = {}
        heal: Callable[[], None]
        if kind in NODE_KINDS:
            node, role = self._target(role)
            target = node.name
            if node.shard:
                detail["shard"] = node.shard
            if kind == "kill9":
                node.daemon.kill9()
                heal = self._restart(node)
            elif kind == "power_loss":
                detail["dropped_bytes"] = node.power_loss()
                heal = self._restart(node)
            elif kind == "sigstop":
                assert node.daemon.proc is not None
                node.daemon.proc.send_signal(signal.SIGSTOP)
                heal = self._cont(node)
            elif kind == "isolate":
                node.to_etcd.silence()
                node.to_repl.silence()
                c.other(node).to_repl.silence()  # as a slave it streams from the other's replication port
                heal = c.heal_network
            elif kind == "disk_full":
                node.fill_disk()
                heal = node.free_disk
            else:  # clock_jump
                offset_ms = self.rng.choice((1, -1)) * self.rng.randint(2_000, 30_000)
                node.set_clock_offset(offset_ms)
                detail["offset_ms"] = offset_ms
                heal = self._clock_back(node)
        else:
            role = ""
            if kind == "power_loss_both":  # the whole room loses power: both nodes (of a pair) at once
                shard = self._shard()
                target = f"both:{shard}" if shard else "both"
                pair = c.of(shard)
                detail["nodes"] = [n.name for n in pair]
                if shard:
                    detail["shard"] = shard
                for node in pair:
                    detail[f"dropped_bytes_{node.name}"] = node.power_loss()
                heal = self._restart_all(pair)
            elif kind == "link_delay":
                target = "link"
                delay_s = self.rng.uniform(0.05, 0.3)
                for node in c.nodes.values():
                    node.to_repl.delay_s = delay_s
                detail["delay_ms"] = round(delay_s * 1000)
                heal = c.heal_network
            elif kind in ("s3_fail", "s3_slow"):
                target = "s3"
                if kind == "s3_fail":
                    c.to_s3.cut()
                else:
                    c.to_s3.delay_s = 0.5
                heal = c.heal_network
            elif kind in SHARD_KINDS:
                target = "cluster"
                detail.update(self._move() if kind == "queue_move" else self._move_slot())
                heal = _nothing
            elif kind == "etcd_kill":
                target = "etcd"
                c.etcd.kill9()
                heal = self._etcd_start
            else:  # etcd_pause
                target = "etcd"
                c.etcd.pause()
                heal = c.etcd.resume
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.rec.record("fault", {"kind": kind, "node": target, "role": role, "phase": "start", **detail}, "ok",
                        now_ms())
        return Fault(kind, target, role, heal, detail)

    def _move(self) -> dict[str, object]:
        """Ask for a move of one queue of the transactions' topic to another shard, in a thread;
        its outcome is recorded as op ``queue_move`` when it ends."""
        queue = self.rng.randrange(TXN_QUEUES)
        pick = self.rng.randrange(len(self.cluster.shards) - 1)  # which of the other shards (drawn here: the seed)

        def move() -> None:
            invoked = now_ms()
            value: dict[str, object] = {"topic": TXN_TOPIC, "queue": queue}
            try:
                with BrokerClient(self.cluster.addresses, timeout_s=30) as c:
                    owner = c.describe_topic(TXN_TOPIC)["queues"][queue]["shard"]
                    others = [s for s in self.cluster.shards if s != owner]
                    value.update({"from": owner, "to": others[pick % len(others)]})
                    segments = c.move_queue(TXN_TOPIC, queue, str(value["to"]), timeout_ms=60_000)
                self.rec.record("queue_move", value, "ok", invoked, result={"segments": len(segments)})
            except BrokerError as exc:
                self.rec.record("queue_move", value, "fail", invoked, error=str(exc)[:300])

        threading.Thread(target=move, name=f"move-{queue}", daemon=True).start()
        return {"topic": TXN_TOPIC, "queue": queue}

    def _move_slot(self) -> dict[str, object]:
        """Ask for a move of the subscribe group's slot to another shard, in a thread; its outcome is
        recorded as op ``slot_move`` when it ends."""
        slot = slot_of(SUB_GROUP)
        pick = self.rng.randrange(len(self.cluster.shards) - 1)

        def move() -> None:
            invoked = now_ms()
            value: dict[str, object] = {"group": SUB_GROUP, "slot": slot}
            try:
                with BrokerClient(self.cluster.addresses, timeout_s=30) as c:
                    owner = c.describe_group(SUB_GROUP)["shard"]
                    others = [s for s in self.cluster.shards if s != owner]
                    value.update({"from": owner, "to": others[pick % len(others)]})
                    c.move_slot(slot, str(value["to"]), timeout_ms=120_000)
                self.rec.record("slot_move", value, "ok", invoked)
            except BrokerError as exc:
                self.rec.record("slot_move", value, "fail", invoked, error=str(exc)[:300])

        threading.Thread(target=move, name=f"slot-move-{slot}", daemon=True).start()
        return {"group": SUB_GROUP, "slot": slot}

    def heal(self, fault: Fault) -> None:
        fault.heal()
        self.rec.record("fault", {"kind": fault.kind, "node": fault.target, "role": fault.role, "phase": "end",
                                  **fault.detail}, "ok", now_ms())

    def settle(self) -> bool:
        """Wait until both nodes run and one is the unfenced master. A node that exited on its own
        (every fault is healed by now) is started again as systemd's ``Restart=on-failure`` would
        (deploy/systemd: ``RestartSec=2s``, not after exit code 2), and the exit is recorded (op
        ``node_exit``): the next fault must not strike the only node left."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            self._restart_exited()
            if all(n.alive() for n in self.cluster.nodes.values()) and \
                    all(self.cluster.master(shard) is not None for shard in self.cluster.shards):
                return True
            time.sleep(0.2)
        self.unsettled += 1
        self.rec.record("fault", {"kind": "unsettled", "node": "", "role": "", "phase": "end"}, "ok", now_ms())
        return False

    def _restart_exited(self) -> None:
        for node in self.cluster.nodes.values():
            proc = node.daemon.proc
            code = proc.poll() if proc is not None else None
            if code is None or code in (0, 2):  # Restart=on-failure, RestartPreventExitStatus=2
                continue
            self.rec.record("node_exit", {"node": node.name, "code": code}, "ok", now_ms())
            time.sleep(RESTART_SEC_S)
            node.daemon.start(60)

    def check_convergence(self) -> None:
        """After a heal: both logs of each pair byte-identical below their common confirm offset
        (history op ``converge``; outcome fail when the slave was not back in sync within a minute)."""
        for shard in self.cluster.shards:
            value = {"shard": shard} if shard else {}
            t0 = now_ms()
            try:
                result = self.cluster.compare_logs(shard)
            except Exception as exc:  # recorded: the checker counts it
                self.rec.record("converge", value, "unknown", t0, error=repr(exc))
                continue
            if result is None:
                self.rec.record("converge", value, "fail", t0, error="the slave was not in sync within 60 s")
            else:
                self.rec.record("converge", value, "ok", t0, result=result)

    @staticmethod
    def _restart(node: Node) -> Callable[[], None]:
        def heal() -> None:
            node.daemon.start(60)
        return heal

    @staticmethod
    def _cont(node: Node) -> Callable[[], None]:
        def heal() -> None:
            assert node.daemon.proc is not None
            node.daemon.proc.send_signal(signal.SIGCONT)
        return heal

    @staticmethod
    def _clock_back(node: Node) -> Callable[[], None]:
        return lambda: node.set_clock_offset(0)

    @staticmethod
    def _restart_all(nodes: list[Node]) -> Callable[[], None]:
        def heal() -> None:
            for node in nodes:
                node.daemon.start(60, wait=False)
            for node in nodes:
                node.daemon.wait_ready(60)
        return heal

    def _etcd_start(self) -> None:
        self.cluster.etcd.start()

    def heal_all(self) -> None:
        """Whatever is still broken at the end of a run: every link, etcd, both nodes."""
        c = self.cluster
        c.heal_network()
        if c.etcd.proc is not None and c.etcd.proc.poll() is None:
            c.etcd.resume()
        else:
            c.etcd.start()
        for node in c.nodes.values():
            node.free_disk()
            node.set_clock_offset(0)
            if node.alive():
                assert node.daemon.proc is not None
                node.daemon.proc.send_signal(signal.SIGCONT)
            else:
                node.daemon.start(60)


def _nothing() -> None:
    """A fault healed by itself (a queue move ends on its own)."""
