"""Role, fencing, the write permit and free space: may this node take and acknowledge writes."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from broker.errors import BrokerError
from broker.store.state import StoreState
from broker.store.watermarks import OUTCOME_UNKNOWN

log = structlog.get_logger("store")


class Mastership(StoreState):
    @property
    def epoch(self) -> int:
        return self.epochs.current

    def set_role(self, role: str, master_address: str = "") -> None:
        """Change role and tell the listeners. Becoming master (a new epoch) lifts a fence."""
        with self.appender.lock:
            self.role = role
            self.master_address = master_address
            self.redirect_address = ""
            if role == "master":
                self.fenced_reason = ""
                self.metadata_fence = self.watermarks.confirm_offset  # before any call sees a master
            else:  # a slave's views follow its new master's confirm offset, which a truncation may put lower
                self.metadata_fence = 0
        log.info("role_changed", role=role, epoch=self.epoch, master=master_address)
        for listener in self._role_listeners:
            listener(role)
        self.incidents.retire_ended(f"the loop ended when the node became {role}")  # after the listeners stopped theirs

    def writers_address(self) -> str:
        """Where a refused writer should go: the master's client address once known, else the
        address this node follows (the same unless replication has a port of its own); '' while
        that master is silent under a coordinator (the writer retries here or elsewhere: sent to
        a stopped master, it would wait for a connection that never comes)."""
        if self.master_silent():
            return ""
        return self.redirect_address or self.master_address

    def fence(self, reason: str) -> None:
        """Stop taking writes until a new epoch starts here (a higher epoch exists elsewhere)."""
        if not self.fenced_reason:
            self.fenced_reason = reason
            log.warning("fenced", reason=reason)

    def check_writable(self) -> None:
        if self.closing:
            raise BrokerError("UNAVAILABLE", "the broker is shutting down; retry against it or another node")
        self.check_still_master()
        self.check_free_space()

    def check_still_master(self) -> None:
        """Checked again just before a write is acknowledged: a node that stopped being master (or
        lost its write permit) while the write waited acknowledges nothing; the client retries on the
        master with the same producer sequence (stored once either way)."""
        if self.fenced_reason:  # not the master: named, or '' while unknown (a writer retries elsewhere, as
            # for a slave whose master is silent; after an attempt of unknown outcome it is told so)
            where = f"; the master is at {self.redirect_address}" if self.redirect_address else ""
            raise BrokerError("FAILED_PRECONDITION", f"this node is fenced: {self.fenced_reason}{where}",
                              metadata=(("tidemark-master", self.redirect_address),))
        if self.role != "master":
            writers = self.writers_address()
            where = (f"send writes to the master at {writers}" if writers else
                     "its master is silent or unknown (an election may be under way): retry")
            raise BrokerError("FAILED_PRECONDITION", f"this node is a slave; {where}",
                              metadata=(("tidemark-master", writers),))
        self.permit.check(self.redirect_address)

    def check_still_master_after_append(self) -> None:
        """Just before an appended write is acknowledged: if this node stopped being the master (or
        lost its permit) meanwhile, the write is not acknowledged -- and it may be stored, so the
        refusal is UNAVAILABLE (outcome unknown), not a redirect that says "not executed"."""
        if self.lost_mastership():
            raise BrokerError("UNAVAILABLE", "this node stopped being the master before acknowledging the write: "
                              "outcome unknown (a retried send is stored once)", metadata=OUTCOME_UNKNOWN)

    def lost_mastership(self) -> bool:
        """No longer the master, or no longer allowed to acknowledge (a write waiting for its ack
        stops waiting; ``check_still_master`` then says why)."""
        return bool(self.fenced_reason) or self.role != "master" or not self.permit.valid()

    def check_free_space(self) -> None:
        """RESOURCE_EXHAUSTED below ``storage.min_free_bytes`` (client writes and replicated appends alike)."""
        free = self.disk.free_bytes()
        if free < self.config["storage.min_free_bytes"]:
            raise BrokerError(
                "RESOURCE_EXHAUSTED",
                f"free disk space {free} bytes is below storage.min_free_bytes "
                f"({self.config['storage.min_free_bytes']}); writes resume when space returns",
            )

    def set_redirect(self, client_address: str) -> None:
        """Where writers go: the master's client address as its Welcome or etcd says ("" unknown)."""
        self.redirect_address = client_address

    def register_master_silence(self, silent: Callable[[], bool]) -> None:
        """An automatic-failover coordinator's word that the master this slave follows has fallen
        silent (an election may follow): refusals then name no master rather than a dead one."""
        self.master_silent = silent
