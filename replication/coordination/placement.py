"""Where a topic's queues live in a cluster of shards (docs/shards.md): the record etcd keeps at
``/tidemark/<cluster>/topics/<topic>`` and how the queues of new topics are spread.

A topic has a fixed number of queues; each queue is a list of **segments** ``{shard,
logical_start, state}``, oldest first, the writable owner always the last segment's shard. A
move (issue 39) goes through three states of the last segment: ``rw`` (writable) → ``sealing``
(``to`` names the target; the owner's master stops writes) → ``ro`` (``end``: the logical offset it
ends at, written by the owner's master once everything in it is confirmed) followed by a new
``rw`` segment on the target starting at that offset. Every segment but the last is ``ro``. A
deleted topic's record stays as a tombstone (``"deleted": true``): each shard's master deletes the
topic from its log, and no master ever adopts it back as unplaced.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from replication.coordination.records import FORMAT_VERSION, RecordError

STATES = ("rw", "sealing", "ro")
# pop groups a segment a move began lists by name (more: it begins every new group's window at its
# start): at most 64 names of at most 123 bytes, 8 KB of the topic's record a move; and at most
# POP_NAMES_BYTES_MAX of names in the whole record (the oldest lists beyond it become pop_all)
POP_GROUPS_CARRIED_MAX = 64
POP_NAMES_BYTES_MAX = 128 * 1024


@dataclass(frozen=True)
class Segment:
    shard: str
    logical_start: int = 0
    state: str = "rw"
    end: int | None = None  # ro: where it ends (exclusive)
    to: str = ""  # sealing: the shard it moves to
    # a segment a move began: the last batch of the queue's latest producers on the shard before
    # ([producer id, base sequence, count, base offset, base queue offset]), so that a send retried
    # across the move is stored once
    producers: tuple[tuple[int, ...], ...] = ()
    fresh: bool = False  # a segment a move began whose shard has not started it in its log yet
    # a segment a move began: the pop groups with a window on the queue before it (on the sealed
    # shard, or carried by the segment sealed), which begin a window here at its start even once it
    # is old, so a queue moved away and back loses no message to them; pop_all: more than could be
    # listed: every group new to it begins at its start (more deliveries rather than a loss)
    pop_groups: tuple[str, ...] = ()
    pop_all: bool = False

    def holds(self, offset: int) -> bool:
        """Whether a read at logical ``offset`` belongs to this segment (an open one: any past its start)."""
        return offset >= self.logical_start and (self.end is None or offset < self.end)

    def encoded(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shard": self.shard, "logical_start": self.logical_start, "state": self.state}
        if self.end is not None:
            out["end"] = self.end
        if self.to:
            out["to"] = self.to
        if self.producers:
            out["producers"] = [list(p) for p in self.producers]
        if self.fresh:
            out["fresh"] = True
        if self.pop_groups:
            out["pop_groups"] = list(self.pop_groups)
        if self.pop_all:
            out["pop_all"] = True
        return out

    def begins_pops_of(self, group: str) -> bool:
        """Whether ``group``, new to this segment's shard, begins a pop window at its start (for a
        segment a move began: any but a queue's first)."""
        return self.pop_all or group in self.pop_groups

    def unlisted(self) -> Segment:
        """This segment as an earlier one keeps it: without the producers and the fresh mark only
        the writable one needs (its pop groups stay)."""
        return Segment(self.shard, self.logical_start, self.state, self.end, pop_groups=self.pop_groups,
                       pop_all=self.pop_all)


@dataclass(frozen=True)
class Placement:
    segments: tuple[tuple[Segment, ...], ...]  # per queue, oldest first
    deleted: bool = False  # a tombstone: each shard's master deletes the topic from its log

    @property
    def queues(self) -> int:
        return len(self.segments)

    def owner(self, queue: int) -> str:
        """The shard that writes ``queue`` (its last segment's)."""
        return self.segments[queue][-1].shard

    def shards(self) -> set[str]:
        return {s.shard for q in self.segments for s in q}

    def queues_of(self, shard: str) -> list[int]:
        return [q for q in range(self.queues) if self.owner(q) == shard]

    def last(self, queue: int) -> Segment:
        return self.segments[queue][-1]

    def segment_at(self, queue: int, offset: int) -> Segment:
        """The segment a read of ``queue`` at logical ``offset`` goes to: the one holding it, the
        first below any start, the last past every end."""
        segs = self.segments[queue]
        for seg in segs:
            if seg.holds(offset) or offset < seg.logical_start:
                return seg
        return segs[-1]

    def moving(self) -> list[tuple[int, Segment]]:
        """The queues being sealed now, with their sealing segment."""
        return [(q, segs[-1]) for q, segs in enumerate(self.segments) if segs[-1].state == "sealing"]

    def with_last(self, queue: int, *segments: Segment) -> Placement:
        """This placement with ``queue``'s last segment replaced by ``segments``."""
        per_queue = list(self.segments)
        per_queue[queue] = (*per_queue[queue][:-1], *segments)
        return Placement(tuple(per_queue), self.deleted)


def sealing(p: Placement, queue: int, to: str) -> Placement:
    """A move's first step: the queue's writable segment marked sealing, toward ``to``."""
    last = p.last(queue)
    return p.with_last(queue, Segment(last.shard, last.logical_start, "sealing", to=to, producers=last.producers,
                                      pop_groups=last.pop_groups, pop_all=last.pop_all))


def switched(p: Placement, queue: int, end: int, producers: list[list[int]] | None = None,
             pop_groups: Iterable[str] = ()) -> Placement:
    """A move's second step (its owner's master, once the segment is confirmed up to ``end``): the
    sealing segment read-only at ``end``, a writable one on its target from there, carrying the
    queue's ``producers`` (their last batches) and the pop groups with a window on the queue
    (``pop_groups``, those of the sealed segment's shard; with the ones the sealed segment carries,
    at most ``POP_GROUPS_CARRIED_MAX``, else ``pop_all``). Earlier segments forget their producers:
    only the writable one's matter."""
    segs = p.segments[queue]
    last = segs[-1]
    done = [s.unlisted() for s in segs[:-1]]
    groups = sorted({*last.pop_groups, *pop_groups})
    carried_all = last.pop_all or len(groups) > POP_GROUPS_CARRIED_MAX
    per_queue = list(p.segments)
    per_queue[queue] = (*done, Segment(last.shard, last.logical_start, "ro", end=end, pop_groups=last.pop_groups,
                                       pop_all=last.pop_all),
                        Segment(last.to, end, producers=tuple(tuple(r) for r in producers or ()), fresh=True,
                                pop_groups=() if carried_all else tuple(groups), pop_all=carried_all))
    return _names_bounded(Placement(tuple(per_queue), p.deleted))


def _names_bounded(p: Placement) -> Placement:
    """``p`` with at most ``POP_NAMES_BYTES_MAX`` of pop group names: beyond it, the oldest
    segments' lists (queue by queue, oldest first) become ``pop_all`` (more deliveries to groups
    new to those segments, never a loss), so the record does not grow for good with moves."""
    total = sum(len(g) + 3 for q in p.segments for s in q for g in s.pop_groups)
    if total <= POP_NAMES_BYTES_MAX:
        return p
    per_queue = [list(q) for q in p.segments]
    for depth in range(max(len(q) for q in per_queue)):  # the oldest segments of every queue first
        for segs in per_queue:
            if depth < len(segs) - 1 and segs[depth].pop_groups and total > POP_NAMES_BYTES_MAX:
                seg = segs[depth]
                total -= sum(len(g) + 3 for g in seg.pop_groups)
                segs[depth] = dataclasses.replace(seg, pop_groups=(), pop_all=True)
    return Placement(tuple(tuple(q) for q in per_queue), p.deleted)


def encode(p: Placement) -> bytes:
    body: dict[str, Any] = {"v": FORMAT_VERSION, "queues": p.queues,
                            "segments": [[s.encoded() for s in q] for q in p.segments]}
    if p.deleted:
        body["deleted"] = True
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode(raw: bytes) -> Placement:
    try:
        body = json.loads(raw)
        queues = int(body["queues"])
        segments = tuple(tuple(Segment(str(s["shard"]), int(s["logical_start"]), str(s["state"]),
                                       int(s["end"]) if s.get("end") is not None else None, str(s.get("to", "")),
                                       tuple(_producer(r) for r in s.get("producers", ())), s.get("fresh") is True,
                                       _names(s.get("pop_groups", [])), s.get("pop_all") is True)
                               for s in q) for q in body["segments"])
        deleted = body.get("deleted", False) is True
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RecordError(f"not a placement: {exc}") from None
    if queues != len(segments) or queues < 1 or any(not q for q in segments):
        raise RecordError(f"a placement of {queues} queues lists {len(segments)}, or a queue without a segment")
    for q in segments:
        _check_segments(q)
    return Placement(segments, deleted)


def _names(rows: Any) -> tuple[str, ...]:
    if not isinstance(rows, list) or not all(isinstance(r, str) for r in rows):
        raise ValueError("pop_groups is not a list of names")
    return tuple(rows)


def _producer(row: Any) -> tuple[int, ...]:
    out = tuple(int(v) for v in row)
    if len(out) != 5:
        raise ValueError(f"a carried producer of {len(out)} numbers, not 5")
    return out


def _check_segments(segs: tuple[Segment, ...]) -> None:
    """Every segment but the last read-only with an end; starts that follow those ends; a sealing
    segment names its target; only a read-only one has an end."""
    if any(s.state not in STATES or not s.shard for s in segs):
        raise RecordError("a segment without a shard, or in a state other than rw, sealing or ro")
    if any(s.state != "ro" for s in segs[:-1]) or segs[0].logical_start != 0:
        raise RecordError("a segment before the last that is not read-only, or a first one not starting at 0")
    for s in segs:
        if (s.end is not None) != (s.state == "ro") or (s.end is not None and s.end < s.logical_start):
            raise RecordError("a read-only segment without an end (or another one with one), or one ending before it starts")
        if bool(s.to) != (s.state == "sealing") or s.to == s.shard:
            raise RecordError("a sealing segment without another shard to move to (or another one naming one)")
    if any(b.logical_start != a.end for a, b in itertools.pairwise(segs)):
        raise RecordError("a segment that does not start where the one before it ends")


def spread(held: dict[str, int], topics: list[tuple[str, int]]) -> dict[str, Placement]:
    """The queues of new ``topics`` ((name, queue count), in order) over the shards of ``held``
    (each live shard: the queues it writes now): each queue to the shard that holds the fewest at
    that moment, ties to the lowest name. 16 queues over two even shards: 8 and 8; a new shard
    takes new queues until it has caught up."""
    if not held:
        raise ValueError("no live shard to place queues on")
    counts = dict(held)
    out: dict[str, Placement] = {}
    for topic, n in topics:
        per_queue = []
        for _ in range(n):
            shard = min(counts, key=lambda s: (counts[s], s))
            counts[shard] += 1
            per_queue.append((Segment(shard),))
        out[topic] = Placement(tuple(per_queue))
    return out
