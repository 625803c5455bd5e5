"""Each checker on a hand-made history: a clean one passes, a minimally broken one fails with the
right count (no daemons: the checkers are offline)."""

from __future__ import annotations

import copy
from typing import Any

from tests.chaos import checkers as ck

Op = dict[str, Any]


def op(kind: str, value: dict[str, Any], t: float, outcome: str = "ok", result: dict[str, Any] | None = None,
       client: str = "c", took: float = 5.0) -> Op:
    o: Op = {"client": client, "op": kind, "value": value, "outcome": outcome, "invoke_ms": t, "complete_ms": t + took}
    if result is not None:
        o["result"] = result
    return o


def msg(mid: str, key: str | None = None, kseq: int | None = None, due: int | None = None) -> dict[str, Any]:
    return {"id": mid, "key": key, "kseq": kseq, "deliver_at_ms": due}


def history() -> tuple[list[Op], dict[str, Any]]:
    """Two sends (one keyed pair, one timer), a member, a pop group, status samples, one fault."""
    ops = [
        op("fault", {"kind": "kill9", "node": "a", "phase": "start"}, 900),
        op("send", {"topic": "t", "msgs": [msg("p-0", "k", 0), msg("p-1", "k", 1), msg("p-2", due=2000)]}, 1000),
        op("send", {"topic": "t", "msgs": [msg("p-3")]}, 1100, outcome="unknown"),
        op("send", {"topic": "t", "msgs": [msg("p-4")]}, 1500),
        op("assign", {"group": "g", "topic": "t", "queue_id": 0, "offset": 0}, 1010),
        op("recv", {"group": "g", "topic": "t", "queue_id": 0, "msgs": [[0, "p-0", 1001, 0], [1, "p-1", 1001, 0]]}, 1010),
        op("commit", {"group": "g", "topic": "t", "queue_id": 0, "offset": 2}, 1020),
        op("assign", {"group": "g", "topic": "t", "queue_id": 0, "offset": 2}, 1200, client="s2"),
        op("recv", {"group": "g", "topic": "t", "queue_id": 0, "msgs": [[3, "p-2", 2001, 2000]]}, 2000, took=10),
        op("pop", {"group": "h", "topic": "t"}, 1030, result={"msgs": [[0, 0, "p-0", 1]]}),
        op("ack", {"group": "h", "topic": "t", "msgs": [[0, 0, "p-0"]]}, 1040, result={"refused": []}),
        op("pop", {"group": "h", "topic": "t"}, 1100, result={"msgs": [[0, 1, "p-1", 2]]}),
        op("status", {"node": "a"}, 1000, result={"role": "master", "epoch": 1, "node_id": "A", "fenced": "",
                                                 "confirm_offset": 100, "tiered_uploaded_offset": 50, "permit_ms": 900}),
        op("status", {"node": "b"}, 1001, result={"role": "slave", "epoch": 1, "node_id": "B", "fenced": "",
                                                 "confirm_offset": 100, "tiered_uploaded_offset": 50, "permit_ms": 0}),
    ]
    ops.sort(key=lambda o: o["invoke_ms"])
    final = {"messages": [["t", 0, 0, "p-0", 1001, 0, 0], ["t", 0, 1, "p-1", 1001, 0, 0], ["t", 0, 2, "p-4", 1501, 0, 0],
                          ["t", 0, 3, "p-2", 2001, 2000, 77]],
             "nodes": {"a": {"digest": "x", "metadata": {"m": 1}}, "b": {"digest": "x", "metadata": {"m": 1}}},
             "compare_below": 100, "clock_skews": []}
    return ops, final


def verdict(name: str, ops: list[Op], final: dict[str, Any]) -> ck.Verdict:
    return next(v for v in ck.check_all(ops, final) if v.name == name)


def test_a_clean_history_passes_every_checker() -> None:
    ops, final = history()
    verdicts = ck.check_all(ops, final)
    assert [v.name for v in verdicts if not v.ok] == []
    table = ck.summary_table(ops, verdicts)
    assert "lost" in table and "FAIL" not in table and "kill9" in table


def test_an_acked_message_missing_is_lost_and_an_unknown_one_is_not() -> None:
    ops, final = history()
    assert verdict("lost", ops, final).counts["unknown_missing"] == 1  # p-3: unknown, not stored: fine
    final["messages"] = [r for r in final["messages"] if r[3] != "p-4"]
    v = verdict("lost", ops, final)
    assert not v.ok and v.counts["lost"] == 1 and "p-4" in v.examples[0]


def test_a_message_stored_twice_is_a_duplicate() -> None:
    ops, final = history()
    final["messages"].append(["t", 0, 4, "p-4", 1600, 0, 0])
    v = verdict("duplicates", ops, final)
    assert not v.ok and v.counts["duplicated_ok"] == 1


def test_keyed_messages_out_of_order() -> None:
    ops, final = history()
    final["messages"][0], final["messages"][1] = final["messages"][1], final["messages"][0]
    v = verdict("key_order", ops, final)
    assert not v.ok and v.counts["out_of_order"] == 1


def test_timers_early_missing_or_twice() -> None:
    ops, final = history()
    early = copy.deepcopy(final)
    early["messages"][3][4] = 1999
    assert verdict("timers", ops, early).counts["early_node_clock"] == 1
    missing = copy.deepcopy(final)
    missing["messages"].pop(3)
    assert verdict("timers", ops, missing).counts["never_fired"] == 1
    twice = copy.deepcopy(final)
    twice["messages"].append(["t", 0, 5, "p-2", 2100, 2000, 77])
    assert verdict("timers", ops, twice).counts["fired_twice"] == 1
    seen_early = [o for o in ops if not (o["op"] == "recv" and o["value"]["msgs"][0][1] == "p-2")]
    seen_early.append(op("recv", {"group": "g", "topic": "t", "queue_id": 0, "msgs": [[3, "p-2", 2001, 2000]]}, 1500))
    assert verdict("timers", seen_early, final).counts["early_harness_clock"] == 1
    skewed = {**final, "clock_skews": [{"node": "a", "start_ms": 1400, "end_ms": 1600, "offset_ms": 600}]}
    assert verdict("timers", seen_early, skewed).ok  # a forward jump explains it


def test_a_member_starting_below_a_committed_offset_moved_back() -> None:
    ops, final = history()
    ops.append(op("assign", {"group": "g", "topic": "t", "queue_id": 0, "offset": 1}, 1300, client="s3"))
    v = verdict("offsets_monotonic", ops, final)
    assert not v.ok and v.counts["moved_back"] == 1


def test_a_pop_after_an_ack_is_a_redelivery_of_an_acked_message() -> None:
    ops, final = history()
    assert verdict("pop_acked_not_redelivered", ops, final).counts["redelivered_allowed"] == 1  # p-1, never acked
    ops.append(op("pop", {"group": "h", "topic": "t"}, 1200, result={"msgs": [[0, 0, "p-0", 2]]}))
    v = verdict("pop_acked_not_redelivered", ops, final)
    assert not v.ok and v.counts["redelivered_after_ack"] == 1
    refused = [dict(o, result={"refused": [[0, 0]]}) if o["op"] == "ack" else o for o in ops]
    assert verdict("pop_acked_not_redelivered", refused, final).ok  # its lease had ended: not acked


def test_every_message_of_a_pop_groups_topic_is_popped_and_nothing_else() -> None:
    ops, final = history()
    final["pop_groups"] = {"h": "messages", "x": "txn_messages"}
    final["txn_messages"] = [[1, 5, "t-0"]]
    v = verdict("pops_complete", ops, final)
    assert not v.ok and v.counts["never_popped"] == 3 and v.counts["groups"] == 2  # h: 0/2, 0/3; x: 1/5
    ops += [op("pop", {"group": "h", "topic": "t"}, 2100, result={"msgs": [[0, 2, "p-4", 1], [0, 3, "p-2", 1]]}),
            op("pop", {"group": "x", "topic": "tx"}, 2100, outcome="unknown"),
            op("pop", {"group": "x", "topic": "tx"}, 2200, result={"msgs": [[1, 5, "t-0", 2]]})]
    assert verdict("pops_complete", ops, final).ok
    ops.append(op("pop", {"group": "x", "topic": "tx"}, 2300, result={"msgs": [[1, 4, "t-aborted", 1]]}))
    v = verdict("pops_complete", ops, final)
    assert not v.ok and v.counts["popped_not_stored"] == 1 and v.counts["never_popped"] == 0


def test_two_writable_masters() -> None:
    ops, final = history()
    b_master = {"role": "master", "epoch": 1, "node_id": "B", "fenced": "", "confirm_offset": 100,
                "tiered_uploaded_offset": 50, "permit_ms": 500}
    v = verdict("split_brain", [*ops, op("status", {"node": "b"}, 1001, result=b_master)], final)
    assert not v.ok and v.counts["epochs_with_two_masters"] == 1 and v.counts["two_masters_at_once"] == 1
    later = {**b_master, "epoch": 2}
    v = verdict("split_brain", [*ops, op("status", {"node": "b"}, 1030, result=later)], final)
    assert not v.ok and v.counts["two_masters_at_once"] == 1 and v.counts["epochs_with_two_masters"] == 0
    lapsed = {**later, "permit_ms": 0}  # a master whose permit lapsed acknowledges nothing
    assert verdict("split_brain", [*ops, op("status", {"node": "b"}, 1030, result=lapsed)], final).ok
    apart = [*ops, op("status", {"node": "b"}, 1500, result=later)]  # half a second later: a failover
    assert verdict("split_brain", apart, final).ok


def test_over_two_shards_each_pair_has_its_own_epochs_and_logs() -> None:
    ops, final = history()
    c_master = {"role": "master", "epoch": 1, "node_id": "C", "fenced": "", "confirm_offset": 7,
                "tiered_uploaded_offset": 0, "permit_ms": 900, "shard": "s2"}
    sharded = [*ops, op("status", {"node": "c"}, 1001, result=c_master)]
    for o in sharded:
        if o["op"] == "status" and "shard" not in o["result"]:
            o["result"]["shard"] = "s1"
    assert verdict("split_brain", sharded, final).ok, "the masters of two shards at one epoch number"
    d_master = {**c_master, "node_id": "D"}
    v = verdict("split_brain", [*sharded, op("status", {"node": "d"}, 1002, result=d_master)], final)
    assert not v.ok and v.counts["epochs_with_two_masters"] == 1 and v.counts["two_masters_at_once"] == 1
    pairs = {"s1": {"nodes": copy.deepcopy(final["nodes"]), "compare_below": 100},
             "s2": {"nodes": {"c": {"digest": "z", "metadata": {"m": 2}}, "d": {"digest": "z", "metadata": {"m": 2}}},
                    "compare_below": 7}}
    shard_final = {k: v for k, v in final.items() if k not in ("nodes", "compare_below")} | {"shards": pairs}
    v = verdict("convergence", ops, shard_final)
    assert v.ok and v.counts["digests_equal"] == 2 and v.counts["compare_below"] == 107
    pairs["s2"]["nodes"]["d"]["metadata"] = {"m": 3}
    v = verdict("convergence", ops, shard_final)
    assert not v.ok and v.counts["metadata_equal"] == 1 and "shard s2" in v.examples[0]


def test_tiered_above_confirm_and_diverged_logs() -> None:
    ops, final = history()
    bad = {"role": "slave", "epoch": 1, "node_id": "B", "fenced": "", "confirm_offset": 100, "tiered_uploaded_offset": 101}
    assert verdict("tiered_bound", [*ops, op("status", {"node": "b"}, 1400, result=bad)], final).counts["above_confirm"] == 1
    diverged = [*ops, op("converge", {}, 1600, result={"from": 0, "below": 90, "equal": False})]
    v = verdict("convergence", diverged, final)
    assert not v.ok and v.counts["heals_diverged"] == 1
    assert not verdict("convergence", [*ops, op("converge", {}, 1600, outcome="fail")], final).ok
    assert verdict("convergence", [*ops, op("converge", {}, 1600, result={"from": 0, "below": 90, "equal": True})],
                   final).counts["heals_checked"] == 1
    final["nodes"]["b"]["digest"] = "y"
    assert not verdict("convergence", ops, final).ok


def test_rto_runs_from_the_fault_to_the_first_later_send_that_succeeds() -> None:
    ops, final = history()
    v = verdict("rto", ops, final)  # kill9 at 900; the first send invoked after it is ok, completes at 1005
    assert v.counts["kill9.n"] == 1 and v.counts["kill9.p99_ms"] == 105
    slow = [dict(o, complete_ms=4000.0) if o["op"] == "send" and o["invoke_ms"] == 1000 else o for o in ops]
    v = verdict("rto", slow, final)  # that send took until 4000; the next one (1500) completes at 1505
    assert v.counts["kill9.p99_ms"] == 605
    assert not ck.rto(slow, final, rto_p99_max_ms=600).ok
    healed = [*ops, op("fault", {"kind": "disk_full", "node": "a", "phase": "start"}, 1050),
              op("fault", {"kind": "disk_full", "node": "a", "phase": "end"}, 1400)]
    healed.sort(key=lambda o: o["invoke_ms"])
    assert verdict("rto", healed, final).counts["disk_full.p99_ms"] == 105  # from its heal at 1400 to 1505


def test_over_shards_a_faults_recovery_is_a_send_to_its_own_shard() -> None:
    ops, final = history()
    for o in ops:
        if o["op"] == "send" and o["outcome"] == "ok":  # 1000 wrote queue 1 (s2's), 1500 queue 0 (s1's)
            o["result"] = {"receipts": [{"queue_id": 1 if o["invoke_ms"] == 1000 else 0}]}
        if o["op"] == "fault":
            o["value"]["shard"] = "s1"
    assert verdict("rto", ops, final).counts["kill9.p99_ms"] == 105, "a pair: the first later send"
    final["queue_shards"] = ["s1", "s2"]
    assert verdict("rto", ops, final).counts["kill9.p99_ms"] == 605, "s1's fault: the first later send to s1"
    shared = [dict(o, value={**o["value"], "shard": ""}) if o["op"] == "fault" else o for o in ops]
    assert verdict("rto", shared, final).counts["kill9.p99_ms"] == 105, "a shared part's fault: any send"


def test_latency_buckets() -> None:
    ops, final = history()
    v = verdict("latency", ops, final)
    # p-0 and p-1: received at 1015, sent at 1000; p-2 (a timer due at 2000): received at 2010
    assert v.counts["received"] == 3 and v.counts["<=100ms"] == 2 and v.counts["<=10ms"] == 1


def test_transactions_all_or_nothing() -> None:
    ops, final = history()
    ops += [op("txn", {"topic": "x", "ids": ["t-x0-0", "t-x0-1"], "commit": True}, 1000),
            op("txn", {"topic": "x", "ids": ["t-x1-0", "t-x1-1"], "commit": False}, 1100, outcome="fail"),
            op("txn", {"topic": "x", "ids": ["t-x2-0", "t-x2-1"], "commit": True}, 1200, outcome="unknown"),
            op("txn_recv", {"queue_id": 0, "msgs": [[0, "t-x0-0"], [1, "t-x0-1"]]}, 1300)]
    final["txn_messages"] = [[0, 0, "t-x0-0"], [0, 1, "t-x0-1"]]
    final["open_transactions"] = 0
    clean = verdict("transactions", ops, final)
    assert clean.ok and clean.counts["committed"] == 1 and clean.counts["unknown_none"] == 1, clean
    broken = copy.deepcopy(final)
    broken["txn_messages"] = [[0, 0, "t-x0-0"], [0, 3, "t-x1-0"], [1, 0, "t-x2-1"]]
    v = verdict("transactions", ops, broken)
    assert not v.ok and (v.counts["lost"], v.counts["aborted_seen"], v.counts["partial"]) == (1, 1, 2)
    glimpse = [*ops, op("txn_recv", {"queue_id": 1, "msgs": [[5, "t-x1-1"]]}, 1400)]
    assert verdict("transactions", glimpse, final).counts["aborted_seen"] == 1
    final["open_transactions"] = 1
    assert not verdict("transactions", ops, final).ok


def test_a_crashed_client_fails_the_run() -> None:
    ops, final = history()
    final["client_exit_codes"] = {"p1": 0, "t1": 1}
    v = verdict("clients", ops, final)
    assert not v.ok and v.counts["crashed"] == 1 and "t1" in v.examples[0]


def test_a_queue_whose_start_no_read_reaches_fails_the_run() -> None:
    ops, final = history()
    assert verdict("readable", ops, final).ok
    final["unreadable"] = [["chaos", 0, 171898]]
    v = verdict("readable", ops, final)
    assert not v.ok and v.counts["queues_unreadable_from_0"] == 1 and "171898" in v.examples[0]


def test_a_node_that_exits_on_its_own_fails_the_run_unless_a_full_disk_explains_it() -> None:
    ops, final = history()
    fault = {"node": "a", "role": "master", "phase": "start"}
    ops += [op("fault", {**fault, "kind": "disk_full"}, 900), op("node_exit", {"node": "a", "code": 1}, 950)]
    v = verdict("node_exits", ops, final)
    assert v.ok and v.counts == {"exits": 1, "unexplained": 0}
    ops += [op("fault", {**fault, "kind": "sigstop"}, 960), op("node_exit", {"node": "a", "code": -11}, 990)]
    v = verdict("node_exits", ops, final)
    assert not v.ok and v.counts == {"exits": 2, "unexplained": 1} and "after sigstop" in v.examples[0]


def test_queue_moves_left_under_way_or_segments_that_do_not_chain() -> None:
    ops: list[dict[str, Any]] = [{"client": "nemesis", "op": "queue_move", "value": {"queue": 0, "to": "s2"},
                                  "outcome": "ok", "invoke_ms": 1.0, "complete_ms": 2.0}]
    good = [[{"shard": "s1", "logical_start": 0, "end": 7, "state": "ro"},
             {"shard": "s2", "logical_start": 7, "end": None, "state": "rw"}]]
    ops.append({"client": "nemesis", "op": "slot_move", "value": {"slot": 3, "to": "s2"}, "outcome": "fail",
                "invoke_ms": 1.0, "complete_ms": 2.0})
    v = ck.queue_moves(ops, {"moves_in_flight": [], "txn_segments": good})
    assert v.ok and v.counts == {"asked": 1, "done": 1, "failed": 0, "slots_asked": 1, "slots_done": 0,
                                 "slots_failed": 1}
    assert not ck.queue_moves(ops, {"moves_in_flight": [{"topic": "t", "queue": 0}], "txn_segments": good}).ok
    assert not ck.queue_moves(ops, {"moves_in_flight": [{"topic": "", "queue": 3}], "txn_segments": good}).ok
    two_writable = [[{"shard": "s1", "logical_start": 0, "end": None, "state": "rw"},
                     {"shard": "s2", "logical_start": 7, "end": None, "state": "rw"}]]
    assert not ck.queue_moves(ops, {"txn_segments": two_writable}).ok
    gap = [[{"shard": "s1", "logical_start": 0, "end": 7, "state": "ro"},
            {"shard": "s2", "logical_start": 9, "end": None, "state": "rw"}]]
    assert not ck.queue_moves(ops, {"txn_segments": gap}).ok
