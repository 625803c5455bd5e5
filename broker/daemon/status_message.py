"""``status()`` as the typed ``NodeStatus`` message (DESIGN §8, §13): what a client in any
language reads without parsing JSON. The JSON form stays in ``StatusResponse.json`` for the CLI
(it also holds the security summary, the epoch history and the timer wheel's details)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proto import tidemark_pb2 as pb

ROLES = {"master": pb.ROLE_MASTER, "slave": pb.ROLE_SLAVE}


def to_message(st: Mapping[str, Any]) -> pb.NodeStatus:
    msg = pb.NodeStatus(
        role=ROLES.get(str(st.get("role")), pb.ROLE_UNSPECIFIED),
        epoch=_u(st.get("epoch")),
        node_id=str(st.get("node_id") or ""),
        cluster_id=str(st.get("cluster_id") or ""),
        master=str(st.get("master") or ""),
        min_offset=_u(st.get("min_offset")),
        max_offset=_u(st.get("max_offset")),
        flushed_offset=_u(st.get("flushed_offset")),
        confirm_offset=_u(st.get("confirm_offset")),
        applied_offset=_u(st.get("applied_offset")),
        tiered_uploaded_offset=_u(st.get("tiered_uploaded_offset")),
        timer_pending=_u(st.get("timer_pending")),
        timer_pending_by_topic={str(k): _u(v) for k, v in (st.get("timer_pending_by_topic") or {}).items()},
        segments=_u(st.get("segments")),
        log_bytes=_u(st.get("log_bytes")),
        free_disk_bytes=_u(st.get("free_disk_bytes")),
        fenced=str(st.get("fenced") or ""),
        views={str(k): _u(v) for k, v in (st.get("views") or {}).items()},
        retention_floor=_u(st.get("retention_floor")),
        long_polls=_u(st.get("long_polls")),
        open_files=_u((st.get("open_files") or {}).get("open")),
        open_files_max=_u((st.get("open_files") or {}).get("max")),
    )
    for r in st.get("replicas") or ():
        msg.replicas.add(node_id=str(r.get("node_id") or ""), address=str(r.get("address") or ""),
                         acked_offset=_u(r.get("acked_offset")), in_sync=bool(r.get("in_sync")),
                         connected=bool(r.get("connected")), lag_bytes=_u(r.get("lag_bytes")),
                         coordinator_unreachable_ms=_u(r.get("coordinator_unreachable_ms")),
                         heard_ms_ago=_u(r.get("heard_ms_ago")))
    follower = st.get("replication")
    if follower:
        msg.replication.CopyFrom(pb.FollowerStatus(
            master=str(follower.get("master") or ""), connected=bool(follower.get("connected")),
            master_confirm_offset=_u(follower.get("master_confirm_offset")),
            master_end_offset=_u(follower.get("master_end")), lag_bytes=_u(follower.get("lag_bytes")),
            in_sync=bool(follower.get("in_sync")), error=str(follower.get("error") or "")))
    tiered = st.get("tiered")
    if tiered:
        msg.tiered.CopyFrom(pb.TieredStatus(
            backend=str(tiered.get("backend") or ""), uploaded_offset=_u(st.get("tiered_uploaded_offset")),
            recorded_offset=_u(tiered.get("recorded_offset")), uploading=bool(tiered.get("uploading")),
            objects=_u(tiered.get("objects")), readable_min_offset=_u(tiered.get("readable_min_offset")),
            read_cache_bytes=_u(tiered.get("read_cache_bytes")), error=str(tiered.get("error") or "")))
    coordinator = st.get("coordinator")
    if coordinator:
        c = pb.CoordinatorStatus(
            connected=bool(coordinator.get("connected")), node_id=str(coordinator.get("node_id") or ""),
            leader=str(coordinator.get("leader") or ""), leader_client=str(coordinator.get("leader_client") or ""),
            epoch=_u(coordinator.get("epoch")), insync=[str(m) for m in coordinator.get("insync") or ()],
            failsafe=bool(coordinator.get("failsafe")), error=str(coordinator.get("error") or ""))
        if coordinator.get("lease_remaining_ms") is not None:
            c.lease_remaining_ms = _u(coordinator["lease_remaining_ms"])
        msg.coordinator.CopyFrom(c)
    recovery = st.get("recovery")
    if recovery:
        msg.recovery.CopyFrom(pb.RecoveryStatus(
            clean=bool(recovery.get("clean")), new=bool(recovery.get("new")),
            scanned_bytes=_u(recovery.get("scanned_bytes")), truncated_bytes=_u(recovery.get("truncated_bytes")),
            replayed_bytes=_u(recovery.get("replayed_bytes")),
            replay_seconds=float(recovery.get("replay_seconds") or 0.0), seconds=float(recovery.get("seconds") or 0.0)))
    txns = st.get("transactions")
    if txns:
        msg.transactions.CopyFrom(pb.TransactionsStatus(**{k: _u(txns.get(k)) for k in (
            "open", "oldest_open_ms", "committed", "aborted", "timed_out", "aborted_ranges", "prepared",
            "undelivered")}))
    for name, e in sorted((st.get("errors") or {}).items()):
        msg.errors.add(component=str(name), count=_u(e.get("count")), error=str(e.get("error") or ""),
                       last_ms=int(e.get("last_ms") or 0), active=bool(e.get("active")))
    return msg


def _u(value: Any) -> int:
    """A non-negative integer field (absent or negative: 0)."""
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0
