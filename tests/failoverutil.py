"""Pairs of daemons under a real etcd, and a producer that keeps sending through every fault."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from broker.cli.etcd_process import EtcdProcess
from broker.cli.node_process import free_port
from broker.client import BrokerClient, BrokerError, Message
from tests.procs import DaemonProcess
from tests.tcpproxy import TcpProxy
from tests.waits import wait_until

Spawn = Callable[..., DaemonProcess]
TOPIC = "orders"
QUEUES_DEFAULT = 2


def coordinated(etcd_endpoint: str, **extra: object) -> dict[str, object]:
    return {"coordinator.endpoints": etcd_endpoint, "replication.max_lag_ms": 2000, **extra}


def status(d: DaemonProcess, timeout_s: float = 2.0) -> dict[str, Any]:
    with BrokerClient(d.address, timeout_s=timeout_s) as c:
        return c.status()


def is_master(d: DaemonProcess) -> bool:
    """Master as etcd and the node itself both see it, with a write permit."""
    try:
        st = status(d)
    except BrokerError:
        return False
    coord = st.get("coordinator") or {}
    return bool(st["role"] == "master" and coord.get("leader") == st["node_id"] and not st["fenced"])


def wait_master(nodes: list[DaemonProcess], timeout_s: float = 30.0,
                among: list[DaemonProcess] | None = None) -> DaemonProcess:
    candidates = among or nodes

    def probe() -> DaemonProcess | None:
        return next((d for d in candidates if d.proc is not None and d.proc.poll() is None and is_master(d)), None)

    found = wait_until(probe, timeout_s, "a master elected through etcd",
                       observe=lambda: [_safe_status(d) for d in nodes])
    assert found is not None
    return found


def _safe_status(d: DaemonProcess) -> object:
    try:
        st = status(d, 1.0)
        return {k: st.get(k) for k in ("role", "epoch", "max_offset", "fenced", "coordinator", "replication")}
    except Exception as exc:
        return f"{d.address}: {exc}"


def in_sync(master: DaemonProcess, slave: DaemonProcess) -> bool:
    try:
        m, s = status(master), status(slave)
    except BrokerError:
        return False
    return bool(s["role"] == "slave" and s["max_offset"] == m["max_offset"] and s["node_id"] in
                (m.get("coordinator") or {}).get("insync", []))


def create_topic(master: DaemonProcess, nodes: list[DaemonProcess], queues: int = QUEUES_DEFAULT) -> None:
    """Create the producers' topic on the master and wait until every node knows it."""
    with BrokerClient(master.address) as c:
        c.create_topic(TOPIC, queues=queues)

    def known_everywhere() -> bool:
        for d in nodes:
            with BrokerClient(d.address) as c:
                if TOPIC not in c.list_topics():
                    return False
        return True

    wait_until(known_everywhere, 30, f"topic {TOPIC} known on every node")


class Pair:
    """Two coordinated nodes ``a`` and ``b``; with ``proxies``, each node reaches etcd and serves
    replication through a TcpProxy a test can cut or silence (an isolation)."""

    def __init__(self, spawn: Spawn, etcd: EtcdProcess, *, proxies: bool = False, env: dict[str, str] | None = None,
                 **extra: object) -> None:
        self.proxies: dict[str, dict[str, TcpProxy]] = {}
        self.nodes: list[DaemonProcess] = []
        for name in ("a", "b"):
            config = coordinated(etcd.endpoint, **extra)
            if proxies:
                repl_port = free_port()
                to_etcd, to_repl = TcpProxy(etcd.client_port), TcpProxy(repl_port)
                self.proxies[name] = {"etcd": to_etcd, "replication": to_repl}
                config.update({"coordinator.endpoints": f"http://127.0.0.1:{to_etcd.port}",
                               "replication.listen": f"127.0.0.1:{repl_port}",
                               "replication.advertise": to_repl.address})
            self.nodes.append(spawn(name, config=config, **({"env": env} if env else {})))
        self.a, self.b = self.nodes

    def isolate(self, d: DaemonProcess) -> None:
        """``d`` loses etcd and its slave (or master) silently; clients still reach it."""
        name = "a" if d is self.a else "b"
        for proxy in self.proxies[name].values():
            proxy.silence()
        other = "b" if name == "a" else "a"
        self.proxies[other]["replication"].silence()  # d as a slave cannot stream from the other either

    def heal(self) -> None:
        for proxies in self.proxies.values():
            for proxy in proxies.values():
                proxy.heal()

    def close(self) -> None:
        for proxies in self.proxies.values():
            for proxy in proxies.values():
                proxy.close()

    def kill_all(self) -> None:
        """kill -9 both nodes and close the proxies (a bench's teardown)."""
        for d in self.nodes:
            d.kill9()
        self.close()

    def other(self, d: DaemonProcess) -> DaemonProcess:
        return self.b if d is self.a else self.a

    def fault(self, d: DaemonProcess, kind: str) -> None:
        """``kill9``, ``sigstop`` or ``isolate`` node ``d``."""
        if kind == "kill9":
            d.kill9()
        elif kind == "sigstop":
            assert d.proc is not None
            d.proc.send_signal(signal.SIGSTOP)
        else:
            self.isolate(d)

    def restore(self, d: DaemonProcess, kind: str) -> None:
        """Undo ``fault``: restart (same configuration), SIGCONT, or heal the network."""
        if kind == "kill9":
            d.start()
        elif kind == "sigstop":
            assert d.proc is not None
            d.proc.send_signal(signal.SIGCONT)
        else:
            self.heal()


class Producer:
    """Sends batches with ack=replica to both addresses until stopped, keeping every receipt."""

    def __init__(self, addresses: list[str], *, batch: int = 20, ack: str = "replica", name: str = "p",
                 timeout_s: float = 30.0) -> None:
        self.addresses, self.batch, self.ack, self.name, self.timeout_s = addresses, batch, ack, name, timeout_s
        self.acked: dict[bytes, tuple[int, int]] = {}
        self.ack_times: list[float] = []  # monotonic, one per acknowledged call
        self.ack_nodes: list[str] = []  # the address that acknowledged each
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Producer:
        self._thread.start()
        return self

    def _run(self) -> None:
        i = 0
        with BrokerClient(self.addresses, timeout_s=self.timeout_s) as c:
            while not self._stop.is_set():
                bodies = [f"{self.name}-{i + k}".encode() for k in range(self.batch)]
                try:
                    receipts = c.send(TOPIC, [Message(body=b, key=b.decode()) for b in bodies], ack=self.ack)
                except BrokerError as exc:
                    self.errors.append(f"{exc.code.name}: {exc}"[:300])
                    continue  # a new batch (the failed one may be stored or not; it was not acknowledged)
                now = time.monotonic()
                for b, r in zip(bodies, receipts, strict=True):
                    self.acked[b] = (r.queue_id, r.queue_offset)
                self.ack_nodes.append(c.current_address)
                self.ack_times.append(now)
                i += self.batch

    def acked_after(self, t: float, by: str = "") -> float | None:
        """The first acknowledgement at or after monotonic ``t`` (by the node at ``by``, if given)."""
        n = len(self.ack_times)  # ack_nodes is appended first: both hold n entries
        return next((x for x, a in zip(self.ack_times[:n], self.ack_nodes[:n], strict=True)
                     if x >= t and (not by or a == by)), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def wait_flowing(self, count: int = 10) -> None:
        wait_until(lambda: len(self.ack_times) >= count, 30, f"{count} sends acknowledged")


def missing(address: str, acked: dict[bytes, tuple[int, int]], queues: int, settle_s: float = 10.0) -> list[bytes]:
    """Acknowledged messages not found at their receipts on the node at ``address`` (a slave
    serves what its master confirmed: the last sends can take a heartbeat to show; up to
    ``settle_s`` is allowed for that)."""
    deadline = time.monotonic() + settle_s
    while True:
        lost = _missing_now(address, acked, queues)
        if not lost or time.monotonic() > deadline:
            return lost
        time.sleep(0.1)


def _missing_now(address: str, acked: dict[bytes, tuple[int, int]], queues: int) -> list[bytes]:
    found: dict[bytes, tuple[int, int]] = {}
    with BrokerClient(address) as c:
        for q in range(queues):
            for res in c.iter_pull(TOPIC, q, 0, max_messages=10_000):
                for m in res:
                    found[m.body] = (m.queue_id, m.queue_offset)
    return [b for b, where in acked.items() if found.get(b) != where]


def sent_once_placed(c: BrokerClient, topic: str, messages: list[Message]) -> bool:
    """A send in a cluster of shards; False while a shard's log does not hold the topic yet
    (UNAVAILABLE: its master creates it a moment after etcd places it)."""
    try:
        c.send(topic, messages, ack="replica")
    except BrokerError as exc:
        if exc.code.name != "UNAVAILABLE":
            raise
        return False
    return True
