"""Helpers for the tests of moving queues between shards (docs/shards.md "Moving a queue")."""

from __future__ import annotations

import threading

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, BrokerError, Message
from tests.failoverutil import Spawn, coordinated, in_sync, status, wait_master
from tests.procs import DaemonProcess
from tests.test_shards import CLUSTER
from tests.waits import wait_until


def shard_node(spawn: Spawn, etcd: EtcdProcess, shard: str, name: str, env: dict[str, str] | None = None,
               master: bool = True) -> DaemonProcess:
    """One node of ``shard``; ``master``: wait until it is the shard's master (the first one is)."""
    node = spawn(name, config=coordinated(etcd.endpoint, **{"coordinator.cluster": CLUSTER, "coordinator.shard": shard}),
                 env=env or {})
    if master:
        wait_master([node])
    return node


def shard_pair(spawn: Spawn, etcd: EtcdProcess, shard: str, names: tuple[str, str],
               master_env: dict[str, str] | None = None) -> tuple[DaemonProcess, DaemonProcess]:
    """A pair whose first node is the master (with ``master_env``: a failpoint armed there only)."""
    master = shard_node(spawn, etcd, shard, names[0], master_env)
    slave = shard_node(spawn, etcd, shard, names[1], master=False)
    wait_until(lambda: in_sync(master, slave), 30, "the slave in sync", observe=lambda: status(slave))
    return master, slave


def owners(c: BrokerClient, topic: str) -> list[str]:
    return [q["shard"] for q in c.describe_topic(topic)["queues"]]


class KeyedProducer:
    """Sends one message at a time with one key (one queue), ack=replica, until stopped: every
    acknowledged (queue offset, body), and every failure."""

    def __init__(self, c: BrokerClient, topic: str, key: str) -> None:
        self.c, self.topic, self.key = c, topic, key
        self.acked: list[tuple[int, bytes]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keyed-producer")

    def __enter__(self) -> KeyedProducer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            body = f"m{i:06d}".encode()
            i += 1
            try:
                r = self.c.send(self.topic, [Message(body, key=self.key)], ack="replica")[0]
            except BrokerError as exc:  # say so; such a message may be stored, but never twice
                self.errors.append(f"{exc.code.name}: {exc.details[:160]}")
                continue
            self.acked.append((r.queue_offset, body))

    def wait_more(self, count: int, timeout_s: float = 30.0) -> None:
        """Until ``count`` more sends are acknowledged."""
        target = len(self.acked) + count
        wait_until(lambda: len(self.acked) >= target, timeout_s, f"{count} more sends acknowledged",
                   observe=lambda: self.errors[-3:])


def read_back(c: BrokerClient, topic: str, queue: int) -> list[tuple[int, bytes]]:
    return [(m.queue_offset, m.body) for r in c.iter_pull(topic, queue, 0) for m in r]


def check_once_in_order(read: list[tuple[int, bytes]], p: KeyedProducer) -> None:
    """Every acknowledged message read once, in order, at its receipt's offset; offsets continue."""
    assert [o for o, _ in read] == list(range(len(read))), "logical offsets continue over the segments"
    mine = [x for x in read if x[1].startswith(b"m")]
    bodies = [b for _, b in mine]
    assert len(bodies) == len(set(bodies)), "no message stored twice"
    acked = set(p.acked)
    assert [x for x in mine if x in acked] == p.acked, "every acknowledged message, in order, where its receipt said"
