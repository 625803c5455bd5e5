"""When the master sent a message, on the slave's clock (an upper bound, as tight as the link allows).

The master stamps every ``Data`` with its monotonic clock (``sent_at_us``). The two clocks differ
by an unknown constant (the same host: none), and every message arrives at least that constant
plus the link's shortest transit after its stamp. So ``received - stamp`` is never below that
sum, and its minimum over the stream approaches it: ``stamp + minimum`` is when the message was
sent, on our clock, too late by at most the shortest transit (well under a millisecond on one
LAN) -- where its arrival time can be seconds late: messages that waited in the socket buffer
while this process was paused (SIGSTOP, a stalled VM) arrive together on resume.

What ages the slave's "known in sync" (follower.py) must be the send time: the master drops a
silent replica ``max_lag_ms`` after it *sent* what the replica acknowledged, and may then confirm
alone. Counted from the arrival, a slave resumed after a pause would believe itself in sync for
``max_lag_ms`` more, with the master possibly gone and past it.

A clock that runs faster than the master's makes the minimum stale, so the estimate errs early
(knowledge expires sooner: safe); one that runs slower lowers the minimum, which follows it.
One instance per stream: a master that restarted, on a rebooted host, starts another clock.
"""

from __future__ import annotations

import math


class SendClock:
    def __init__(self) -> None:
        self._delta_min_s = math.inf  # min(received - stamp) so far

    def sent_at(self, stamp_us: int, received_at: float) -> float:
        """When a message stamped ``stamp_us`` (0: not stamped) and received at monotonic
        ``received_at`` was sent, on our monotonic clock: never after ``received_at``."""
        if not stamp_us:
            return received_at  # a master that does not stamp: its arrival is all we know
        stamp_s = stamp_us / 1e6
        self._delta_min_s = min(self._delta_min_s, received_at - stamp_s)
        return stamp_s + self._delta_min_s
