"""The client's API, topics, timers, status and role changes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grpc

from broker.client.core import ClientCore, _request
from broker.client.errors import BrokerError, error_for
from broker.client.messages import Receipt
from broker.errors import shown
from broker.logformat.system_records import SYSTEM_PREFIX
from proto import tidemark_pb2 as pb

ROUTES_TOPICS_MAX = 1000  # topics per GetRoutes call


class TopicsAPI(ClientCore):
    """Topics, timers, status and role changes."""

    def create_topic(self, name: str, queues: int = 1) -> None:
        """Create ``name`` with ``queues`` queues (ALREADY_EXISTS if it exists; names: 1-127 of
        [A-Za-z0-9._-], not starting with ``__``)."""
        self._call("CreateTopic", _request(pb.CreateTopicRequest, name=name, queues=queues), retry=False)
        self._queues[name] = queues

    def create_topics(self, topics: Mapping[str, int]) -> None:
        """Create every topic of ``topics`` (name → queues) in one call, all or none (at most 1,000;
        128 in a cluster of shards: one etcd transaction)."""
        request = pb.CreateTopicsRequest(topics=[_request(pb.CreateTopicRequest, name=n, queues=q) for n, q in topics.items()])
        self._call("CreateTopics", request, retry=False)
        self._queues.update(topics)

    def delete_topic(self, name: str) -> None:
        """Delete ``name``: its messages become unreadable and their space is reclaimed by retention."""
        self._call("DeleteTopic", _request(pb.DeleteTopicRequest, name=name), retry=False)
        self._queues.pop(name, None)
        self._routes.forget(name)

    def list_topics(self, include_system: bool = False) -> dict[str, dict[str, Any]]:
        """Every topic: ``{name: {"queues": n, "max_offsets": [next queue offset of each queue],
        "stable_offsets": [each queue's LSO: where read_committed readers stop]}}`` (system topics,
        ``__...``, only with ``include_system``)."""
        resp = self._call("ListTopics", pb.ListTopicsRequest(include_system=include_system))
        listed = {t.name: {"queues": t.queues, "max_offsets": list(t.queue_max_offsets),
                           "stable_offsets": list(t.queue_stable_offsets) or list(t.queue_max_offsets)}
                  for t in resp.topics}
        if not self.sharded:
            return listed
        # a cluster of shards: each queue's offsets from its own shard (system topics: the asked node's)
        return {**{n: t for n, t in listed.items() if n.startswith(SYSTEM_PREFIX)}, **self._list_sharded()}

    def _list_sharded(self) -> dict[str, dict[str, Any]]:
        """Every topic some shard's log holds, each queue's offsets as its owner lists them."""
        self._learn_routes([])  # the shards as they are now
        answers: dict[str, dict[str, pb.TopicInfo]] = {}
        for shard in self._routes.shards():
            resp = self._shard_core(shard)._call("ListTopics", pb.ListTopicsRequest())
            answers[shard] = {t.name: t for t in resp.topics}
        names = sorted({n for topics in answers.values() for n in topics})
        unknown = [n for n in names if self._routes.queues(n) is None]
        for start in range(0, len(unknown), ROUTES_TOPICS_MAX):
            self._learn_routes(unknown[start:start + ROUTES_TOPICS_MAX])
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            owners = self._routes.queues(name)
            if owners is None:  # deleted meanwhile
                continue
            highs, stable = [], []
            for q, shard in enumerate(owners):
                info = answers.get(shard, {}).get(name)  # None: its log does not hold the topic yet (empty)
                highs.append(int(info.queue_max_offsets[q]) if info is not None else 0)
                stable.append(int((info.queue_stable_offsets or info.queue_max_offsets)[q]) if info is not None else 0)
            out[name] = {"queues": len(owners), "max_offsets": highs, "stable_offsets": stable}
        return out

    def describe_topic(self, name: str) -> dict[str, Any]:
        """Queues with their min/max offsets, stored bytes, local and tiered ranges; in a cluster of
        shards the shard that writes each and its master, each queue as its own shard describes it
        (``topic_id`` is the asked node's), and its ``segments`` ``[{"shard", "logical_start", "end",
        "state"}]`` (one until it moves; the writer's ``min_offset`` is its segment's)."""
        request = _request(pb.DescribeTopicRequest, name=name)
        resp = self._call("DescribeTopic", request)
        queues = {q.queue_id: q for q in resp.queues}
        owners = {q.shard for q in resp.queues if q.shard}
        if owners and self.sharded:  # a cluster of shards: each queue as its own shard describes it
            for shard in sorted(owners):
                try:
                    theirs = self._shard_core(shard)._call("DescribeTopic", request)
                except BrokerError as exc:
                    if exc.code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE):
                        raise
                    continue  # its log does not hold the topic yet, or no node answers: the asked node's row
                queues.update({q.queue_id: q for q in theirs.queues if q.shard == shard})
        rows = [{"queue_id": q.queue_id, "min_offset": q.min_offset, "max_offset": q.max_offset,
                 "bytes": q.bytes, "local_min_offset": q.local_min_offset,
                 "tiered_end_offset": q.tiered_end_offset, "shard": q.shard, "master": q.master}
                for _, q in sorted(queues.items())]
        if owners and self.sharded:  # each queue's segments (several once it moved; docs/shards.md)
            self._learn_routes([name])
            for row in rows:
                moved = self._routes.segments(name, row["queue_id"])
                row["segments"] = [{"shard": s, "logical_start": a, "end": e, "state": st} for s, a, e, st in moved] or \
                    [{"shard": row["shard"], "logical_start": 0, "end": None, "state": "rw"}]
        return {"name": resp.name, "topic_id": resp.topic_id, "queues": rows}

    def queue_bounds(self, topic: str, queue_id: int) -> dict[str, Any]:
        """One queue as ``describe_topic`` gives it, told by the node of the shard that writes it (an
        error when that shard does not answer: never another node's zeros)."""
        request = _request(pb.DescribeTopicRequest, name=topic)
        resp = self._routed(topic, queue_id, lambda core: core._call("DescribeTopic", request))
        q = next((q for q in resp.queues if q.queue_id == queue_id), None)
        if q is None:
            raise error_for(grpc.StatusCode.INVALID_ARGUMENT, f"{shown(topic)} has no queue {queue_id}")
        return {"queue_id": q.queue_id, "min_offset": q.min_offset, "max_offset": q.max_offset, "bytes": q.bytes,
                "local_min_offset": q.local_min_offset, "tiered_end_offset": q.tiered_end_offset, "shard": q.shard,
                "master": q.master}

    def cluster_status(self) -> dict[str, Any]:
        """The cluster as the asked node's copy of etcd has it (docs/shards.md): ``{"sharded",
        "shard" (the asked node's), "revision", "shards": [{"shard", "master", "nodes", "epoch",
        "queues", "draining", "slots", "read_only_segments", "drained"}], "moves": [{"topic",
        "queue", "from", "to"}]}`` (moves under way; a group slot's: topic "", its slot as queue). A one-pair
        cluster answers ``sharded`` False and no shards."""
        try:
            resp = self._call("GetRoutes", pb.GetRoutesRequest())
        except BrokerError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            resp = pb.GetRoutesResponse()
        return {"sharded": bool(resp.shard), "shard": resp.shard, "revision": resp.revision,
                "shards": [{"shard": s.shard, "master": s.master, "nodes": list(s.nodes), "epoch": s.epoch,
                            "queues": s.queues, "draining": s.draining, "slots": s.slots,
                            "read_only_segments": s.read_only_segments,
                            # drained: it writes no queue, coordinates no group slot and nothing moves
                            # off it (its read-only segments stay: see docs/shards.md before removing it)
                            "drained": s.draining and not s.queues and not s.slots and not any(
                                m.from_shard == s.shard for m in resp.moves)}
                           for s in resp.shards],
                "moves": [{"topic": m.topic, "queue": m.queue_id, "from": m.from_shard, "to": m.to_shard}
                          for m in resp.moves]}

    def rebalance(self, *, drain: str = "", undrain: str = "", dry_run: bool = False,
                  timeout_ms: int = 600_000) -> list[dict[str, Any]]:
        """Even out the shards' writable queues with the fewest moves (docs/shards.md "Rebalance and
        drain"); ``drain``: mark that shard draining first (all its queues move away and new ones
        avoid it), ``undrain``: no longer; ``dry_run``: only the plan. Each move ``{"topic", "queue",
        "from", "to", "seconds", "error"}`` ("" when it went through)."""
        request = pb.RebalanceRequest(drain_shard=drain, undrain_shard=undrain, dry_run=dry_run, timeout_ms=timeout_ms)
        resp = self._call("Rebalance", request, timeout_s=self.timeout_s + timeout_ms / 1000.0, retry=False)
        self._routes.forget_groups()  # a drain moves group slots too
        for m in resp.moves:
            self._routes.forget(m.topic)
        return [{"topic": m.topic, "queue": m.queue_id, "from": m.from_shard, "to": m.to_shard,
                 "seconds": m.duration_ms / 1000.0, "error": m.error} for m in resp.moves]

    def move_queue(self, topic: str, queue: int, to_shard: str, timeout_ms: int = 30_000) -> list[dict[str, Any]]:
        """Move ``queue`` of ``topic`` to shard ``to_shard`` (docs/shards.md, "Moving a queue"): its
        segment is sealed where it is and the queue continues on ``to_shard`` at the same logical
        offset, no data copied. Returns its segments ``[{"shard", "logical_start", "end", "state"}]``
        once the target writes it; DEADLINE_EXCEEDED after ``timeout_ms`` (the move goes on)."""
        request = pb.MoveQueueRequest(topic=topic, queue_id=queue, to_shard=to_shard, timeout_ms=timeout_ms)
        resp = self._call("MoveQueue", request, timeout_s=self.timeout_s + timeout_ms / 1000.0)
        self._routes.forget(topic)  # its routes changed: asked for again at the next use
        return [{"shard": s.shard, "logical_start": s.logical_start, "end": s.end if s.state == "ro" else None,
                 "state": s.state} for s in resp.segments]

    def move_slot(self, slot: int, to_shard: str, timeout_ms: int = 120_000) -> str:
        """Move group slot ``slot`` (``crc32c(group) % 256``: its groups' members, committed offsets
        and its transactional ids) to shard ``to_shard`` (docs/shards.md, "Moving a group slot");
        returns once that shard coordinates it. Offset commits of its groups are retried meanwhile;
        the move waits for the transactions open on the slot's shard (DEADLINE_EXCEEDED after
        ``timeout_ms``: the move goes on)."""
        request = pb.MoveSlotRequest(slot=slot, to_shard=to_shard, timeout_ms=timeout_ms)
        resp = self._call("MoveSlot", request, timeout_s=self.timeout_s + timeout_ms / 1000.0)
        self._routes.forget_groups()
        return str(resp.shard)

    def cancel_timer(self, receipt: Receipt | int) -> dict[str, Any]:
        """Cancel a scheduled message (its receipt, or its ``timer_offset``) before it fires.
        A fired, cancelled or firing timer: FAILED_PRECONDITION; an unknown one: NOT_FOUND."""
        offset = receipt if isinstance(receipt, int) else receipt.timer_offset
        if offset is None:
            raise ValueError("this receipt is not a timer message's (it has no timer_offset)")
        if isinstance(receipt, int):
            if self.sharded:
                raise ValueError("in a cluster of shards cancel a timer by its receipt: a timer offset alone is one "
                                 "shard's log offset, and another shard may hold a timer at the same offset")
            resp = self._call("CancelTimer", _request(pb.CancelTimerRequest, timer_offset=offset), retry=False)
        else:  # to the shard that holds the timer (its receipt's), or of the message's queue; it names its queue
            request = _request(pb.CancelTimerRequest, timer_offset=offset, topic=receipt.topic, queue_id=receipt.queue_id)
            if receipt.shard and self.sharded:  # still there after the queue moved away (docs/shards.md)
                resp = self._shard_core(receipt.shard)._call("CancelTimer", request, retry=False)
            else:
                resp = self._routed(receipt.topic, receipt.queue_id,
                                    lambda core: core._call("CancelTimer", request, retry=False))
        return {"timer_offset": offset, "deliver_at_ms": resp.deliver_at_ms, "topic": resp.topic,
                "queue_id": resp.queue_id}

    def status(self) -> dict[str, Any]:
        """The connected node's status (DESIGN §8): role, epoch, offsets, replicas, timers, errors...
        as a dict (``typed_status()`` gives the same as the ``NodeStatus`` message)."""
        return dict(json.loads(self._call("Status", pb.StatusRequest()).json))

    def typed_status(self) -> pb.NodeStatus:
        """The connected node's status as the typed ``tidemark.v1.NodeStatus`` message."""
        return self._call("Status", pb.StatusRequest()).status

    def promote(self, unclean: bool = False) -> int:
        """Make the connected node (a slave) the master; returns its new epoch."""
        return int(self._call("Promote", pb.PromoteRequest(unclean=unclean), retry=False).epoch)

    def demote(self, master: str) -> None:
        """Make the connected node (a master) a slave of ``master``."""
        self._call("Demote", _request(pb.DemoteRequest, master=master), retry=False)

    def _queue_count(self, topic: str) -> int:
        if topic not in self._queues:
            if self.sharded:  # the topic's record in etcd (a shard may not hold it in its log yet)
                shards = self._routes.queues(topic)
                if shards is None:
                    self._learn_routes([topic])
                    shards = self._routes.queues(topic)
                if shards is not None:
                    self._queues[topic] = len(shards)
                    return len(shards)
            topics = self.list_topics(include_system=True)
            if topic not in topics:
                raise error_for(grpc.StatusCode.NOT_FOUND, f"unknown topic {shown(topic)}")
            self._queues[topic] = topics[topic]["queues"]
        return self._queues[topic]
