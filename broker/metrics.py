"""Prometheus metrics of one daemon process (served on ``--metrics-listen``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry()

SEND_MESSAGES = Counter("tidemark_send_messages", "Messages appended by send requests", registry=REGISTRY)
SEND_BYTES = Counter("tidemark_send_bytes", "Bytes appended by send requests", registry=REGISTRY)
SEND_REQUESTS = Counter("tidemark_send_requests", "Send requests by outcome", ["outcome"], registry=REGISTRY)
SEND_SECONDS = Histogram("tidemark_send_seconds", "Send requests answered OK: time from arrival to the answer, by ack "
                         "mode (leader, flush, replica)", ["ack"], registry=REGISTRY,
                         buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
PULL_MESSAGES = Counter("tidemark_pull_messages", "Messages returned by pull requests", registry=REGISTRY)
PULL_BYTES = Counter("tidemark_pull_bytes", "Bytes of log batches read by pull requests (answers carry only the records "
                     "asked for: docs/formats/commitlog.md, Cut batches)", registry=REGISTRY)
FSYNC_SECONDS = Histogram(
    "tidemark_fsync_seconds", "Commit-log fdatasync latency", registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.5, 2.0),
)
OFFSET = Gauge("tidemark_offset_bytes", "Commit-log offsets", ["kind"], registry=REGISTRY)
VIEW_LAG = Gauge("tidemark_view_lag_bytes", "Confirm offset minus the view's applied offset", ["view"], registry=REGISTRY)
RECOVERY_SECONDS = Gauge("tidemark_recovery_seconds", "Duration of the last start-up recovery", registry=REGISTRY)
SEGMENTS = Gauge("tidemark_segments", "Commit-log segment files", registry=REGISTRY)
QUARANTINE_BYTES = Gauge("tidemark_quarantine_bytes", "Bytes cut from the log and kept in DATA_DIR/quarantine (a torn "
                         "tail, a divergence): `tidemark log quarantine DATA_DIR` shows them; nothing deletes them",
                         registry=REGISTRY)
FREE_DISK = Gauge("tidemark_free_disk_bytes", "Free bytes on the data directory's filesystem", registry=REGISTRY)
REPLICA_LAG = Gauge("tidemark_replica_lag_bytes", "Master log end minus the replica's acked offset", ["node"],
                    registry=REGISTRY)
GROUP_LAG = Gauge(
    "tidemark_consumer_group_lag_messages", "Queue ends minus the group's committed offsets, summed over a topic's "
    "queues (beyond LABEL_VALUES_MAX series, the rest in group=topic=\"__other__\")", ["group", "topic"], registry=REGISTRY,
)
LABEL_VALUES_MAX = 100  # series per per-topic metric: topic names are users' data, and series cost memory

# -- node state for alerting (exported every 5 s from status(); docs/operations.md "Alerts") ------
IS_MASTER = Gauge("tidemark_is_master", "1 on a master that takes writes, 0 on a slave or a fenced master",
                  registry=REGISTRY)
EPOCH = Gauge("tidemark_epoch", "Current leader epoch", registry=REGISTRY)
FENCED = Gauge("tidemark_fenced", "1 when this node stopped taking writes because a higher epoch exists",
               registry=REGISTRY)
INSYNC_REPLICAS = Gauge("tidemark_insync_replicas", "Slaves in the master's in-sync set (master only)",
                        registry=REGISTRY)
FOLLOWER_CONNECTED = Gauge("tidemark_follower_connected", "1 while a slave streams from its master (slave only)",
                           registry=REGISTRY)
ROLE = Gauge("tidemark_role", "1 for this node's current role (master, slave), 0 for the other", ["role"],
             registry=REGISTRY)
COORDINATOR_CONNECTED = Gauge("tidemark_coordinator_connected", "1 while etcd answers this node (0 also without a "
                              "coordinator)", registry=REGISTRY)
COORDINATOR_CONFIGURED = Gauge("tidemark_coordinator_configured", "1 when coordinator.endpoints is set (automatic "
                               "failover through etcd)", registry=REGISTRY)
LEASE_REMAINING_MS = Gauge("tidemark_lease_remaining_ms", "How long this master may still acknowledge writes "
                           "without renewing its etcd lease (0 on a slave)", registry=REGISTRY)
FAILOVERS = Counter("tidemark_failovers", "Elections this node won through etcd (each starts a new epoch)",
                    registry=REGISTRY)
INSECURE_NETWORK = Gauge("tidemark_insecure_network", "1 when a non-loopback port serves without TLS or tokens "
                         "(security.insecure_network = true)", registry=REGISTRY)
REPLICATION_VIOLATIONS = Counter("tidemark_replication_violations", "Replica claims refused (acks beyond what "
                                 "was sent, epochs from unauthenticated peers)", registry=REGISTRY)
BACKGROUND_ERRORS = Counter("tidemark_background_errors", "Failures of background work, retried (status errors "
                            "has the last message)", ["component"], registry=REGISTRY)
OPEN_FILES = Gauge("tidemark_open_files", "Segment and queue-file descriptors open (limits.open_files_max)",
                   registry=REGISTRY)
GROUP_MEMBERS = Gauge("tidemark_group_members", "Subscribe-mode members known to this master, all groups",
                      registry=REGISTRY)
GROUP_REBALANCES = Counter("tidemark_group_rebalances", "Target assignments that moved a queue (joins, leaves, "
                           "expiries, topic changes)", registry=REGISTRY)
POP_REDELIVERIES = Counter("tidemark_pop_redeliveries", "Pop-mode messages delivered again (a lease expired or "
                           "was nacked)", registry=REGISTRY)
POP_DLQ = Counter("tidemark_pop_dlq", "Pop-mode messages moved to their group's DLQ topic after "
                  "groups.max_deliveries deliveries", registry=REGISTRY)
POP_DLQ_HELD = Counter("tidemark_pop_dlq_held", "Pops that found dead letters whose DLQ topic is missing and "
                       "could not create it (the caller lacks admin): those messages wait, undelivered",
                       registry=REGISTRY)
POP_RUNS = Counter("tidemark_pop_runs", "Passes of the pop service, each one write of __pop records at most, by kind "
                   "(pop, ack): calls of one group that arrive together share one", ["kind"], registry=REGISTRY)
POP_RUN_CALLS = Counter("tidemark_pop_run_calls", "Pop and ack calls served by those passes, by kind (calls / runs: "
                        "how many shared one); carried: pops carrying acks, which their pop pass ends",
                        ["kind"], registry=REGISTRY)
POP_IN_FLIGHT = Gauge("tidemark_pop_in_flight", "Pop-mode messages delivered and not yet acked, all groups",
                      registry=REGISTRY)
LONG_POLLS_REFUSED = Counter("tidemark_long_polls_refused", "Pulls and pops refused because limits.parked_waits_max "
                             "calls already waited", registry=REGISTRY)
LONG_POLLS = Gauge("tidemark_long_polls", "Pulls parked waiting for new messages (they hold no thread)",
                   registry=REGISTRY)
AUTH_REFUSED = Counter("tidemark_auth_refused", "Calls refused for a missing or wrong bearer token", ["code"],
                       registry=REGISTRY)
METRICS_CONNECTIONS_REFUSED = Counter(
    "tidemark_metrics_connections_refused", "Connections to the metrics port closed by its bounds, by reason: "
    "deadline (TLS handshake and request head not in within 5 s), evicted (the oldest idle one, for a new "
    "connection), full (every connection being answered a scrape), head_too_large, body", ["reason"],
    registry=REGISTRY)
TXN_OPEN = Gauge("tidemark_transactions_open", "Transactions open on this node (begun, not ended)", registry=REGISTRY)
TXN_OLDEST_OPEN_SECONDS = Gauge("tidemark_transaction_oldest_open_seconds", "Age of the oldest open transaction "
                                "since it began (0: none open)", registry=REGISTRY)
TXN_ENDED = Gauge("tidemark_transactions_ended", "Transactions ended since the log began, by outcome (committed, "
                  "aborted; timed_out: the aborted ones whose timeout ended them): the transactions view's counts, "
                  "the same on every replica", ["outcome"], registry=REGISTRY)
TXN_PREPARED = Gauge("tidemark_transactions_prepared", "Over shards: participant transactions here that prepared "
                     "and wait for their coordinator shard's decision", registry=REGISTRY)
TXN_UNDELIVERED = Gauge("tidemark_transaction_decisions_undelivered", "Over shards, on a coordinator: decisions not "
                        "yet delivered to every participant (retried until each answers)", registry=REGISTRY)
TXN_CHECKS = Counter("tidemark_transaction_checks", "Check-back questions this master sent to producers about "
                     "transactions past their timeout", registry=REGISTRY)
LSO_LAG = Gauge("tidemark_lso_lag_messages", "Queue ends minus their last stable offsets, summed over a topic's "
                "queues: messages read_committed readers cannot see yet because a transaction before them is open "
                "(beyond LABEL_VALUES_MAX topics, the rest in topic=\"__other__\")", ["topic"], registry=REGISTRY)
LSO_STALLED_SECONDS = Gauge("tidemark_lso_stalled_seconds", "The longest time a queue's last stable offset has "
                            "stood still while messages after it wait: the age (since its first write) of the open "
                            "transaction holding it, over the queues where others wrote after it (0: none)",
                            registry=REGISTRY)
SHARD_INFO = Gauge("tidemark_shard_info", "1, labelled with this node's shard (a cluster of shards, docs/shards.md); "
                   "join other series on instance to add a shard dimension", ["shard"], registry=REGISTRY)
CLUSTER_SHARD_QUEUES = Gauge("tidemark_cluster_shard_queues", "Queues each shard writes, as this node's copy of etcd "
                             "has it", ["shard"], registry=REGISTRY)
CLUSTER_SHARD_HAS_MASTER = Gauge("tidemark_cluster_shard_has_master", "1 while a shard has a master, 0 while a shard "
                                 "with queues has none, as this node's copy of etcd has it", ["shard"], registry=REGISTRY)
CLUSTER_MOVES_IN_FLIGHT = Gauge("tidemark_cluster_moves_in_flight", "Queue moves between shards under way in the "
                                "cluster (their segment being sealed), as this node's copy of etcd has it",
                                registry=REGISTRY)
CLUSTER_SHARD_DRAINING = Gauge("tidemark_cluster_shard_draining", "1 while a shard is being drained (tidemark cluster "
                               "drain)", ["shard"], registry=REGISTRY)
CLUSTER_REVISION = Gauge("tidemark_cluster_revision", "The etcd revision this node's copy of the cluster reflects",
                         registry=REGISTRY)
CONFIG_RELOADS = Counter("tidemark_config_reloads", "SIGHUP reloads by outcome (applied, refused)", ["outcome"],
                         registry=REGISTRY)


def export_status(st: Mapping[str, Any]) -> None:
    """Set the node-state gauges from one ``Store.status()`` dict."""
    master = st.get("role") == "master"
    FENCED.set(1 if st.get("fenced") else 0)
    IS_MASTER.set(1 if master and not st.get("fenced") else 0)
    EPOCH.set(int(st.get("epoch") or 0))
    ROLE.labels("master").set(1 if master else 0)
    ROLE.labels("slave").set(0 if master else 1)
    coordinator = st.get("coordinator") or {}
    COORDINATOR_CONFIGURED.set(1 if coordinator else 0)
    SHARD_INFO.labels(str(coordinator.get("shard") or "")).set(1)
    COORDINATOR_CONNECTED.set(1 if coordinator.get("connected") else 0)
    LEASE_REMAINING_MS.set(float(coordinator.get("lease_remaining_ms") or 0) if master else 0)
    INSYNC_REPLICAS.set(sum(1 for r in st.get("replicas") or [] if r.get("in_sync")) if master else 0)
    follower = st.get("replication") or {}
    FOLLOWER_CONNECTED.set(1 if not master and follower.get("connected") else 0)
    txns = st.get("transactions") or {}
    TXN_OPEN.set(int(txns.get("open") or 0))
    TXN_OLDEST_OPEN_SECONDS.set(float(txns.get("oldest_open_ms") or 0) / 1000.0)
    TXN_PREPARED.set(int(txns.get("prepared") or 0))
    TXN_UNDELIVERED.set(int(txns.get("undelivered") or 0))
    for outcome in ("committed", "aborted", "timed_out"):
        TXN_ENDED.labels(outcome).set(int(txns.get(outcome) or 0))


TIMER_PENDING = Gauge("tidemark_timer_pending", "Pending timer messages per target topic (beyond LABEL_VALUES_MAX "
                      "topics, the rest in topic=\"__other__\")", ["topic"], registry=REGISTRY)


OTHER = "__other__"  # the overflow series' label: "__" starts no user topic name


def set_bounded(gauge: Gauge, values: Mapping[tuple[str, ...], float], limit: int = LABEL_VALUES_MAX) -> None:
    """Bring ``gauge``'s series to ``values``: the ``limit`` largest label sets keep their own series,
    the rest are summed into one whose every label is ``OTHER`` (bounded label sets, DESIGN §10).
    Series are set before stale ones are removed, so a scrape never sees the gauge empty."""
    ranked = sorted(values.items(), key=lambda kv: -kv[1])
    wanted = dict(ranked[:limit])
    if len(ranked) > limit:
        wanted[tuple([OTHER] * len(ranked[0][0]))] = sum(v for _, v in ranked[limit:])
    for labels, value in wanted.items():
        gauge.labels(*labels).set(value)
    for sample in [s for metric in gauge.collect() for s in metric.samples]:
        labels = tuple(sample.labels[name] for name in gauge._labelnames)
        if labels not in wanted:
            gauge.remove(*labels)
TIMER_FIRED = Counter("tidemark_timer_fired", "Timer messages delivered to their topics", registry=REGISTRY)
TIMER_LATENESS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 30.0)
TIMER_LATENESS = Histogram(
    "tidemark_timer_fire_lateness_seconds", "Append time of a timer delivery minus its deliver_at_ms", registry=REGISTRY,
    buckets=TIMER_LATENESS_BOUNDS,
)
TIMER_SNAPSHOT_SECONDS = Gauge("tidemark_timer_snapshot_seconds", "Duration of the last wheel snapshot", registry=REGISTRY)


def observe_many(hist: Histogram, values: Sequence[float] | np.ndarray, bounds: Sequence[float]) -> None:
    """``hist.observe(v)`` for every value, counted per bucket with numpy (firing rounds observe
    thousands at once). ``bounds`` are the histogram's own bucket bounds, ``+Inf`` excluded."""
    arr = np.asarray(values, dtype=np.float64)
    if not len(arr):
        return
    buckets = getattr(hist, "_buckets", None)
    total = getattr(hist, "_sum", None)
    if buckets is None or total is None or len(buckets) != len(bounds) + 1:
        for v in arr.tolist():  # a prometheus_client without these internals: one call each
            hist.observe(v)
        return
    counts = np.bincount(np.searchsorted(np.asarray(bounds), arr, side="left"), minlength=len(bounds) + 1)
    for bucket, n in zip(buckets, counts.tolist(), strict=True):
        if n:
            bucket.inc(n)
    total.inc(float(arr.sum()))
