"""Promote and demote (DESIGN §4). Neither waits for the other node.

promote (slave → master): refused unless this slave is known to be in sync (or ``unclean``);
stop following, start a new epoch at our log end, take writes, serve slaves.
demote (master → slave): stop taking writes at once, then follow the given master; the
handshake truncates whatever this node wrote that the new master does not have.
With a coordinator both go through etcd instead (a switchover, ``coordination/coordinator.py``);
the coordinator uses the same steps (``become_master``, ``follow``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog

from broker.config import Config
from broker.errors import BrokerError
from broker.storage.failpoints import failpoint
from broker.store import Store
from replication import role_record
from replication.confirm import InSyncSet
from replication.follower import Follower

log = structlog.get_logger("replication.roles")

VIEWS_CATCH_UP_S = 5.0  # how long taking office waits for the metadata view to apply what is confirmed


class RoleController:
    def __init__(self, store: Store, config: Config, insync: InSyncSet, own_address: str) -> None:
        self.store = store
        self.config = config
        self.insync = insync
        self.own_address = own_address
        self.follower: Follower | None = None
        self.coordinator: Any = None  # replication.coordination.coordinator.Coordinator, when configured
        self._lock = threading.Lock()
        store.register_status_provider(self._status)

    def _status(self, st: dict[str, object]) -> None:
        if self.follower is not None:
            self.follower.add_status(st)

    def start(self) -> None:
        if self.store.role == "slave" and self.store.master_address:
            self._follow(self.store.master_address)

    def _follow(self, master: str) -> None:
        self.follower = Follower(self.store, self.config, master, self.own_address, self.insync)
        if self.coordinator is not None:
            self.follower.coordinator_unreachable_ms = self.coordinator.unreachable_ms
        self.follower.start()

    def promote(self, unclean: bool) -> int:
        if self.coordinator is not None:  # a switchover through etcd (DESIGN §11)
            return self.coordinator.promote_here(unclean)
        with self._lock:
            store = self.store
            if store.role == "master" and not store.fenced_reason:
                raise BrokerError("FAILED_PRECONDITION", "already the master")
            follower = self.follower
            if not unclean and (follower is None or not follower.known_in_sync()):
                raise BrokerError(
                    "FAILED_PRECONDITION",
                    "this slave is not known to be in sync with its master (disconnected or lagging): promoting "
                    "it could lose confirmed data; use --unclean to force",
                )
            epoch = store.epochs.highest() + 1
            self.become_master(epoch)
            role_record.record(store.data_dir, "master", "", epoch)
            log.info("promoted", epoch=epoch, log_end=store.log.max_offset, unclean=unclean)
        self.wait_views_caught_up()
        return epoch

    def demote(self, master: str) -> None:
        if not master:
            raise BrokerError("INVALID_ARGUMENT", "demote needs the new master's address")
        if self.coordinator is not None:
            self.coordinator.demote_here(master)
            return
        with self._lock:
            self.follow(master)
            role_record.record(self.store.data_dir, "slave", master, self.store.epoch)
            log.info("demoted", master=master)

    # -- the steps, shared by the manual commands and the coordinator ------------------------------
    def become_master(self, epoch: int) -> None:
        """Stop following, start ``epoch`` at our log end, take writes."""
        store = self.store
        self.stop_following()
        store.epochs.start(epoch, store.log.max_offset)
        store.set_role("master", "")  # lifts a fence: this is a new epoch
        store.watermarks.advance_confirm()
        store.raise_metadata_fence(store.watermarks.confirm_offset)  # and what it confirms now
        failpoint("roles_after_become_master")

    def wait_views_caught_up(self) -> None:
        """After taking office: wait (bounded) until the metadata view applied what is confirmed.
        A slave's views apply only what its master confirmed to it; the rest of its log (a topic
        created just before the master went away) is applied once it is master. A promote that
        returned first made a client's next send meet "unknown topic" on the new master. Not part
        of ``become_master``: the coordinator's etcd round runs that, and must not wait here
        (its lease would go unrenewed)."""
        store = self.store
        confirmed = store.metadata_fence
        if not store.wait_metadata_applied(confirmed, VIEWS_CATCH_UP_S):
            log.warning("views_behind_after_promotion", confirm_offset=confirmed, waited_s=VIEWS_CATCH_UP_S)

    def follow(self, master: str) -> None:
        """Stop taking writes at once, then follow ``master`` (its replication address); the
        handshake truncates whatever this node wrote that the master does not have."""
        self.stop_following()
        self.store.set_role("slave", master)
        failpoint("roles_before_follow")
        self._follow(master)

    def step_down(self, why: str) -> None:
        """Stop being master without a master to follow yet (the coordinator finds one)."""
        self.stop_following()
        if self.store.role == "master":
            self.store.set_role("slave", "")
            log.warning("stepped_down", reason=why, epoch=self.store.epoch)

    def stop_following(self) -> None:
        if self.follower is not None:
            self.follower.stop()
            self.follower = None

    def following(self, master: str) -> bool:
        """A follower of ``master`` runs (it may be between reconnects)."""
        f = self.follower
        return f is not None and f.master == master and self.store.role == "slave" and self.store.master_address == master

    def following_live_master(self, silence_ms: float) -> bool:
        """Streaming from a master that spoke within ``silence_ms``."""
        f = self.follower
        return f is not None and f.connected and (time.monotonic() - f.last_heard) * 1000 <= silence_ms

    def stop(self) -> None:
        if self.follower is not None:
            self.follower.stop()
