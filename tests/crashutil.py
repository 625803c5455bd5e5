"""Load (a producer thread), power-loss simulation and checks shared by the crash, replication and tiered tests."""

from __future__ import annotations

import os
import threading
from collections import defaultdict

from broker.client import BrokerClient, BrokerError, Message


class Producer(threading.Thread):
    """Sends numbered messages (``<name>-<seq>-xxx…``) until stopped; remembers what was acknowledged.

    A refused send ends the thread (the daemon went away), unless ``retry``: then it is counted in
    ``errors`` and, after a pause, the next batch goes out with new bodies (the refused one's outcome is
    unknown: it may or may not be stored, it is never acked). ``switched``: a send was acknowledged
    through another address than the first (the client followed a failover). ``keys``: message keys
    cycle through that many values (0: no keys)."""

    def __init__(self, addresses: str | list[str], topic: str, name: str, *, ack: str = "flush", batch: int = 40,
                 body_bytes: int = 200, keys: int = 0, retry: bool = False, pause_s: float = 0.0,
                 timeout_s: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.addresses = [addresses] if isinstance(addresses, str) else addresses
        self.topic = topic
        self.name_ = name
        self.ack = ack
        self.batch = batch
        self.body_bytes = body_bytes
        self.keys = keys
        self.retry = retry
        self.pause_s = pause_s
        self.timeout_s = timeout_s
        self.acked: list[bytes] = []
        self.errors = 0
        self.switched = False
        self.stop = threading.Event()

    def run(self) -> None:
        seq = 0
        with BrokerClient(self.addresses, timeout_s=self.timeout_s) as c:
            while not self.stop.is_set():
                bodies = [b"%s-%08d-" % (self.name_.encode(), seq + i) + b"x" * self.body_bytes for i in range(self.batch)]
                seq += self.batch
                messages = [Message(body=b, key=str(i % self.keys) if self.keys else None) for i, b in enumerate(bodies)]
                try:
                    c.send(self.topic, messages, ack=self.ack)
                except BrokerError:
                    self.errors += 1
                    if not self.retry:
                        return
                    self.stop.wait(0.1)
                    continue
                if c.addresses[c._current] != self.addresses[0]:
                    self.switched = True
                self.acked += bodies
                if self.pause_s:
                    self.stop.wait(self.pause_s)


def drop_unsynced_bytes(journal: str) -> int:
    """Power loss: cut every journaled file back to its durable length. Returns bytes dropped.

    Durable length = the largest size synced since the file's last reset (creation/truncation).
    """
    last: dict[str, int] = {}
    with open(journal) as f:
        for line in f:
            kind, size, path = line.rstrip("\n").split(" ", 2)
            last[path] = int(size) if kind == "R" else max(last.get(path, 0), int(size))
    dropped = 0
    for path, durable in last.items():
        if os.path.exists(path) and os.path.getsize(path) > durable:
            dropped += os.path.getsize(path) - durable
            os.truncate(path, durable)
    return dropped


def read_everything(address: str, topic: str, queues: int) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {}
    with BrokerClient(address) as c:
        for q in range(queues):
            bodies: list[bytes] = []
            offset = 0
            while True:
                r = c.pull(topic, q, offset, max_messages=10_000)
                if not len(r):
                    break
                bodies += r.bodies()
                offset = r.next_offset
            out[q] = bodies
    return out


def check_history(acked: list[bytes], stored: dict[int, list[bytes]]) -> None:
    """Every acked message is stored intact; nothing is stored twice; per-queue order holds."""
    everything = [b for bodies in stored.values() for b in bodies]
    assert len(everything) == len(set(everything)), "a message is stored twice"
    missing = set(acked) - set(everything)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:3]}"
    for bodies in stored.values():
        last: dict[bytes, int] = defaultdict(lambda: -1)
        for b in bodies:
            name, seq, _ = b.split(b"-", 2)
            assert int(seq) > last[name], "per-queue order broken"
            last[name] = int(seq)
