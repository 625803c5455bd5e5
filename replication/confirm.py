"""The in-sync set and the confirm rule (DESIGN §2, §4): the one place that decides both.

A replica is *in sync* while it is no more than ``replication.max_lag_bytes`` behind the log end
and has caught up with the log end within the last ``replication.max_lag_ms``. A disconnect does
not remove it at once: a slave promises to promote cleanly only within ``max_lag_ms`` of last
hearing from us, so we must not confirm alone before that time has passed.

As master, the confirm offset is min(flushed, acked offset of every in-sync replica); with none in
sync the master confirms alone. As slave, it is min(flushed, the master's confirm offset).
The streams (``master.py``, ``follower.py``) only report events here.

With a coordinator (DESIGN §11) the in-sync set recorded in etcd decides who may be elected, so a
replica recorded there is *pinned*: the confirm offset waits for it even once it falls out of sync
here, until the coordinator has removed it from etcd (``unpin``). A replica is pinned before it is
added to etcd. So whatever is confirmed is on every node that etcd lets be elected.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from broker.config import Config

log = structlog.get_logger("replication.confirm")
REPLICAS_MAX = 16  # beyond this, replicas that left (disconnected, out of sync) are forgotten


@dataclass
class Replica:
    node_id: str
    address: str
    acked_offset: int = 0
    connected: bool = True
    caught_up_at: float = field(default_factory=time.monotonic)
    in_sync: bool = False
    sent_end: int = 0  # the log end shipped to it so far
    evicted: str = ""  # why it was thrown out (a protocol violation)
    last_ack_at: float = 0.0  # monotonic: when its last ack arrived
    # monotonic: when we sent the newest message it had received when it last acknowledged (it
    # echoes our stamp). An ack proves the slave heard us at that time, not when the ack arrives:
    # acks that waited in a socket buffer while this process was paused arrive "now" and prove
    # nothing about now
    heard_sent_at: float = 0.0
    coordinator_unreachable_ms: int = 0  # as its last ack said: how long it has not reached etcd
    # (log end reached by a send, when it was sent): acking past it means caught up at that time
    sent_to_end: collections.deque[tuple[int, float]] = field(default_factory=collections.deque)


class InSyncSet:
    """The ``ConfirmRule`` (broker/ports.py) of a replicated node."""

    def __init__(self, config: Config, role: Callable[[], str], log_end: Callable[[], int]) -> None:
        self.config = config
        self._role = role
        self._log_end = log_end
        self._lock = threading.Lock()
        self.replicas: dict[str, Replica] = {}
        self.master_confirm = 0  # as a slave: the confirm offset our master last sent
        self._last_role = ""
        self.pinned: set[str] = set()  # node ids in etcd's in-sync set: confirm waits for them

    # -- the rule -----------------------------------------------------------------------------
    def confirm(self, flushed_offset: int) -> int:
        role = self._role()
        if role != self._last_role:  # a node that stops being master knows nothing of a master's confirm
            if role != "master":     # offset yet (a value from an earlier time as a slave is stale)
                self.master_confirm = 0
            self._last_role = role
        if role != "master":
            return min(flushed_offset, self.master_confirm)
        with self._lock:
            self._refresh_all()
            acked = [r.acked_offset for r in self.replicas.values() if r.in_sync or r.node_id in self.pinned]
            acked += [0 for node_id in self.pinned if node_id not in self.replicas]  # pinned, never connected
        return min([flushed_offset, *acked])

    # -- the coordinator's pins -----------------------------------------------------------------
    def pin(self, node_id: str) -> None:
        with self._lock:
            self.pinned.add(node_id)

    def unpin(self, node_id: str) -> None:
        with self._lock:
            self.pinned.discard(node_id)

    def set_pins(self, node_ids: set[str]) -> None:
        with self._lock:
            self.pinned = set(node_ids)

    def insync_replicas(self) -> int:
        with self._lock:
            self._refresh_all()
            return sum(1 for r in self.replicas.values() if r.in_sync)

    def replicas_acked(self, offset: int) -> int:
        with self._lock:
            return sum(1 for r in self.replicas.values() if r.acked_offset >= offset)

    def _refresh_all(self) -> None:
        now = time.monotonic()
        for r in self.replicas.values():
            self._refresh(r, now)

    def _refresh(self, r: Replica, now: float) -> None:
        lag_bytes = self._log_end() - r.acked_offset
        in_sync = (
            lag_bytes <= self.config["replication.max_lag_bytes"]
            and (now - r.caught_up_at) * 1000 <= self.config["replication.max_lag_ms"]
        )
        if in_sync != r.in_sync:
            r.in_sync = in_sync
            log.info("replica_in_sync" if in_sync else "replica_out_of_sync", node=r.node_id, acked=r.acked_offset,
                     lag_bytes=lag_bytes)

    # -- events of the master's streams ----------------------------------------------------------
    def connected(self, node_id: str, address: str, acked_offset: int) -> Replica:
        replica = Replica(node_id, address, acked_offset=acked_offset)
        with self._lock:
            self.replicas[node_id] = replica
            if len(self.replicas) > REPLICAS_MAX:  # node ids come from peers: keep the set bounded
                self._refresh_all()
                for gone in [k for k, r in self.replicas.items() if not r.connected and not r.in_sync]:
                    del self.replicas[gone]
        return replica

    def sent_to_end(self, replica: Replica, log_end: int) -> None:
        """A send (or heartbeat) brought ``replica`` up to ``log_end`` now."""
        with self._lock:
            replica.sent_to_end.append((log_end, time.monotonic()))

    def acked(self, replica: Replica, flushed_offset: int, coordinator_unreachable_ms: int = 0,
              heard_sent_at: float = 0.0) -> None:
        with self._lock:
            replica.last_ack_at = now = time.monotonic()
            # a stamp from the future is not one we sent: it dates nothing
            if heard_sent_at <= now:
                replica.heard_sent_at = max(replica.heard_sent_at, heard_sent_at)
            replica.coordinator_unreachable_ms = coordinator_unreachable_ms
            replica.acked_offset = max(replica.acked_offset, flushed_offset)
            while replica.sent_to_end and replica.sent_to_end[0][0] <= flushed_offset:
                replica.caught_up_at = replica.sent_to_end.popleft()[1]
            self._refresh(replica, time.monotonic())

    def disconnected(self, replica: Replica) -> None:
        with self._lock:
            replica.connected = False
            self._refresh(replica, time.monotonic())

    def evict(self, replica: Replica, why: str) -> None:
        """A replica broke the protocol: its stream ends and its claim is not believed. It leaves the
        in-sync set as a disconnected replica does (after ``max_lag_ms``, having never counted past what
        it was really sent), because a genuine slave cut off at that moment still believes itself in
        sync and promotable until then."""
        with self._lock:
            replica.evicted = why
            replica.connected = False
            replica.acked_offset = min(replica.acked_offset, replica.sent_end)
            self._refresh(replica, time.monotonic())
        log.warning("replica_evicted", node=replica.node_id, reason=why)

    def describe(self) -> list[dict[str, object]]:
        """The replicas as ``status()["replicas"]`` shows them (lag rules re-evaluated now)."""
        with self._lock:
            self._refresh_all()
            log_end, now = self._log_end(), time.monotonic()
            return [{"node_id": r.node_id, "address": r.address, "acked_offset": r.acked_offset, "in_sync": r.in_sync,
                     "connected": r.connected, "lag_bytes": max(0, log_end - r.acked_offset),
                     "coordinator_unreachable_ms": r.coordinator_unreachable_ms,
                     "heard_ms_ago": int((now - r.heard_sent_at) * 1000) if r.heard_sent_at else 0}
                    for r in self.replicas.values()]

    # -- events of the slave's follower -----------------------------------------------------------
    def follow(self, known_confirmed: int) -> None:
        """Start following a master; ``known_confirmed`` is what this node knows was confirmed."""
        self._last_role = "slave"
        self.master_confirm = known_confirmed

    def master_confirmed(self, offset: int) -> bool:
        """The master sent its confirm offset; True when it moved."""
        if offset <= self.master_confirm:
            return False
        self.master_confirm = offset
        return True
