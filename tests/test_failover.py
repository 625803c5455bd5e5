"""Automatic failover through a real etcd (DESIGN §11): real daemons, real faults."""

from __future__ import annotations

import signal
import time

import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, BrokerError, Message
from tests.failoverutil import TOPIC, Pair, Producer, Spawn, in_sync, missing, status, wait_master
from tests.waits import wait_until

QUEUES = 2


def _setup(pair: Pair) -> tuple[object, object]:
    master = wait_master(pair.nodes)
    slave = pair.other(master)
    with BrokerClient(master.address) as c:
        c.create_topic(TOPIC, queues=QUEUES)
    wait_until(lambda: in_sync(master, slave), 30, "the slave in sync and in etcd's in-sync set",
               observe=lambda: (status(master).get("coordinator"), status(slave).get("replication")))
    return master, slave


def test_kill9_master_elects_the_slave_and_loses_nothing(spawn: Spawn, etcd: EtcdProcess) -> None:
    pair = Pair(spawn, etcd)
    master, slave = _setup(pair)
    producer = Producer([pair.a.address, pair.b.address]).start()
    wait_until(lambda: len(producer.ack_times) >= 20, 30, "sends acknowledged before the fault")
    epoch_before = status(master)["epoch"]
    master.kill9()
    killed_at = time.monotonic()
    new = wait_master(pair.nodes, 30, among=[slave])
    wait_until(lambda: producer.acked_after(killed_at), 30, "a send acknowledged by the new master")
    producer.stop()
    assert status(new)["epoch"] > epoch_before
    assert not missing(new.address, producer.acked, QUEUES), "acknowledged sends lost"

    master.start()  # the old master rejoins as a slave by itself and catches up
    wait_until(lambda: in_sync(new, master), 30, "the old master back in sync as a slave",
               observe=lambda: status(master))
    assert not missing(master.address, producer.acked, QUEUES)


def test_paused_master_is_replaced_acknowledges_nothing_after_and_rejoins(spawn: Spawn, etcd: EtcdProcess) -> None:
    pair = Pair(spawn, etcd)
    master, slave = _setup(pair)
    assert master.proc is not None
    producer = Producer([pair.a.address, pair.b.address]).start()
    wait_until(lambda: len(producer.ack_times) >= 20, 30, "sends acknowledged before the fault")
    old_epoch = status(master)["epoch"]
    master.proc.send_signal(signal.SIGSTOP)
    paused_at = time.monotonic()
    new = wait_master(pair.nodes, 30, among=[slave])
    wait_until(lambda: producer.acked_after(paused_at), 30, "a send acknowledged by the new master")
    master.proc.send_signal(signal.SIGCONT)  # its permit ran out while it slept: it refuses at once
    with BrokerClient(master.address, follow_master=False) as direct, pytest.raises(BrokerError) as refused:
        direct.send(TOPIC, [Message(body=b"to the old master")], ack="leader")
    assert refused.value.code.name == "FAILED_PRECONDITION", refused.value
    wait_until(lambda: in_sync(new, master), 10, "the resumed old master in sync as a slave by itself",
               observe=lambda: status(master))
    producer.stop()
    st = status(master)
    assert st["role"] == "slave" and st["epoch"] > old_epoch
    assert not missing(new.address, producer.acked, QUEUES)
    assert not missing(master.address, producer.acked, QUEUES)
