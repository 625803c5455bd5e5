"""The client's copy of a cluster's routes (docs/shards.md): which shard writes each queue, and
each shard's nodes.

Filled from ``GetRoutes`` (any node of any shard answers from its watched copy of etcd) the first
time a topic is used, and corrected one queue at a time by a refusal that names the owner
(``errors.Owner``): a stale route costs one refused call, never a round trip to etcd. A group's
coordinator shard is learnt the same way: the first call goes to any node, which names it. A cluster
that is not sharded (the node answers ``shard = ""``, or an older node does not know the call) is
remembered as such, and the client talks to its pair as it always did.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from proto import tidemark_pb2 as pb

SHARD_DOUBT_S = 3.0  # a shard that failed a call this lately is avoided by keyless sends
GROUPS_KNOWN_MAX = 10_000  # groups whose coordinator is remembered (beyond: forgotten, asked again)


@dataclass
class ShardNodes:
    master: str  # client address ('' while it has none)
    nodes: list[str]  # every node's client address, the master's first

    def addresses(self) -> list[str]:
        return [self.master, *(n for n in self.nodes if n != self.master)] if self.master else list(self.nodes)


class RouteTable:
    """Thread-safe; ``sharded`` is None until a node said whether its cluster is."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sharded: bool | None = None
        self.revision = 0
        self._topics: dict[str, list[str]] = {}  # topic -> the shard of each queue
        # topic -> queue -> its segments (shard, logical start, end or None, state), for the queues that moved
        self._segments: dict[str, dict[int, list[tuple[str, int, int | None, str]]]] = {}
        self._shards: dict[str, ShardNodes] = {}
        self._doubt: dict[str, float] = {}  # shard -> when a call to it last failed (monotonic)
        self._groups: dict[str, str] = {}  # group -> the shard coordinating it (as a refusal named it)
        self._masters_asked = -SHARD_DOUBT_S  # when routes were last asked for a shard's missing master (monotonic)

    def learn(self, resp: pb.GetRoutesResponse) -> None:
        """Take a node's answer (its shard '' means: not a cluster of shards)."""
        with self._lock:
            if not resp.shard:
                self.sharded = False
                return
            self.sharded = True
            newer = resp.revision >= self.revision
            for t in resp.topics:
                if newer or t.topic not in self._topics:
                    self._topics[t.topic] = list(t.queue_shards)
                    self._segments[t.topic] = {m.queue: [(s.shard, s.logical_start, s.end if s.state == "ro" else None,
                                                          s.state) for s in m.segments] for m in t.moved}
            if newer:
                self.revision = resp.revision
                for s in resp.shards:
                    known = self._shards.get(s.shard)
                    # a shard between masters lists no nodes (its topology key goes with the master's
                    # lease): keep the nodes known, so its slave is still tried while it fails over
                    nodes = list(s.nodes) or (known.nodes if known is not None else [])
                    self._shards[s.shard] = ShardNodes(s.master, nodes)

    def queues(self, topic: str) -> list[str] | None:
        """The shard of each queue of ``topic``; None: not known here."""
        with self._lock:
            shards = self._topics.get(topic)
            return list(shards) if shards is not None else None

    def owner(self, topic: str, queue: int) -> str | None:
        with self._lock:
            shards = self._topics.get(topic)
            return shards[queue] if shards is not None and 0 <= queue < len(shards) else None

    def reader(self, topic: str, queue: int, offset: int) -> str | None:
        """The shard holding logical ``offset`` of ``queue`` (a queue that moved has several)."""
        with self._lock:
            for shard, start, end, _ in self._segments.get(topic, {}).get(queue, ()):
                if offset < start or end is None or offset < end:
                    return shard
            shards = self._topics.get(topic)
            return shards[queue] if shards is not None and 0 <= queue < len(shards) else None

    def segments(self, topic: str, queue: int) -> list[tuple[str, int, int | None, str]]:
        """A queue's segments as (shard, logical start, end or None, state), oldest first; [] if it
        never moved."""
        with self._lock:
            return list(self._segments.get(topic, {}).get(queue, ()))

    def has_segments(self, topic: str, queue: int) -> bool:
        """Whether ``queue`` moved (as far as these routes know): it has several segments."""
        with self._lock:
            return queue in self._segments.get(topic, {})

    def shards(self) -> list[str]:
        """Every shard known (sorted)."""
        with self._lock:
            return sorted(self._shards)

    def addresses(self, shard: str) -> list[str]:
        with self._lock:
            nodes = self._shards.get(shard)
            return nodes.addresses() if nodes is not None else []

    def moved(self, topic: str, queue: int, shard: str, master: str) -> None:
        """A node named ``shard`` (master at ``master``) as the writer of ``queue``."""
        with self._lock:
            shards = self._topics.get(topic)
            if shards is not None and 0 <= queue < len(shards):
                shards[queue] = shard
            self._master_named(shard, master)

    def group_shard(self, group: str) -> str | None:
        """The shard coordinating ``group`` (None: not heard yet; any node names it)."""
        with self._lock:
            return self._groups.get(group)

    def group_moved(self, group: str, shard: str, master: str) -> None:
        """A node named ``shard`` (master at ``master``) as ``group``'s coordinator."""
        with self._lock:
            if len(self._groups) >= GROUPS_KNOWN_MAX:
                self._groups.clear()
            self._groups[group] = shard
            self._master_named(shard, master)

    def master_named(self, shard: str, master: str) -> None:
        """A node named ``master`` as ``shard``'s master."""
        with self._lock:
            self._master_named(shard, master)

    def _master_named(self, shard: str, master: str) -> None:
        nodes = self._shards.setdefault(shard, ShardNodes("", []))
        if master:
            nodes.master = master
            if master not in nodes.nodes:
                nodes.nodes.append(master)

    def doubt(self, shard: str) -> None:
        """A call to ``shard`` failed: keyless sends avoid it for a moment."""
        with self._lock:
            self._doubt[shard] = time.monotonic()

    def trusted(self, shard: str) -> bool:
        """A shard with a master (as last heard) that has not failed a call lately."""
        with self._lock:
            nodes = self._shards.get(shard)
            failed = self._doubt.get(shard)
            return (nodes is not None and bool(nodes.master)
                    and (failed is None or time.monotonic() - failed >= SHARD_DOUBT_S))

    def ask_for_masters(self, shards: Iterable[str]) -> bool:
        """Whether to ask for the routes again: one of ``shards`` had no master when last heard (it
        was between masters), and no one asked for that in the last ``SHARD_DOUBT_S``. A caller that
        passes over such a shard (a pop, a keyless send) never calls it, so no refusal would ever
        name its next master."""
        with self._lock:
            now = time.monotonic()
            if now - self._masters_asked < SHARD_DOUBT_S:
                return False
            if all((nodes := self._shards.get(s)) is not None and nodes.master for s in shards):
                return False
            self._masters_asked = now
            return True

    def forget_group(self, group: str) -> None:
        with self._lock:
            self._groups.pop(group, None)

    def forget_groups(self) -> None:
        """Every group's coordinator asked again (a slot moved)."""
        with self._lock:
            self._groups.clear()

    def forget(self, topic: str) -> None:
        with self._lock:
            self._topics.pop(topic, None)
            self._segments.pop(topic, None)
