"""Automatic failover on etcd: RTO per fault kind, acknowledged loss, and an etcd outage.

One real etcd (Debian's ``etcd-server``) and two ``tidemark serve`` processes with
``coordinator.endpoints`` set and the default ``lease_ttl_ms = 2000``; each node reaches etcd and
serves replication through a loopback TCP proxy (tests/tcpproxy.py), so a node can be isolated.
A producer thread sends 10-message batches with ack=replica to both addresses the whole time
(one ``BrokerClient``, which follows redirects and skips silent nodes).

For each fault kind (``--faults`` times each):

- ``kill9``: kill -9 the master; afterwards it is restarted and rejoins as a slave;
- ``sigstop``: SIGSTOP the master; after the failover SIGCONT: a send straight to it must be
  refused (it acknowledges nothing as master) and it must be back in sync by itself within 10 s;
- ``isolate``: the master loses etcd and its slave silently (packets dropped, clients still reach
  it); after the failover the network heals and it must rejoin by itself.

RTO = from the fault to the first send the new master acknowledged (the client knows which node
answered; a send the old master acknowledged just after the fault had its slave's ack before it). After every kind the
acknowledged messages are read back from both nodes: 0 lost is the target.

``switchover``: ``promote`` on the slave (a planned handover through etcd), ``--faults`` times; the
write pause is the longest gap between two acknowledgements around it (target ≤ 1 s).

Then etcd itself is paused (SIGSTOP) for ``--etcd-pause-s`` (30 s) while both nodes run: sends must
go on (the failsafe: the master acknowledges what its in-sync slave holds) with no gap over 1 s,
and no role or epoch changes.

Usage: .venv/bin/python bench/failover.py [--quick] [--faults 20] [--kinds kill9,sigstop,isolate,switchover]
       [--etcd-pause-s 30]
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from typing import Any

import common
from common import Results, log
from measure import quantile

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, BrokerError, Message
from tests.failoverutil import QUEUES_DEFAULT, TOPIC, Pair, Producer, create_topic, in_sync, missing, status, wait_master
from tests.procs import DaemonProcess

KINDS = ("kill9", "sigstop", "isolate", "switchover")
RTO_P99_TARGET_S = 3.0
REJOIN_TARGET_S = 10.0


def _spawner(workdir: str) -> Any:
    def make(name: str, *, config: dict[str, object], env: dict[str, str] | None = None) -> DaemonProcess:
        return DaemonProcess(os.path.join(workdir, name), config=config, env=env).start()

    return make


def _sending(pair: Pair) -> tuple[DaemonProcess, Producer]:
    """The elected master, once its slave is in sync and the topic exists; a producer sending."""
    master = wait_master(pair.nodes, 60)
    common.wait_for(lambda: in_sync(master, pair.other(master)), 60, "the slave in sync")
    create_topic(master, pair.nodes)
    return master, Producer([pair.a.address, pair.b.address], batch=10).start()


def _lost(pair: Pair, producer: Producer) -> int:
    """Acknowledged messages missing on the node that misses most (the producer stopped first)."""
    producer.stop()
    return max(len(missing(d.address, producer.acked, QUEUES_DEFAULT)) for d in pair.nodes)


def _old_master_refuses(d: DaemonProcess) -> bool:
    """A send straight to ``d`` (no redirect following) is refused."""
    try:
        with BrokerClient(d.address, follow_master=False, timeout_s=5) as c:
            c.send(TOPIC, [Message(body=b"to the old master")], ack="leader")
    except BrokerError:
        return True
    return False


def one_fault(pair: Pair, producer: Producer, kind: str) -> dict[str, Any]:
    master = wait_master(pair.nodes, 60)
    slave = pair.other(master)
    common.wait_for(lambda: in_sync(master, slave), 60, "the slave in sync before the fault")
    common.wait_for(lambda: producer.acked_after(time.monotonic() - 0.5) is not None, 30, "sends flowing")
    epoch = status(master)["epoch"]
    assert master.proc is not None
    t0 = time.monotonic()
    pair.fault(master, kind)
    common.wait_for(lambda: producer.acked_after(t0, slave.address) is not None, 60,
                    "a send acknowledged by the new master")
    first = producer.acked_after(t0, slave.address)
    assert first is not None
    rto_s = first - t0
    new = wait_master(pair.nodes, 60, among=[slave])
    refused = True
    t_back = time.monotonic()
    if kind == "sigstop":
        pair.restore(master, kind)  # it wakes with its permit run out: it must refuse at once
    if kind != "kill9":
        refused = _old_master_refuses(master)
    if kind != "sigstop":
        pair.restore(master, kind)  # restarted, or the network heals
    common.wait_for(lambda: in_sync(new, master), 60, "the old master back in sync as a slave")
    rejoin_s = time.monotonic() - t_back
    new_epoch = status(new)["epoch"]
    return {"rto_s": rto_s, "rejoin_s": rejoin_s, "refused": refused, "epoch_before": epoch, "epoch_after": new_epoch}


def run_kind(workdir: str, etcd: EtcdProcess, kind: str, faults: int, res: Results) -> None:
    wd = os.path.join(workdir, kind)
    os.makedirs(wd)
    pair = Pair(_spawner(wd), etcd, proxies=True, **{"coordinator.cluster": kind})
    try:
        _, producer = _sending(pair)
        runs = []
        for i in range(faults):
            r = one_fault(pair, producer, kind)
            log(f"{kind} #{i + 1}: RTO {r['rto_s']:.2f} s, rejoined in {r['rejoin_s']:.2f} s, "
                f"epoch {r['epoch_before']} -> {r['epoch_after']}, old master refused: {r['refused']}")
            runs.append(r)
        lost = _lost(pair, producer)
    finally:
        pair.kill_all()
    rtos = sorted(r["rto_s"] for r in runs)
    res.add(f"{kind}: RTO p50", quantile(rtos, 0.5), "s", faults=faults)
    target, ok = common.at_most(quantile(rtos, 0.99), RTO_P99_TARGET_S)
    res.add(f"{kind}: RTO p99", quantile(rtos, 0.99), "s", target=target, ok=ok, faults=faults)
    res.add(f"{kind}: RTO max", rtos[-1], "s", faults=faults)
    rejoin = max(r["rejoin_s"] for r in runs)
    target, ok = common.at_most(rejoin, REJOIN_TARGET_S)
    res.add(f"{kind}: old master back in sync, max", rejoin, "s", target=target, ok=ok)
    target, ok = common.at_most(lost, 0)
    res.add(f"{kind}: acknowledged messages lost ({len(producer.acked)} acknowledged)", lost, "msgs",
            target=target, ok=ok)
    accepted = sum(1 for r in runs if not r["refused"])
    target, ok = common.at_most(accepted, 0)
    res.add(f"{kind}: writes the old master acknowledged after the failover", accepted, "faults", target=target, ok=ok)
    monotonic_epochs = all(r["epoch_after"] > r["epoch_before"] for r in runs)
    res.add(f"{kind}: every failover started a higher epoch", 1 if monotonic_epochs else 0, "bool",
            target="= 1", ok=monotonic_epochs)
    errors = len(producer.errors)
    res.add(f"{kind}: sends that failed after their 30 s deadline", errors, "calls",
            note="; ".join(producer.errors[:2])[:200])


def one_switchover(pair: Pair, producer: Producer) -> float:
    master = wait_master(pair.nodes, 60)
    slave = pair.other(master)
    common.wait_for(lambda: in_sync(master, slave), 60, "the slave in sync")
    common.wait_for(lambda: producer.acked_after(time.monotonic() - 0.2) is not None, 30, "sends flowing")
    t0 = time.monotonic()
    with BrokerClient(slave.address) as c:
        c.promote()
    common.wait_for(lambda: producer.acked_after(t0, slave.address) is not None, 30, "a send on the new master")
    t1 = producer.acked_after(t0, slave.address) or t0
    window = [t for t in list(producer.ack_times) if t0 - 1.0 <= t <= t1]
    return max((b - a for a, b in itertools.pairwise(window)), default=t1 - t0)


def run_switchovers(workdir: str, etcd: EtcdProcess, count: int, res: Results) -> None:
    """``promote`` on the slave, ``count`` times, while the producer sends: the write pause is the
    longest gap between two acknowledgements around each switchover."""
    wd = os.path.join(workdir, "switchover")
    os.makedirs(wd)
    pair = Pair(_spawner(wd), etcd, **{"coordinator.cluster": "switchover"})
    pauses: list[float] = []
    try:
        _, producer = _sending(pair)
        for i in range(count):
            pauses.append(one_switchover(pair, producer))
            log(f"switchover #{i + 1}: write pause {pauses[-1]:.3f} s")
        lost = _lost(pair, producer)
    finally:
        pair.kill_all()
    pauses.sort()
    res.add("switchover: write pause p50", quantile(pauses, 0.5), "s", switchovers=count)
    target, ok = common.at_most(pauses[-1], 1.0)
    res.add("switchover: write pause max", pauses[-1], "s", target=target, ok=ok, switchovers=count)
    target, ok = common.at_most(lost, 0)
    res.add(f"switchover: acknowledged messages lost ({len(producer.acked)} acknowledged)", lost, "msgs",
            target=target, ok=ok)


def run_etcd_pause(workdir: str, etcd: EtcdProcess, pause_s: float, res: Results) -> None:
    wd = os.path.join(workdir, "etcd-pause")
    os.makedirs(wd)
    pair = Pair(_spawner(wd), etcd, **{"coordinator.cluster": "etcd-pause"})
    try:
        master, producer = _sending(pair)
        slave = pair.other(master)
        common.wait_for(lambda: len(producer.ack_times) > 50, 30, "sends flowing")
        epoch = status(master)["epoch"]
        etcd.pause()
        t0 = time.monotonic()
        roles_changed = 0
        while time.monotonic() - t0 < pause_s:
            if status(master)["role"] != "master" or status(slave)["role"] != "slave":
                roles_changed += 1
            time.sleep(0.5)
        etcd.resume()
        t1 = time.monotonic()
        common.wait_for(lambda: status(master)["coordinator"]["connected"], 30, "the master back on etcd")
        time.sleep(3)
        producer.stop()
        during = [t for t in producer.ack_times if t0 <= t <= t1]
        gap = max((b - a for a, b in itertools.pairwise([t0, *during, t1])), default=pause_s)
        lost = len(missing(master.address, producer.acked, QUEUES_DEFAULT))
        epoch_after = status(master)["epoch"]
        role_after = status(master)["role"]
    finally:
        pair.kill_all()
    res.add(f"etcd paused {pause_s:.0f} s: sends acknowledged during the pause", len(during) * 10, "msgs",
            target="> 0", ok=len(during) > 0)
    target, ok = common.at_most(gap, 1.0)
    res.add(f"etcd paused {pause_s:.0f} s: longest gap between acknowledgements", gap, "s", target=target, ok=ok)
    unchanged = roles_changed == 0 and epoch_after == epoch and role_after == "master"
    res.add(f"etcd paused {pause_s:.0f} s: roles and epoch unchanged", 1 if unchanged else 0, "bool", target="= 1",
            ok=unchanged, note=f"epoch {epoch} -> {epoch_after}, role samples changed: {roles_changed}")
    target, ok = common.at_most(lost, 0)
    res.add(f"etcd paused {pause_s:.0f} s: acknowledged messages lost", lost, "msgs", target=target, ok=ok)


def main() -> int:
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=None, help="faults per kind (default 20, quick 3)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of: " + ", ".join(KINDS))
    p.add_argument("--etcd-pause-s", type=float, default=None, help="etcd outage (default 30, quick 5; 0 = skip)")
    a = p.parse_args()
    faults = a.faults or (3 if a.quick else 20)
    pause_s = a.etcd_pause_s if a.etcd_pause_s is not None else (5.0 if a.quick else 30.0)
    kinds = [k for k in a.kinds.split(",") if k]
    res = Results("failover", a.results, {"faults": faults, "lease_ttl_ms": 2000, "quick": a.quick})
    common.preflight(res, a.max_wait_quiet)
    with common.temp_dir("tm-failover-", a.workdir or "/tmp") as wd:
        etcd = EtcdProcess(os.path.join(wd, "etcd")).start()
        try:
            for kind in kinds:
                if kind == "switchover":
                    run_switchovers(wd, etcd, faults, res)
                else:
                    run_kind(wd, etcd, kind, faults, res)
            if pause_s > 0:
                run_etcd_pause(wd, etcd, pause_s, res)
        finally:
            etcd.kill9()
    res.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
