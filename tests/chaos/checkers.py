"""The chaos run's checkers: offline, on the history (tests/chaos/history.py) and the final state
(tests/chaos/run.py's ``final.json``). Each returns a ``Verdict``: a name, pass or fail, its counts
and a few examples of what broke. ``check_all`` runs them; ``summary_table`` prints a run.

The rules, and why they hold:
- ``lost``: a send answered ok is stored (ack=replica: durable on the in-sync replicas).
- ``duplicates``: no id is stored twice, whatever the outcome (the client is idempotent: a retry
  carries the same producer id and sequence numbers).
- ``key_order``: one producer owns a key and sends its messages in order; they stay in that order.
- ``timers``: a timer message answered ok fires exactly once, never before it is due on the clock
  of the node that fired it (its store time), nor before it is due on the harness's clock, less
  a forward clock jump the nemesis applied.
- ``offsets_monotonic``: a member taking a queue starts at or above every offset committed ok for
  it before (committed offsets are durable).
- ``pop_acked_not_redelivered``: a message acked ok is never popped again.
- ``pops_complete``: every message a pop group's topic holds at the end (read_committed: never an
  aborted transaction's) was leased to the group by a pop answered ok at least once, and nothing
  else was (leases stay with each segment's shard as queues move away and back; a lease that
  expires comes back until it is acked; the run waits for the groups to catch up).
- ``split_brain``: never two writable masters (role master, not fenced, a write permit left) in
  one epoch, nor two seen at once.
- ``tiered_bound``: the tiered uploaded offset never passes the confirm offset.
- ``convergence``: after every heal (once the slave is back in sync) and at the end, both logs are
  byte-identical below the common confirm offset; at the end both nodes report the same metadata.
- ``transactions``: all or nothing. A transaction committed ok is stored whole; one aborted (never
  committed, or its commit answered aborted) is never stored nor seen by the read_committed
  reader; one whose commit's answer was lost is stored whole or not at all; none is left open.
- ``clients``: every workload client process ran until it was told to stop (exit 0).
- ``rto`` (each fault: from the fault, or its heal when nothing can route around it, to the first
  ok send invoked after it) and ``latency`` (send to first receipt by a member) are measurements;
  ``rto`` fails above a p99 bound.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

Op = dict[str, Any]
Final = dict[str, Any]
EXAMPLES_MAX = 10
LATENCY_BUCKETS_MS = (1, 5, 10, 100, 1000, 3000)
SAME_MOMENT_MS = 100  # two status samples this close (midpoints) are "at once"
SAMPLE_SHORT_MS = 200  # only samples that answered this fast are precise enough for "at once"
TIMER_SLACK_MS = 5


@dataclass
class Verdict:
    name: str
    ok: bool
    counts: dict[str, float] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def example(self, text: str) -> None:
        if len(self.examples) < EXAMPLES_MAX:
            self.examples.append(text)


def _ops(ops: Iterable[Op], kind: str, outcome: str | None = None) -> Iterable[Op]:
    return (o for o in ops if o["op"] == kind and (outcome is None or o["outcome"] == outcome))


def _stored(final: Final) -> Counter[str]:
    return Counter(row[3] for row in final["messages"])


def _sent(ops: list[Op]) -> dict[str, tuple[Op, dict[str, Any]]]:
    """Every message id sent -> (its send op, its entry in the op's value)."""
    return {m["id"]: (o, m) for o in _ops(ops, "send") for m in o["value"]["msgs"]}


# -- data ------------------------------------------------------------------------------------------
def lost(ops: list[Op], final: Final) -> Verdict:
    stored = _stored(final)
    v = Verdict("lost", True, {"acked": 0, "lost": 0, "unknown_stored": 0, "unknown_missing": 0})
    for mid, (op, _) in _sent(ops).items():
        if op["outcome"] == "ok":
            v.counts["acked"] += 1
            if mid not in stored:
                v.counts["lost"] += 1
                v.example(f"{mid} acked at {op['complete_ms']:.0f} is not stored")
        elif op["outcome"] == "unknown":
            v.counts["unknown_stored" if mid in stored else "unknown_missing"] += 1
    v.ok = v.counts["lost"] == 0
    return v


def duplicates(ops: list[Op], final: Final) -> Verdict:
    sent = _sent(ops)
    v = Verdict("duplicates", True, {"stored": 0, "duplicated_ok": 0, "duplicated_unknown": 0})
    for mid, n in _stored(final).items():
        v.counts["stored"] += n
        if n > 1:
            outcome = sent[mid][0]["outcome"] if mid in sent else "unknown"
            v.counts["duplicated_ok" if outcome == "ok" else "duplicated_unknown"] += 1
            v.example(f"{mid} stored {n} times (send {outcome})")
    v.ok = v.counts["duplicated_ok"] == 0 and v.counts["duplicated_unknown"] == 0
    return v


def key_order(ops: list[Op], final: Final) -> Verdict:
    keyed = {mid: (m["key"], m["kseq"]) for mid, (_, m) in _sent(ops).items() if m["key"] is not None}
    last: dict[str, tuple[int, str]] = {}
    v = Verdict("key_order", True, {"keys": 0, "checked": 0, "out_of_order": 0})
    for row in final["messages"]:
        mid = row[3]
        if mid not in keyed:
            continue
        key, seq = keyed[mid]
        v.counts["checked"] += 1
        before = last.get(key)
        if before is not None and seq <= before[0]:
            v.counts["out_of_order"] += 1
            v.example(f"key {key}: {mid} (#{seq}) stored after {before[1]} (#{before[0]})")
        last[key] = (seq, mid)
    v.counts["keys"] = len(last)
    v.ok = v.counts["out_of_order"] == 0
    return v


def timers(ops: list[Op], final: Final) -> Verdict:
    stored: dict[str, list[list[Any]]] = defaultdict(list)
    for row in final["messages"]:
        stored[row[3]].append(row)
    first_recv = _first_receipts(ops)
    skews = final.get("clock_skews") or []
    v = Verdict("timers", True, {"timers_acked": 0, "fired_once": 0, "never_fired": 0, "fired_twice": 0,
                                 "early_node_clock": 0, "early_harness_clock": 0})
    for mid, (op, m) in _sent(ops).items():
        due = m["deliver_at_ms"]
        if not due:
            continue
        rows = stored.get(mid, [])
        if len(rows) > 1:
            v.counts["fired_twice"] += 1
            v.example(f"timer {mid} stored {len(rows)} times")
        if op["outcome"] != "ok":
            continue
        v.counts["timers_acked"] += 1
        if not rows:
            v.counts["never_fired"] += 1
            v.example(f"timer {mid} due {due} acked, never fired")
            continue
        if len(rows) == 1:
            v.counts["fired_once"] += 1
        if rows[0][4] < due:
            v.counts["early_node_clock"] += 1
            v.example(f"timer {mid} stored at {rows[0][4]} on the node's clock, due {due}")
        seen = first_recv.get(mid)
        if seen is not None and seen < due - _forward_skew(skews, seen) - TIMER_SLACK_MS:
            v.counts["early_harness_clock"] += 1
            v.example(f"timer {mid} received at {seen:.0f} (harness), due {due}")
    c = v.counts
    v.ok = c["never_fired"] == 0 and c["fired_twice"] == 0 and c["early_node_clock"] == 0 \
        and c["early_harness_clock"] == 0
    return v


def _forward_skew(skews: list[dict[str, Any]], at_ms: float) -> float:
    """The largest forward clock jump active on any node around ``at_ms`` (a timer fired under it
    may reach a member that much early, in harness time)."""
    top = 0.0
    for w in skews:
        end = w["end_ms"] if w["end_ms"] is not None else math.inf
        if w["offset_ms"] > 0 and w["start_ms"] <= at_ms <= end + w["offset_ms"]:
            top = max(top, float(w["offset_ms"]))
    return top


def _first_receipts(ops: list[Op]) -> dict[str, float]:
    first: dict[str, float] = {}
    for o in _ops(ops, "recv"):
        for row in o["value"]["msgs"]:
            first.setdefault(row[1], o["complete_ms"])
    return first


# -- groups ----------------------------------------------------------------------------------------
def offsets_monotonic(ops: list[Op], final: Final) -> Verdict:
    """Ops come sorted by invoke time; a commit counts from its completion."""
    v = Verdict("offsets_monotonic", True, {"assigns": 0, "commits_ok": 0, "moved_back": 0})
    commits: dict[tuple[str, str, int], list[tuple[float, int]]] = defaultdict(list)
    for o in _ops(ops, "commit", "ok"):
        x = o["value"]
        commits[(x["group"], x["topic"], x["queue_id"])].append((o["complete_ms"], x["offset"]))
        v.counts["commits_ok"] += 1
    for series in commits.values():
        series.sort()
    for o in _ops(ops, "assign"):
        x = o["value"]
        v.counts["assigns"] += 1
        before = [off for t, off in commits.get((x["group"], x["topic"], x["queue_id"]), []) if t <= o["invoke_ms"]]
        if before and x["offset"] < max(before):
            v.counts["moved_back"] += 1
            v.example(f"{x['group']} {x['topic']}/{x['queue_id']}: {o['client']} started at {x['offset']}, "
                      f"{max(before)} was committed before")
    v.ok = v.counts["moved_back"] == 0
    return v


def pop_acked_not_redelivered(ops: list[Op], final: Final) -> Verdict:
    v = Verdict("pop_acked_not_redelivered", True, {"popped": 0, "acked": 0, "redelivered_allowed": 0,
                                                     "redelivered_after_ack": 0})
    acked_at: dict[tuple[str, int, int], float] = {}
    events: list[tuple[float, int, Op]] = [(o["complete_ms"], 1, o) for o in _ops(ops, "ack", "ok")]
    events += [(o["invoke_ms"], 0, o) for o in _ops(ops, "pop", "ok")]
    events.sort(key=lambda e: (e[0], e[1]))
    for _, kind, o in events:
        group = o["value"]["group"]
        if kind == 1:
            refused = {(q, off) for q, off in o.get("result", {}).get("refused", [])}
            for q, off, _mid in o["value"]["msgs"]:
                if (q, off) not in refused:
                    acked_at.setdefault((group, q, off), o["complete_ms"])
                    v.counts["acked"] += 1
            continue
        for q, off, mid, count in o.get("result", {}).get("msgs", []):
            v.counts["popped"] += 1
            if (group, q, off) in acked_at:
                v.counts["redelivered_after_ack"] += 1
                v.example(f"{group} {q}/{off} ({mid}) popped at {o['invoke_ms']:.0f} (delivery {count}), "
                          f"acked at {acked_at[(group, q, off)]:.0f}")
            elif count > 1:
                v.counts["redelivered_allowed"] += 1
    v.ok = v.counts["redelivered_after_ack"] == 0
    return v


def pops_complete(ops: list[Op], final: Final) -> Verdict:
    v = Verdict("pops_complete", True, {"groups": 0, "stored": 0, "popped": 0, "never_popped": 0,
                                        "popped_not_stored": 0})
    held = {"messages": {(int(m[1]), int(m[2])) for m in final.get("messages", [])},
            "txn_messages": {(int(m[0]), int(m[1])) for m in final.get("txn_messages", [])}}
    popped: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for o in _ops(ops, "pop", "ok"):
        popped[o["value"]["group"]].update((int(m[0]), int(m[1])) for m in o.get("result", {}).get("msgs", []))
    for group, of in sorted((final.get("pop_groups") or {}).items()):
        stored, got = held[of], popped[group]
        v.counts["groups"] += 1
        v.counts["stored"] += len(stored)
        v.counts["popped"] += len(got)
        for what, offsets in (("never_popped", stored - got), ("popped_not_stored", got - stored)):
            v.counts[what] += len(offsets)
            for q, off in sorted(offsets)[:3]:
                v.example(f"{group}: {q}/{off} {what.replace('_', ' ')}")
    v.ok = v.counts["never_popped"] == 0 and v.counts["popped_not_stored"] == 0
    return v


# -- the pair --------------------------------------------------------------------------------------
def split_brain(ops: list[Op], final: Final) -> Verdict:
    v = Verdict("split_brain", True, {"samples": 0, "epochs": 0, "epochs_with_two_masters": 0,
                                      "two_masters_at_once": 0})
    masters: dict[tuple[str, int], set[str]] = defaultdict(set)  # (shard, epoch): epochs count per shard
    recent: dict[str, tuple[float, int, str]] = {}  # node -> (midpoint, epoch, shard) of its last precise master sample
    for o in _ops(ops, "status", "ok"):
        r = o.get("result") or {}
        v.counts["samples"] += 1
        if r.get("role") != "master" or r.get("fenced") or r.get("permit_ms") == 0:  # it acknowledges nothing
            recent.pop(str(r.get("node_id")), None)
            continue
        node, epoch, shard = str(r.get("node_id")), int(r.get("epoch") or 0), str(r.get("shard") or "")
        masters[(shard, epoch)].add(node)
        if o["complete_ms"] - o["invoke_ms"] > SAMPLE_SHORT_MS:
            continue
        mid = (o["invoke_ms"] + o["complete_ms"]) / 2
        recent[node] = (mid, epoch, shard)
        for other, (other_mid, other_epoch, other_shard) in recent.items():
            if other != node and other_shard == shard and abs(mid - other_mid) <= SAME_MOMENT_MS:
                v.counts["two_masters_at_once"] += 1
                v.example(f"{node} (epoch {epoch}) and {other} (epoch {other_epoch}) both unfenced masters "
                          f"within {abs(mid - other_mid):.0f} ms at {mid:.0f}")
    v.counts["epochs"] = len(masters)
    for (shard, epoch), nodes in masters.items():
        if len(nodes) > 1:
            v.counts["epochs_with_two_masters"] += 1
            v.example(f"{'shard ' + shard + ' ' if shard else ''}epoch {epoch}: unfenced masters {sorted(nodes)}")
    v.ok = v.counts["epochs_with_two_masters"] == 0 and v.counts["two_masters_at_once"] == 0
    return v


def tiered_bound(ops: list[Op], final: Final) -> Verdict:
    v = Verdict("tiered_bound", True, {"samples": 0, "above_confirm": 0})
    for o in _ops(ops, "status", "ok"):
        r = o.get("result") or {}
        uploaded, confirm = int(r.get("tiered_uploaded_offset") or 0), int(r.get("confirm_offset") or 0)
        v.counts["samples"] += 1
        if uploaded > confirm:
            v.counts["above_confirm"] += 1
            v.example(f"{o['value']['node']} at {o['complete_ms']:.0f}: uploaded {uploaded} > confirm {confirm}")
    v.ok = v.counts["above_confirm"] == 0
    return v


def convergence(ops: list[Op], final: Final) -> Verdict:
    """Per pair (each shard's, with several): after every heal and at the end."""
    pairs = final.get("shards") or {"": final}
    v = Verdict("convergence", False, {"compare_below": sum(int(p.get("compare_below", 0)) for p in pairs.values()),
                                       "digests_equal": 0, "metadata_equal": 0})
    for shard, pair in pairs.items():
        nodes = pair.get("nodes") or {}
        if len(nodes) != 2:
            v.example(f"final state of {shard or 'the pair'} has {len(nodes)} node(s), not 2")
            return v
    checks = list(_ops(ops, "converge"))
    v.counts["heals_checked"] = sum(1 for o in checks if o["outcome"] == "ok")
    v.counts["heals_diverged"] = sum(1 for o in checks if o["outcome"] == "ok" and not o["result"]["equal"])
    v.counts["heals_not_in_sync"] = sum(1 for o in checks if o["outcome"] != "ok")
    for o in checks:
        if o["outcome"] != "ok" or not o["result"]["equal"]:
            v.example(f"after the heal at {o['invoke_ms']:.0f}: {o.get('error') or o.get('result')}")
    for shard, pair in pairs.items():
        a, b = pair["nodes"].values()
        v.counts["digests_equal"] += int(a.get("digest") == b.get("digest"))
        v.counts["metadata_equal"] += int(a.get("metadata") == b.get("metadata"))
        where = f"shard {shard}: " if shard else ""
        if a.get("digest") != b.get("digest"):
            v.example(f"{where}log digests differ below {pair.get('compare_below')}")
        if a.get("metadata") != b.get("metadata"):
            v.example(f"{where}metadata differs: {a.get('metadata')} vs {b.get('metadata')}"[:300])
    v.ok = v.counts["digests_equal"] == len(pairs) and v.counts["metadata_equal"] == len(pairs) \
        and v.counts["heals_diverged"] == 0 and v.counts["heals_not_in_sync"] == 0
    return v


# -- measurements ----------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float:
    """Nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100.0 * len(ordered)) - 1)]


# faults the pair is not built to route around: writes wait for the heal (a full disk refuses
# writes until space returns; with both nodes down nothing can take over)
HEAL_BOUND = frozenset({"disk_full", "power_loss_both"})


def rto_by_fault(ops: list[Op], queue_shards: list[str] | tuple[str, ...] = ()) -> dict[str, list[float]]:
    """Each fault's recovery time: from the moment it hit (its start; its heal for HEAL_BOUND kinds)
    to the completion of the first send invoked then or later that succeeded. Counted from the
    fault, not from a failed send: the client retries within its deadline, so most outages show
    as slow sends, not failed ones."""
    faults = _fault_windows(ops)
    all_sends = [o for o in _ops(ops, "send", "ok")]
    by_shard: dict[str, list[tuple[float, float]]] = {"": sorted((o["invoke_ms"], o["complete_ms"]) for o in all_sends)}
    for shard in set(queue_shards):  # over shards: a fault of one pair is recovered when a send to it succeeds
        mine = {q for q, s in enumerate(queue_shards) if s == shard}
        by_shard[shard] = sorted((o["invoke_ms"], o["complete_ms"]) for o in all_sends
                                 if any(r["queue_id"] in mine for r in (o.get("result") or {}).get("receipts", [])))
    out: dict[str, list[float]] = defaultdict(list)
    for kind, start, end, shard in faults:
        sends = by_shard.get(shard, by_shard[""])
        invokes = [s[0] for s in sends]
        t0 = end if kind in HEAL_BOUND and end is not None else start
        i = bisect.bisect_left(invokes, t0)
        done = min((c for _, c in sends[i : i + 1000]), default=math.inf)
        out[kind].append(done - t0)
    return out


def _fault_windows(ops: list[Op]) -> list[tuple[str, float, float | None, str]]:
    """(kind, start, end, shard: "" for a pair's or a shared part's) of every fault, in order."""
    open_: dict[tuple[str, str], int] = {}
    windows: list[tuple[str, float, float | None, str]] = []
    for o in _ops(ops, "fault"):
        v = o["value"]
        key = (v["kind"], v["node"])
        if v["phase"] == "start":
            open_[key] = len(windows)
            windows.append((v["kind"], o["invoke_ms"], None, str(v.get("shard") or "")))
        elif key in open_:
            i = open_.pop(key)
            windows[i] = (windows[i][0], windows[i][1], o["invoke_ms"], windows[i][3])
    return windows


def rto(ops: list[Op], final: Final, rto_p99_max_ms: float = 3000.0) -> Verdict:
    v = Verdict("rto", True)
    for kind, values in sorted(rto_by_fault(ops, final.get("queue_shards") or ()).items()):
        p99 = percentile(values, 99)
        v.counts.update({f"{kind}.n": len(values), f"{kind}.p50_ms": _ms(percentile(values, 50)),
                         f"{kind}.p99_ms": _ms(p99), f"{kind}.max_ms": _ms(max(values))})
        if p99 > rto_p99_max_ms:
            v.ok = False
            v.example(f"{kind}: p99 {p99:.0f} ms > {rto_p99_max_ms:.0f} ms")
    return v


def _ms(value: float) -> int:
    return round(value) if value != math.inf else -1


def latency(ops: list[Op], final: Final) -> Verdict:
    v = Verdict("latency", True, {f"<={b}ms": 0 for b in LATENCY_BUCKETS_MS})
    v.counts[f">{LATENCY_BUCKETS_MS[-1]}ms"] = 0
    v.counts["received"] = 0
    first = _first_receipts(ops)
    for mid, (op, m) in _sent(ops).items():
        seen = first.get(mid)
        if op["outcome"] != "ok" or seen is None:
            continue
        v.counts["received"] += 1
        ms = seen - max(op["invoke_ms"], float(m["deliver_at_ms"] or 0))
        bucket = next((f"<={b}ms" for b in LATENCY_BUCKETS_MS if ms <= b), f">{LATENCY_BUCKETS_MS[-1]}ms")
        v.counts[bucket] += 1
    return v


# -- transactions ----------------------------------------------------------------------------------
def transactions(ops: list[Op], final: Final) -> Verdict:
    """All or nothing: a transaction committed ok has every message stored (read_committed, at the
    end) and a reader never saw part of one; an aborted one (never committed, or whose commit was
    answered aborted) is never seen by anyone; one whose commit's answer was lost is all or none;
    no message is stored twice; no transaction is left open at the end."""
    v = Verdict("transactions", True, {"committed": 0, "aborted": 0, "unknown_all": 0, "unknown_none": 0,
                                       "partial": 0, "aborted_seen": 0, "lost": 0, "duplicated": 0, "left_open": 0,
                                       "committed_by_their_send": 0})
    if "txn_messages" not in final or not (final["txn_messages"] or any(_ops(ops, "txn"))):
        return Verdict("transactions", True, {"skipped": 1})  # a run without the transactional workload
    stored = Counter(row[2] for row in final["txn_messages"])
    seen = {row[1] for o in _ops(ops, "txn_recv", "ok") for row in o["value"]["msgs"]}
    for mid, n in stored.items():
        if n > 1:
            v.counts["duplicated"] += 1
            v.example(f"{mid} stored {n} times")
    for o in _ops(ops, "txn"):
        ids = o["value"]["ids"]
        held = sum(1 for mid in ids if mid in stored)
        glimpsed = sum(1 for mid in ids if mid in seen)
        tx = f"transaction {ids[0].rsplit('-', 1)[0]} ({o['outcome']})"
        if o["outcome"] == "ok":
            v.counts["committed"] += 1
            v.counts["committed_by_their_send"] += bool(o["value"].get("carried"))
            if held < len(ids):
                v.counts["lost"] += 1
                v.example(f"{tx}: {len(ids) - held} of its {len(ids)} messages are not stored")
        elif o["outcome"] == "fail":  # aborted (by the client or the broker), or never begun
            v.counts["aborted"] += 1
            if held or glimpsed:
                v.counts["aborted_seen"] += 1
                v.example(f"{tx}: {held} stored, {glimpsed} seen by a reader")
        else:
            v.counts["unknown_all" if held == len(ids) else "unknown_none"] += 1
            if 0 < held < len(ids):
                v.counts["partial"] += 1
                v.example(f"{tx}: {held} of {len(ids)} stored")
        if glimpsed and held < len(ids) and o["outcome"] != "fail":
            v.counts["partial"] += 1
            v.example(f"{tx}: a reader saw {glimpsed} of {len(ids)}, {held} are stored")
    v.counts["left_open"] = final.get("open_transactions", 0)
    v.ok = not any(v.counts[k] for k in ("partial", "aborted_seen", "lost", "duplicated", "left_open"))
    return v


# a node may exit by design under these faults of its own: a full disk under the dispatcher (a queue
# file it cannot write) ends the process, for systemd to start it again
EXIT_CAUSES = frozenset({"disk_full"})


def node_exits(ops: list[Op], final: Final) -> Verdict:
    """No node exited on its own (op ``node_exit``: the nemesis found it dead after a heal and
    started it again, as systemd would) except under a fault that ends the process by design: the
    node's latest fault before it must be one of ``EXIT_CAUSES``."""
    v = Verdict("node_exits", True, {"exits": 0, "unexplained": 0})
    last_fault: dict[str, str] = {}
    for o in sorted((o for o in ops if o["op"] in ("fault", "node_exit")), key=lambda o: o["invoke_ms"]):
        if o["op"] == "fault":
            if o["value"]["phase"] == "start":
                for name in o["value"].get("nodes") or [o["value"]["node"]]:  # power_loss_both: each node
                    last_fault[name] = o["value"]["kind"]
            continue
        node = o["value"]["node"]
        v.counts["exits"] += 1
        if last_fault.get(node) not in EXIT_CAUSES:
            v.counts["unexplained"] += 1
            v.example(f"node {node} exited ({o['value']['code']}) after {last_fault.get(node, 'no fault')}: "
                      f"see node-{node}.log")
    v.ok = v.counts["unexplained"] == 0
    return v


def clients(ops: list[Op], final: Final) -> Verdict:
    """Every workload client ran to the end (a client that crashed stops testing what it tests)."""
    exits = final.get("client_exit_codes", {})
    v = Verdict("clients", True, {"clients": len(exits), "crashed": 0})
    for name, code in sorted(exits.items()):
        if code != 0:
            v.counts["crashed"] += 1
            v.example(f"client {name} exited {code} (its log: client-{name}.log)")
    v.ok = v.counts["crashed"] == 0
    return v


def readable(ops: list[Op], final: Final) -> Verdict:
    """Every queue reads from offset 0 at the end: local retention deletes only what tiered storage
    holds, and the run keeps tiered objects forever. A queue whose start no read reaches has lost
    what was there for every reader (the ``lost`` checker counts the acknowledged ones)."""
    rows = final.get("unreadable", [])
    v = Verdict("readable", not rows, {"queues_unreadable_from_0": len(rows)})
    for topic, queue, low in rows:
        v.example(f"{topic}/{queue}: reads start at {low}, not 0")
    return v


def queue_moves(ops: list[Op], final: Final) -> Verdict:
    """Queue and group slot moves over shards (the ``queue_move``, ``slot_move`` faults): none left
    under way once the faults are
    healed, and each moved queue's segments chain (every one but the last read-only, each starting
    where the one before ends): never two writable segments. A move that failed (its target or etcd
    down) is counted, not a failure: what it sent stays checked by the transaction checkers."""
    v = Verdict("queue_moves", True, {"asked": 0, "done": 0, "failed": 0, "slots_asked": 0, "slots_done": 0,
                                      "slots_failed": 0})
    for o in _ops(ops, "queue_move"):
        v.counts["asked"] += 1
        v.counts["done" if o["outcome"] == "ok" else "failed"] += 1
    for o in _ops(ops, "slot_move"):  # the subscribe group's slot: its offsets are checked by offsets_monotonic
        v.counts["slots_asked"] += 1
        v.counts["slots_done" if o["outcome"] == "ok" else "slots_failed"] += 1
    for m in final.get("moves_in_flight") or []:
        v.ok = False
        v.example(f"a move still under way at the end: {m}")
    for q, segs in enumerate(final.get("txn_segments") or []):
        if any(s["state"] != "ro" for s in segs[:-1]) or segs[-1]["state"] == "ro":
            v.ok = False
            v.example(f"queue {q}: segments {segs}")
        if any(b["logical_start"] != a["end"] for a, b in itertools.pairwise(segs)):
            v.ok = False
            v.example(f"queue {q}: segments that do not chain {segs}")
    return v


CHECKERS: tuple[Callable[[list[Op], Final], Verdict], ...] = (
    lost, duplicates, key_order, timers, offsets_monotonic, pop_acked_not_redelivered, pops_complete, split_brain,
    tiered_bound,
    convergence, latency, transactions, clients, readable, node_exits, queue_moves)


def check_all(ops: list[Op], final: Final, rto_p99_max_ms: float = 3000.0) -> list[Verdict]:
    return [c(ops, final) for c in CHECKERS] + [rto(ops, final, rto_p99_max_ms)]


def summary_table(ops: list[Op], verdicts: list[Verdict]) -> str:
    by_op: dict[str, Counter[str]] = defaultdict(Counter)
    for o in ops:
        by_op[o["op"]][o["outcome"]] += 1
    faults = Counter(o["value"]["kind"] for o in _ops(ops, "fault") if o["value"]["phase"] == "start")
    lines = ["operations       ok      fail   unknown"]
    lines += [f"  {op:<12} {c['ok']:>7} {c['fail']:>8} {c['unknown']:>8}" for op, c in sorted(by_op.items())
              if op != "fault"]
    lines.append("faults: " + (", ".join(f"{k} {n}" for k, n in sorted(faults.items())) or "none"))
    lines.append("checkers")
    for v in verdicts:
        if v.name == "rto":
            continue
        counts = ", ".join(f"{k} {_fmt(n)}" for k, n in v.counts.items())
        lines.append(f"  {v.name:<26} {'PASS' if v.ok else 'FAIL'}  {counts}")
        lines += [f"      {e}" for e in v.examples[:3]]
    r = next((v for v in verdicts if v.name == "rto"), None)
    if r is not None:
        lines.append(f"RTO per fault kind (fault, or its heal for {', '.join(sorted(HEAL_BOUND))} -> the first "
                     f"ok send invoked after it completes)   {'PASS' if r.ok else 'FAIL'}")
        lines.append("  kind                 n    p50 ms    p99 ms    max ms")
        for kind in sorted({k.split(".")[0] for k in r.counts}):
            c = r.counts
            lines.append(f"  {kind:<16} {_fmt(c[kind + '.n']):>5} {_fmt(c[kind + '.p50_ms']):>9} "
                         f"{_fmt(c[kind + '.p99_ms']):>9} {_fmt(c[kind + '.max_ms']):>9}")
        lines += [f"      {e}" for e in r.examples[:3]]
    return "\n".join(lines)


def _fmt(n: float) -> str:
    return f"{int(n):,}" if float(n).is_integer() else f"{n:,.1f}"
