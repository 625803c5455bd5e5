"""The failsafe's write permit (DESIGN §11), decided in process: a real store, the replication
plugin's in-sync set and the coordinator's permit decision, with the slave's acks simulated.

The chaos run (seed 66988001) found the case: the master was SIGSTOPped for 6.8 s, the slave was
elected meanwhile, and on SIGCONT the old master read the acks that had waited in its socket
buffer, dated them "now" and granted itself the failsafe permit for another 0.5 s: two masters
with a permit at once. An ack is dated by when the master sent the newest message the slave had
heard when it sent the ack.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.store import Store
from replication.confirm import InSyncSet, Replica
from replication.coordination import records as rec
from replication.coordination.coordinator import Coordinator
from tests.storeutil import open_store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(str(tmp_path))
    yield s
    s.crash_close()


def _master_whose_lease_lapsed(store: Store) -> tuple[Coordinator, InSyncSet, Replica]:
    """A master holding the leader key whose last keep-alive went out 10 s ago (etcd unreachable,
    or this process paused), with one connected slave of the recorded in-sync set."""
    insync = InSyncSet(store.config, lambda: store.role, lambda: store.log.max_offset)
    coordinator = Coordinator(store, store.config, insync, roles=None, replication_address="127.0.0.1:1")  # type: ignore[arg-type]
    coordinator.holding = rec.Leader(coordinator.node_id, 7, "127.0.0.1:2", "127.0.0.1:1")
    coordinator.renewed_at = time.monotonic() - 10
    store.permit.grant(coordinator.renewed_at + 1.6)  # what the etcd loop granted back then: long over
    insync.set_pins({"b"})
    return coordinator, insync, insync.connected("b", "127.0.0.1:3", acked_offset=0)


def test_acks_that_waited_in_a_buffer_during_a_pause_grant_no_permit(store: Store) -> None:
    coordinator, insync, slave = _master_whose_lease_lapsed(store)
    # resumed after 6.8 s: the slave's acks to what we sent just before the pause arrive now
    insync.acked(slave, 0, 0, heard_sent_at=time.monotonic() - 6.8)
    assert coordinator._check_permit() is True  # step down
    assert not store.permit.valid() and store.permit.remaining_ms() == 0
    assert coordinator.holding is None and not coordinator.failsafe
    assert "no in-sync slave is acknowledging" in store.permit.reason


def test_a_slave_answering_what_we_sent_just_now_holds_the_failsafe(store: Store) -> None:
    coordinator, insync, slave = _master_whose_lease_lapsed(store)
    sent = time.monotonic() - 0.05
    insync.acked(slave, 0, 0, heard_sent_at=sent)
    assert coordinator._check_permit() is False
    assert store.permit.valid() and store.permit.strict and coordinator.failsafe
    # the permit ends before the slave could campaign: a quarter lease (0.5 s) after it heard us
    assert store.permit.remaining_ms() <= (sent + coordinator.ttl_s / 4 - time.monotonic()) * 1000
    # the next permit tick after the window, without a newer answer: fenced
    store.permit.grant(time.monotonic() - 1, strict=True)
    insync.acked(slave, 0, 0, heard_sent_at=sent)  # the same answer again proves nothing newer
    coordinator.failsafe = True
    slave.heard_sent_at = time.monotonic() - 0.6
    assert coordinator._check_permit() is True and not store.permit.valid()


def test_an_ack_without_a_stamp_or_with_one_from_the_future_dates_nothing(store: Store) -> None:
    coordinator, insync, slave = _master_whose_lease_lapsed(store)
    insync.acked(slave, 0, 0)  # a slave that does not echo the stamp (an older version)
    insync.acked(slave, 0, 0, heard_sent_at=time.monotonic() + 3600)  # not a stamp we sent
    assert slave.heard_sent_at == 0.0
    assert coordinator._check_permit() is True and not store.permit.valid()
