"""Where plugins meet the store (DESIGN §9): small interfaces, registered with ``store.register_…``.

``broker`` never imports ``replication``, ``tieredstore`` or ``spark_connector``; they implement
these and the daemon's entry points wire them in. A plugin never assigns attributes on a core
object: it registers, and the core calls it.

| port | who implements it | registered with |
|---|---|---|
| ``ConfirmRule``: the confirm offset and the in-sync set (DESIGN §2) | ``replication/confirm.py`` | ``register_confirm_rule`` |
| ``RoleController``: promote, demote | ``replication/roles.py`` | ``register_role_controller`` |
| ``RoleListener``: told of every role change | timers, replication, tiered upload | ``register_role_listener`` |
| ``StatusProvider``: adds fields to ``status()`` | replication, tiered storage, the daemon | ``register_status_provider`` |
| ``ColdReader``: log ranges below the local start | ``tieredstore/reader.py`` | ``register_cold_reader`` |
| ``RetentionFloor``: local retention keeps everything at or above it | tiered storage (uploaded offset) | ``register_retention_floor`` |
| ``QueueListener``: told which queues grew in a dispatch round | the daemon's long-polls | ``register_queue_listener`` |
| ``Placement``: topics placed over a cluster of shards, each queue served by its own | ``replication/shards.py`` | ``register_placement`` |
| ``TxnPeers``: other shards' masters, for transactions over shards | ``replication/txn_peers.py`` | ``register_txn_peers`` |

Fencing is one call, ``store.fence(reason)``; a new epoch (``set_role("master")``) lifts it.
The data that crosses the append port is defined here too (``IncomingBatch``, ``BatchReceipt``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from broker.logformat.batch import NO_SEQUENCE
from broker.logformat.txn_records import Party

RoleListener = Callable[[str], None]
StatusProvider = Callable[[dict[str, object]], None]
RetentionFloor = Callable[[], int]
QueueListener = Callable[[set[tuple[str, int]]], None]


class ConfirmRule(Protocol):
    """Decides the confirm offset (DESIGN §2). Alone (no replication), a master confirms what it
    flushed and a slave confirms nothing by itself (``broker.store.watermarks.AloneRule``)."""

    def confirm(self, flushed_offset: int) -> int:
        """The confirm offset this node may publish now, given what it has flushed."""
        ...

    def insync_replicas(self) -> int:
        """In-sync replicas besides this node."""
        ...

    def replicas_acked(self, offset: int) -> int:
        """Replicas whose acknowledged (flushed) offset is at or past ``offset``."""
        ...


class RoleController(Protocol):
    def promote(self, unclean: bool) -> int:
        """Make this slave the master; return the new epoch."""
        ...

    def demote(self, master: str) -> None:
        """Make this master a slave of ``master`` (its replication address)."""
        ...


@dataclass(frozen=True)
class ShardRoute:
    """One shard of a cluster: its master's client address ('' while none), its nodes' client
    addresses, its master's epoch, the queues it writes."""

    shard: str
    master: str
    nodes: tuple[str, ...]
    epoch: int
    queues: int
    draining: bool = False
    slots: int = 0  # group slots it coordinates
    read_only: int = 0  # read-only segments of queues that moved away, still in its log


# Placement.pop_window_start: a group new to a queue here begins where it asked (latest: the end)
POP_AS_ASKED = -1


@dataclass(frozen=True)
class SegmentRoute:
    """One segment of a queue that moved: its shard, where it starts, where it ends once sealed
    (None while it is writable or being sealed), its state (rw, sealing, ro)."""

    shard: str
    logical_start: int
    end: int | None
    state: str


@dataclass(frozen=True)
class MoveDone:
    """One queue move of a rebalance: how long it took, and why it failed ('' when it did not)."""

    topic: str
    queue: int
    source: str
    target: str
    seconds: float
    error: str


@dataclass(frozen=True)
class Routes:
    """Where queues are written, as of one etcd revision: per topic the shard of each queue, and the
    segments of the queues that moved (or are moving)."""

    revision: int
    topics: dict[str, tuple[str, ...]]
    shards: tuple[ShardRoute, ...]
    moved: dict[str, dict[int, tuple[SegmentRoute, ...]]] = field(default_factory=dict)
    moves: tuple[tuple[str, int, str, str], ...] = ()  # moves under way: (topic, queue, from, to)


class Placement(Protocol):
    """A cluster of shards (docs/shards.md): where each topic's queues live, in etcd."""

    shard: str

    def place(self, topics: list[tuple[str, int]]) -> None:
        """Place new topics (name, queues) over the shards, all or none (blocks: etcd)."""
        ...

    def delete(self, topic: str) -> None:
        """Delete a placed topic in every shard (blocks: etcd); NOT_FOUND if it is not placed."""
        ...

    def check_queue(self, topic: str, queue: int, confirm: bool = True) -> None:
        """Raise unless this node's shard serves ``queue`` of ``topic`` (FAILED_PRECONDITION naming
        the owner, or UNAVAILABLE while its log does not hold the topic yet). A topic this node does
        not know is confirmed unknown with etcd first (blocks), unless ``confirm`` is False."""
        ...

    def check_read(self, topic: str, queue: int, offset: int, confirm: bool = True) -> None:
        """Raise unless this node's shard holds the segment of ``queue`` a read at logical ``offset``
        goes to (FAILED_PRECONDITION naming that segment's shard, or UNAVAILABLE while a segment
        a move started here is not in the log yet); ``confirm`` as for ``check_queue``."""
        ...

    async def confirm_unknown(self, topics: Iterable[str]) -> None:
        """Each of ``topics`` this node knows neither from etcd nor from its log is confirmed
        unknown with etcd (UNAVAILABLE when etcd holds it: this node's copy is behind), without
        holding the event loop: then ``check_queue``/``check_read`` with ``confirm=False``."""
        ...

    def move(self, topic: str, queue: int, to_shard: str, timeout_s: float) -> tuple[SegmentRoute, ...]:
        """Move ``queue`` of ``topic`` to ``to_shard`` (docs/shards.md) and wait until the target
        writes it (blocks: etcd, then the queue's shards); its segments after the move."""
        ...

    def rebalance(self, drain: str, undrain: str, dry_run: bool, timeout_s: float) -> list[MoveDone]:
        """Even out the shards' queues with the fewest moves (``drain``: that shard's all away, and
        no new queue there; ``undrain``: that ends); ``dry_run``: only the plan (blocks: the moves)."""
        ...

    def knows_group(self, group: str) -> bool:
        """Whether this node knows the shard coordinating ``group`` (``check_group`` will not block)."""
        ...

    def check_group(self, group: str) -> None:
        """Raise unless this node's shard coordinates ``group`` (FAILED_PRECONDITION naming the shard
        that does; its slot is given a shard first if it has none: blocks on etcd)."""
        ...

    def dead_letter_queue(self, topic: str) -> int | None:
        """This shard's queue of a group's dead-letter topic, placed with one queue per shard when
        absent (blocks: etcd); None while the log does not hold it, or it has no queue here."""
        ...

    def coordinates(self, group: str) -> bool:
        """Whether this shard coordinates ``group`` now (its log may still hold the offsets of a
        group whose slot moved away: not this shard's to list, describe or measure)."""
        ...

    def check_groups_open(self, groups: set[str], pid: int = 0) -> None:
        """Raise UNAVAILABLE (retry: moving) if the slot of one of ``groups`` (or transactional ids)
        is moving away from this shard: its offsets go along as they stand (called under the offset
        buffer's lock). ``pid``: a transaction's offsets, let in while the move waits for it."""
        ...

    def move_slot(self, slot: int, to_shard: str, timeout_s: float) -> str:
        """Move a group slot to ``to_shard`` and wait until that shard coordinates it (blocks: etcd,
        the slot's open transactions, the offsets' import); the slot's shard then."""
        ...

    def import_offsets(self, slot: int, source_shard: str, offsets: list[tuple[str, str, int, int]]) -> int:
        """On the master of the shard ``slot`` moves to: store the slot's committed offsets
        (replicated) while etcd marks it moving here; how many."""
        ...

    def check_in_log(self, topic: str, confirm: bool = True) -> None:
        """UNAVAILABLE while this shard's log does not hold a placed topic yet (its master creates it)."""
        ...

    def is_local(self, topic: str, queue: int) -> bool:
        """Whether this node's shard writes ``queue`` of ``topic`` (True for a topic etcd does not place)."""
        ...

    def segment_here(self, topic: str, queue: int) -> tuple[bool, int] | None:
        """A queue that may have moved (docs/shards.md): None when no segment of it is here; else
        (whether this shard writes it, where its latest segment here starts). An old segment serves
        the pop windows begun on it and cancels of the timers scheduled here; the writing one begins
        new pop windows at its start."""
        ...

    def pop_window_start(self, topic: str, queue: int, group: str) -> int | None:
        """Where ``group``, with no pop window on ``queue`` here yet and not asking for the earliest,
        begins one on this shard: ``POP_AS_ASKED`` (a queue that never moved); a segment's start
        (the writable segment a move began, or an older one here whose move carried the group's
        window: ``Segment.begins_pops_of``); None: no window begins here (only other old segments,
        or the writable one is being sealed: the group begins on the target). UNAVAILABLE until
        the node has loaded etcd's placements (``pop_gaps`` too)."""
        ...

    def pop_gaps(self, topic: str, queue: int) -> list[tuple[int, int]]:
        """The logical ranges [start, end) between this shard's segments of ``queue`` that other
        shards hold (a queue that moved away and back): never leased here."""
        ...

    def queue_count(self, topic: str) -> int | None:
        """The topic's queues over every shard; None when it is not placed."""
        ...

    def owners(self, topic: str) -> list[tuple[str, str]] | None:
        """Per queue: (shard, its master's client address); None when the topic is not placed."""
        ...

    def routes(self, topics: list[str]) -> Routes:
        """The shard of each queue of ``topics`` (unplaced ones left out) and every shard's nodes."""
        ...


class TxnPeers(Protocol):
    """Calls from a transaction's coordinator shard to its participants' masters (docs/shards.md
    "Transactions across shards"), with this node's own credential. Each raises ``BrokerError``
    when the shard cannot answer now (no master, unreachable, refused): the caller retries."""

    def prepare(self, tid: str, party: Party, timeout_s: float) -> str:
        """Ask ``party`` to prepare: '' once it is prepared, else the reason it aborted."""
        ...

    def decide(self, tid: str, party: Party, commit: bool, timeout_s: float) -> bool:
        """Deliver the decision; returns how the participant ended (True: committed)."""
        ...

    def forward_timers(self, shard: str, source_shard: str, topic: str, queue: int,
                       timers: list[tuple[int, bytes, bytes, bytes]], timeout_s: float) -> int:
        """Deliver due timers (offset here, key, body, delivery properties) of a queue that moved to
        ``shard``, its shard now (each stored there once); how many were stored now."""
        ...


class ColdReader(Protocol):
    """Reads of log ranges below the local log start (tiered storage plugs one in)."""

    def min_offset(self) -> int:
        """Lowest offset readable contiguously up to the local log start (the log start when none)."""
        ...

    def read(self, offset: int, length: int) -> bytes:
        """Log bytes [offset, offset + length) (whole batches); shorter when they are not stored."""
        ...


class Truncation(enum.Enum):
    """What cutting the log at a divergence point did (DESIGN §4)."""

    NOTHING = "nothing"  # the log already ended at or below the point
    CUT = "cut"  # the unconfirmed tail above the point is gone
    BELOW_APPLIED = "below_applied"  # below what this node applied or confirmed: re-bootstrap (unclean)


@dataclass(slots=True)
class IncomingBatch:
    """A batch as a client sent it: records already encoded, with their CRC32C."""

    topic: str
    queue_id: int
    records: bytes | memoryview  # a send's: a view of the request's bytes (broker/daemon/send_wire.py)
    record_count: int
    body_crc: int
    producer_id: int = 0
    base_sequence: int = NO_SEQUENCE
    flags: int = 0
    timer_target: tuple[str, int] | None = None  # a delayed batch for __timer: the (topic, queue) it fires into


@dataclass(frozen=True, slots=True)
class BatchReceipt:
    commit_offset: int
    base_queue_offset: int
    record_count: int
    duplicate: bool = False
