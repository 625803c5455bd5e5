"""Promote and demote (DESIGN §4). Neither waits for the other node.

promote (slave → master): refused unless this slave is known to be in sync (or ``unclean``);
stop following, start a new epoch at our log end, take writes, serve slaves.
demote (master → slave): stop taking writes at once, then follow the given master; the
handshake truncates whatever this node wrote that the new master does not have.
"""

from __future__ import annotations

import threading

import structlog

from broker.config import Config
from broker.errors import BrokerError
from broker.store import Store
from replication import role_record
from replication.confirm import InSyncSet
from replication.follower import Follower

log = structlog.get_logger("replication.roles")


class RoleController:
    def __init__(self, store: Store, config: Config, insync: InSyncSet, own_address: str) -> None:
        self.store = store
        self.config = config
        self.insync = insync
        self.own_address = own_address
        self.follower: Follower | None = None
        self._lock = threading.Lock()
        store.register_status_provider(self._status)

    def _status(self, st: dict[str, object]) -> None:
        if self.follower is not None:
            self.follower.add_status(st)

    def start(self) -> None:
        if self.store.role == "slave":
            self._follow(self.store.master_address)

    def _follow(self, master: str) -> None:
        self.follower = Follower(self.store, self.config, master, self.own_address, self.insync)
        self.follower.start()

    def promote(self, unclean: bool) -> int:
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
            if follower is not None:
                follower.stop()
                self.follower = None
            epoch = max(store.epoch, *(e for e, _ in store.epochs.snapshot()), 0) + 1
            store.epochs.start(epoch, store.log.max_offset)
            store.set_role("master", "")  # lifts a fence: this is a new epoch
            role_record.record(store.data_dir, "master", "", epoch)
            store.watermarks.advance_confirm()
            log.info("promoted", epoch=epoch, log_end=store.log.max_offset, unclean=unclean)
            return epoch

    def demote(self, master: str) -> None:
        with self._lock:
            store = self.store
            if not master:
                raise BrokerError("INVALID_ARGUMENT", "demote needs the new master's address")
            if self.follower is not None:
                self.follower.stop()
            store.set_role("slave", master)  # writes are refused from here on
            role_record.record(store.data_dir, "slave", master, store.epoch)
            self._follow(master)
            log.info("demoted", master=master)

    def stop(self) -> None:
        if self.follower is not None:
            self.follower.stop()
