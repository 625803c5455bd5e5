"""The ``Broker`` service's groups RPCs: Heartbeat, ListGroups, DescribeGroup, ResetOffsets."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from broker.daemon.rpc.common import (
    Rpcs,
    handle,
    handle_async,
    log,
)
from broker.errors import BrokerError, shown
from broker.security.auth import current_caller
from proto import tidemark_pb2 as pb


class GroupRpcs(Rpcs):
    """Subscribe mode and the operator views of groups (DESIGN §12)."""

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        """Join, stay, or leave. A member with nothing to do parks (no thread) until its answer changes
        or ``max_wait_ms`` (at most the heartbeat interval, and a third of its session) passes."""
        return await handle_async(context, lambda: self._heartbeat(request))

    async def _heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        self.store.check_still_master()
        placement = self.store.placement
        if placement is not None and not placement.knows_group(request.group):  # its slot is given a shard (etcd)
            await asyncio.to_thread(self.groups.check_coordinator, request.group)
        group, topics, owned, session_ms = self.groups.check_heartbeat(request)
        membership = self.heartbeats.membership
        interval_ms = min(self.config["groups.heartbeat_interval_ms"], session_ms // 3)
        if request.leave:
            membership.leave(group, request.member_id)
            self.heartbeats.wake({(group, request.member_id)})  # its own parked heartbeat answers now
            log.info("member_left", group=group, member=request.member_id)
            return pb.HeartbeatResponse(member_id=request.member_id, heartbeat_interval_ms=interval_ms)
        answer = membership.heartbeat(group, request.member_id, topics, owned, session_timeout_ms=session_ms,
                                      client_id=request.client_id[:200], now=time.monotonic())
        if not request.member_id:
            log.info("member_joined", group=group, member=answer.member_id, client=request.client_id[:200])
        wait_s = min(request.max_wait_ms, interval_ms) / 1000.0
        if answer.settled and wait_s > 0:
            key = (group, answer.member_id)
            parked = self.heartbeats.park(key)
            try:
                if not membership.pending(group, answer.member_id, time.monotonic()):
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(parked), wait_s)
            finally:
                self.heartbeats.unpark(key, parked)
            self.store.check_still_master()
            later = membership.refresh(group, answer.member_id, time.monotonic())
            if later is None:  # forgotten meanwhile (a role change): rejoin with what it holds
                raise BrokerError("FAILED_PRECONDITION", f"member {shown(answer.member_id)} is no longer known to "
                                  "this node (a role change): heartbeat again to rejoin")
            answer = later
        return pb.HeartbeatResponse(member_id=answer.member_id, heartbeat_interval_ms=interval_ms,
                                    generation=answer.generation,
                                    assigned=[pb.QueueRef(topic=t, queue_id=q) for t, q in sorted(answer.assigned)])

    def ListGroups(self, request: pb.ListGroupsRequest, context: grpc.ServicerContext) -> pb.ListGroupsResponse:
        return handle(context, lambda: pb.ListGroupsResponse(groups=self.groups.list_groups()))

    def DescribeGroup(self, request: pb.DescribeGroupRequest, context: grpc.ServicerContext) -> pb.DescribeGroupResponse:
        if request.here_only:
            return handle(context, lambda: pb.DescribeGroupResponse(
                group=self.groups.describe_here(request.group, request.queues)))
        return handle(context, lambda: pb.DescribeGroupResponse(
            group=self.groups.describe(request.group, member_ids=current_caller().may("admin"))))

    def ResetOffsets(self, request: pb.ResetOffsetsRequest, context: grpc.ServicerContext) -> pb.ResetOffsetsResponse:
        def run() -> pb.ResetOffsetsResponse:
            offsets = self.groups.reset_offsets(request.group, request.topic, request.to, request.value,
                                                dict(request.queue_offsets))
            log.info("offsets_reset", group=request.group, topic=request.topic, to=pb.ResetTo.Name(request.to),
                     value=request.value)
            return pb.ResetOffsetsResponse(offsets=offsets)
        return handle(context, run)
