"""The ``Broker`` service's topics RPCs: CreateTopic(s), DeleteTopic, ListTopics, DescribeTopic, CancelTimer,
Status, Promote, Demote, GetRoutes, MoveQueue."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import crc32c
import grpc

from broker.daemon import status_message
from broker.daemon.rpc.common import (
    Rpcs,
    check_system_read,
    handle,
    handle_async,
    log,
)
from broker.errors import BrokerError, invalid, shown
from broker.logformat import batch as bf
from broker.logformat import system_records
from broker.logformat.timer_props import forwarded_timer_producer
from broker.ports import IncomingBatch, Placement, RoleController, SegmentRoute
from proto import tidemark_pb2 as pb

ROUTES_TOPICS_MAX = system_records.CREATE_TOPICS_MAX
MOVE_TIMEOUT_MS = 30_000  # a MoveQueue call's wait for the move to finish, by default
MOVE_TIMEOUT_MS_MAX = 600_000
SLOT_MOVE_TIMEOUT_MS = 120_000  # a MoveSlot call's wait, by default (it waits for the slot's open transactions)
REBALANCE_TIMEOUT_MS = 600_000  # a Rebalance call's moves, in all (and at most)
FORWARD_TIMERS_MAX = 10_000  # timers per ForwardTimers call (the firing round's batch is at most timer.fire_batch_max)


def segment_route(s: SegmentRoute) -> pb.SegmentRoute:
    return pb.SegmentRoute(shard=s.shard, logical_start=s.logical_start, end=s.end or 0, state=s.state)


class TopicRpcs(Rpcs):
    """Topics, timers' cancels, status and role changes."""

    def _topic_info(self, name: str, queues: int) -> pb.TopicInfo:
        highs, stable = [], []
        for q in range(queues):
            qf = self.store.views.queues.queue(name, q)
            high = qf.next_queue_offset if qf else 0
            highs.append(high)
            stable.append(self.store.reads.stable_end(name, q, high, True))
        return pb.TopicInfo(name=name, queues=queues, queue_max_offsets=highs, queue_stable_offsets=stable)

    @staticmethod
    def _new_topic(request: pb.CreateTopicRequest) -> tuple[str, dict[str, Any]]:
        """The ``topic.create`` change a request asks for (INVALID_ARGUMENT for a bad name or count)."""
        err = system_records.topic_name_error(request.name)
        if err:
            raise invalid(err)
        queues = request.queues or 1
        if not 1 <= queues <= system_records.QUEUES_MAX:
            raise invalid(f"queues must be 1..{system_records.QUEUES_MAX}, got {queues}")
        return system_records.TOPIC_CREATE, {"topic": request.name, "queues": queues}

    # Topic creates and deletes run on the event loop: the append is one short write under the
    # appender's lock, and the waits for its acknowledgement and its application park a future,
    # not a thread (one thread hand-off fewer per call: issue 13's creates per second)
    async def CreateTopic(self, request: pb.CreateTopicRequest, context: grpc.aio.ServicerContext) -> pb.CreateTopicResponse:
        async def run() -> pb.CreateTopicResponse:
            change = self._new_topic(request)
            # the appender checks "already exists" against its own topic set, under its lock: concurrent
            # creates are safe and share one group commit
            await self._create([change])
            return pb.CreateTopicResponse(topic=self._topic_info(request.name, change[1]["queues"]))
        return await handle_async(context, run)

    async def CreateTopics(self, request: pb.CreateTopicsRequest, context: grpc.aio.ServicerContext) -> pb.CreateTopicsResponse:
        """Many topics, all or none: one metadata batch, one wait for its ack and its application."""
        async def run() -> pb.CreateTopicsResponse:
            if not 1 <= len(request.topics) <= system_records.CREATE_TOPICS_MAX:
                raise invalid(f"a CreateTopics call takes 1..{system_records.CREATE_TOPICS_MAX} topics, "
                              f"got {len(request.topics)}")
            changes = [self._new_topic(t) for t in request.topics]
            if len({t.name for t in request.topics}) != len(changes):
                raise invalid("a topic name appears more than once in the request")
            await self._create(changes)
            return pb.CreateTopicsResponse(topics=[self._topic_info(f["topic"], f["queues"]) for _, f in changes])
        return await handle_async(context, run)

    async def DeleteTopic(self, request: pb.DeleteTopicRequest, context: grpc.aio.ServicerContext) -> pb.DeleteTopicResponse:
        async def run() -> pb.DeleteTopicResponse:
            if request.name.startswith(system_records.SYSTEM_PREFIX):
                raise invalid(f"system topic {shown(request.name)} cannot be deleted")
            if self.store.placement is not None:  # a tombstone in etcd; each shard's master deletes it from its log
                await asyncio.to_thread(self.store.placement.delete, request.name)
                return pb.DeleteTopicResponse()
            await self._write_metadata([(system_records.TOPIC_DELETE, {"topic": request.name})])
            return pb.DeleteTopicResponse()
        return await handle_async(context, run)

    async def _create(self, changes: list[tuple[str, dict[str, Any]]]) -> None:
        """New topics: in this log, or in a cluster of shards placed through etcd (each shard's
        master then creates them in its own log, ``replication/shards.py``)."""
        placement = self.store.placement
        if placement is None:
            await self._write_metadata(changes)
            return
        self._check_queues_total(changes)
        await asyncio.to_thread(placement.place, [(str(f["topic"]), int(f["queues"])) for _, f in changes])

    async def _write_metadata(self, changes: list[tuple[str, dict[str, Any]]]) -> None:
        """Append ``changes`` as one batch; return once it is acknowledged (ack=replica) and applied."""
        self._check_queues_total(changes)
        await self.store.writes.write_system_async(changes, applied=self.store.views.metadata)

    def _check_queues_total(self, changes: list[tuple[str, dict[str, Any]]]) -> None:
        """The queues of all topics stay within ``limits.queues_max`` (each costs memory and a file;
        1,000 topics of 1,024 queues per call took 820 MB). Counted against what the metadata view
        applied: creates in flight at the same moment may pass it by as many queues as they add."""
        adding = sum(int(f["queues"]) for c, f in changes if c == system_records.TOPIC_CREATE)
        if not adding:
            return
        total, top = self.store.views.metadata.queues_total, self.config["limits.queues_max"]
        if total + adding > top:
            raise BrokerError("RESOURCE_EXHAUSTED", f"this node holds {total} queues; {adding} more would pass "
                              f"limits.queues_max ({top})")

    def ListTopics(self, request: pb.ListTopicsRequest, context: grpc.ServicerContext) -> pb.ListTopicsResponse:
        def run() -> pb.ListTopicsResponse:
            listed = sorted(self.store.views.metadata.list_topics().items())
            # the stable offsets (what the Spark source plans from) include every commit answered before
            self.store.decisions.settle((n, q) for n, t in listed for q in range(int(t["queues"])))
            topics = [self._topic_info(n, t["queues"]) for n, t in listed]
            if request.include_system:
                topics += [self._topic_info(n, 1) for n in system_records.SYSTEM_TOPICS]
            return pb.ListTopicsResponse(topics=topics)
        return handle(context, run)

    def DescribeTopic(self, request: pb.DescribeTopicRequest, context: grpc.ServicerContext) -> pb.DescribeTopicResponse:
        def run() -> pb.DescribeTopicResponse:
            check_system_read(request.name)
            return self.groups.describe_topic(request.name)
        return handle(context, run)

    def GetRoutes(self, request: pb.GetRoutesRequest, context: grpc.ServicerContext) -> pb.GetRoutesResponse:
        """Routes from this node's watched copy of etcd (docs/shards.md); a node outside a cluster of
        shards answers an empty ``shard`` (everything is on its pair)."""
        def run() -> pb.GetRoutesResponse:
            if len(request.topics) > ROUTES_TOPICS_MAX:
                raise invalid(f"a GetRoutes call takes at most {ROUTES_TOPICS_MAX} topics, got {len(request.topics)}")
            placement = self.store.placement
            if placement is None:
                return pb.GetRoutesResponse()
            routes = placement.routes(list(request.topics))
            return pb.GetRoutesResponse(
                shard=placement.shard, revision=routes.revision,
                topics=[pb.TopicRoute(topic=t, queue_shards=shards,
                                      moved=[pb.QueueSegments(queue=q, segments=[segment_route(s) for s in segs])
                                             for q, segs in routes.moved.get(t, {}).items()])
                        for t, shards in routes.topics.items()],
                shards=[pb.ShardRoute(shard=s.shard, master=s.master, nodes=s.nodes, epoch=s.epoch, queues=s.queues,
                                      draining=s.draining, slots=s.slots, read_only_segments=s.read_only)
                        for s in routes.shards],
                moves=[pb.MoveInFlight(topic=t, queue_id=q, from_shard=a, to_shard=b) for t, q, a, b in routes.moves])
        return handle(context, run)

    async def MoveQueue(self, request: pb.MoveQueueRequest, context: grpc.aio.ServicerContext) -> pb.MoveQueueResponse:
        """Move a queue to another shard (docs/shards.md, "Moving a queue"): asked of any node."""
        async def run() -> pb.MoveQueueResponse:
            placement = self.store.placement
            if placement is None:
                raise BrokerError("FAILED_PRECONDITION", "this node is not in a cluster of shards: there is nowhere to "
                                  "move a queue to (coordinator.shard)")
            if not request.to_shard:
                raise invalid("name the shard to move the queue to (to_shard)")
            timeout_s = min(request.timeout_ms or MOVE_TIMEOUT_MS, MOVE_TIMEOUT_MS_MAX) / 1000.0
            segments = await asyncio.to_thread(placement.move, request.topic, request.queue_id, request.to_shard,
                                               timeout_s)
            return pb.MoveQueueResponse(segments=[segment_route(s) for s in segments])
        return await handle_async(context, run)

    async def MoveSlot(self, request: pb.MoveSlotRequest, context: grpc.aio.ServicerContext) -> pb.MoveSlotResponse:
        """Move a group slot to another shard (docs/shards.md, "Moving a group slot"): asked of any node."""
        async def run() -> pb.MoveSlotResponse:
            placement = self._sharded()
            if not request.to_shard:
                raise invalid("name the shard to move the slot to (to_shard)")
            timeout_s = min(request.timeout_ms or SLOT_MOVE_TIMEOUT_MS, MOVE_TIMEOUT_MS_MAX) / 1000.0
            shard = await asyncio.to_thread(placement.move_slot, request.slot, request.to_shard, timeout_s)
            return pb.MoveSlotResponse(shard=shard)
        return await handle_async(context, run)

    def ImportOffsets(self, request: pb.ImportOffsetsRequest, context: grpc.ServicerContext) -> pb.ImportOffsetsResponse:
        """A moving group slot's committed offsets, from the shard it leaves (node to node)."""
        def run() -> pb.ImportOffsetsResponse:
            placement = self._sharded()
            offsets = [(o.group, o.topic, o.queue_id, o.offset) for o in request.offsets]
            return pb.ImportOffsetsResponse(stored=placement.import_offsets(request.slot, request.source_shard, offsets))
        return handle(context, run)

    async def Rebalance(self, request: pb.RebalanceRequest, context: grpc.aio.ServicerContext) -> pb.RebalanceResponse:
        """Even out the shards' queues, or drain one (docs/shards.md "Rebalance and drain")."""
        async def run() -> pb.RebalanceResponse:
            placement = self._sharded()
            timeout_s = min(request.timeout_ms or REBALANCE_TIMEOUT_MS, REBALANCE_TIMEOUT_MS) / 1000.0
            done = await asyncio.to_thread(placement.rebalance, request.drain_shard, request.undrain_shard,
                                           request.dry_run, timeout_s)
            return pb.RebalanceResponse(moves=[pb.RebalanceMove(
                topic=m.topic, queue_id=m.queue, from_shard=m.source, to_shard=m.target,
                duration_ms=int(m.seconds * 1000), error=m.error) for m in done])
        return await handle_async(context, run)

    def _sharded(self) -> Placement:
        if self.store.placement is None:
            raise BrokerError("FAILED_PRECONDITION", "this node is not in a cluster of shards: there is nowhere to "
                              "move a queue or a group slot to (coordinator.shard)")
        return self.store.placement

    def Promote(self, request: pb.PromoteRequest, context: grpc.ServicerContext) -> pb.PromoteResponse:
        return handle(context, lambda: pb.PromoteResponse(epoch=self._roles().promote(request.unclean)))

    def Demote(self, request: pb.DemoteRequest, context: grpc.ServicerContext) -> pb.DemoteResponse:
        def run() -> pb.DemoteResponse:
            self._roles().demote(request.master)
            return pb.DemoteResponse()
        return handle(context, run)

    def _roles(self) -> RoleController:
        if self.store.role_controller is None:
            raise BrokerError("UNIMPLEMENTED", "replication is not available in this daemon")
        return self.store.role_controller

    def CancelTimer(self, request: pb.CancelTimerRequest, context: grpc.ServicerContext) -> pb.CancelTimerResponse:
        def run() -> pb.CancelTimerResponse:
            target = (request.topic, request.queue_id) if request.topic else None
            placement = self.store.placement
            if placement is not None:  # a timer offset is an offset of one shard's log: which queue, then
                if target is None:
                    raise BrokerError("INVALID_ARGUMENT", "in a cluster of shards a timer is cancelled with the topic "
                                      "and queue of its message (its receipt): a timer offset is one shard's")
                if placement.segment_here(*target) is None:  # timers of a queue stay where they were scheduled
                    placement.check_queue(*target)
            at, topic, queue = self.store.timers.cancel(request.timer_offset, target)
            log.info("timer_cancelled", timer_offset=request.timer_offset, topic=topic, queue=queue, deliver_at_ms=at)
            return pb.CancelTimerResponse(deliver_at_ms=at, topic=topic, queue_id=queue)
        return handle(context, run)

    def ForwardTimers(self, request: pb.ForwardTimersRequest, context: grpc.ServicerContext) -> pb.ForwardTimersResponse:
        """Due timers of a queue that moved, from the shard holding them (docs/shards.md "Moving a
        queue"): stored in the queue as that shard would have delivered them, each once (its own
        producer id, from the source shard and its offset, sequence 0: a retry is a duplicate)."""
        def run() -> pb.ForwardTimersResponse:
            placement = self._sharded()
            if len(request.timers) > FORWARD_TIMERS_MAX:
                raise invalid(f"a ForwardTimers call takes at most {FORWARD_TIMERS_MAX} timers, got {len(request.timers)}")
            placement.check_queue(request.topic, request.queue_id)
            batches = []
            for t in request.timers:
                records, _ = bf.encode_records([(t.body, t.key, t.props)])
                batches.append(IncomingBatch(request.topic, request.queue_id, records, 1, crc32c.crc32c(records),
                                             producer_id=forwarded_timer_producer(request.source_shard, t.timer_offset),
                                             base_sequence=0, flags=bf.FLAG_FORWARDED))
            if not batches:
                return pb.ForwardTimersResponse()
            receipts = self.store.writes.write(batches, "replica", internal=True, what="forwarded timers")
            return pb.ForwardTimersResponse(stored=sum(1 for r in receipts if not r.duplicate))
        return handle(context, run)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        def run() -> pb.StatusResponse:
            st = self.store.status()
            return pb.StatusResponse(json=json.dumps(st), status=status_message.to_message(st))
        return handle(context, run)
