"""Load, power-loss simulation and checks shared by the crash tests."""

from __future__ import annotations

import os
import threading
from collections import defaultdict

from broker.client import BrokerClient, BrokerError, Message


class Producer(threading.Thread):
    """Sends numbered messages with ack=flush until the daemon goes away; remembers what was acked."""

    def __init__(self, address: str, topic: str, name: str, batch: int = 40, body_bytes: int = 200) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.topic = topic
        self.name_ = name
        self.batch = batch
        self.body_bytes = body_bytes
        self.acked: list[bytes] = []
        self.stop = threading.Event()

    def run(self) -> None:
        seq = 0
        with BrokerClient(self.address, timeout_s=5) as c:
            while not self.stop.is_set():
                bodies = [b"%s-%08d-" % (self.name_.encode(), seq + i) + b"x" * self.body_bytes for i in range(self.batch)]
                try:
                    c.send(self.topic, [Message(body=b) for b in bodies], ack="flush")
                except BrokerError:
                    return
                self.acked += bodies
                seq += self.batch


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
    for path, size in last.items():
        if os.path.exists(path) and os.path.getsize(path) > size:
            dropped += os.path.getsize(path) - size
            os.truncate(path, size)
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
