"""The write permit: whether this master may acknowledge writes at this instant (DESIGN §11).

Without a coordinator a master always may. With one, the coordinator grants the permit up to a
monotonic deadline that ends, by a safety margin, before its etcd lease can expire; every write
is checked against it when it arrives *and* again just before it is acknowledged, so a master that
stopped renewing its lease (paused, cut off) acknowledges nothing once the deadline passes, even
if the coordinator's own thread is late. ``strict`` (the failsafe while etcd is unreachable for
every node) makes every ack mode wait for a replica, so whatever is acknowledged is on the node
that could be elected next.
"""

from __future__ import annotations

import math
import time

from broker.errors import BrokerError


class WritePermit:
    def __init__(self) -> None:
        self._until = math.inf  # monotonic seconds
        self.strict = False
        self.reason = ""  # why there is no permit (shown in errors and status)

    def grant(self, until_monotonic: float, *, strict: bool = False) -> None:
        self.strict = strict
        self.reason = ""
        self._until = until_monotonic

    def withdraw(self, reason: str) -> None:
        self._until = -math.inf
        self.strict = False
        self.reason = reason

    def remaining_ms(self) -> float:
        return max(0.0, (self._until - time.monotonic()) * 1000) if self._until != math.inf else math.inf

    def valid(self) -> bool:
        return time.monotonic() < self._until

    def check(self, redirect: str) -> None:
        """Refuse (FAILED_PRECONDITION, naming the master when known) unless the permit holds now."""
        if time.monotonic() < self._until:
            return
        reason = self.reason or "this node's coordinator lease ran out (it cannot reach etcd)"
        raise BrokerError("FAILED_PRECONDITION", f"this node may not acknowledge writes: {reason}"
                          + (f"; the master is at {redirect}" if redirect else ""),
                          metadata=(("tidemark-master", redirect),))  # empty: not known yet

    def effective_ack(self, ack: str) -> str:
        return "replica" if self.strict else ack
