"""Rebalance and drain (docs/shards.md "Rebalance and drain"): a shard that joins takes its share of
the queues with the fewest moves; a drained shard writes none and takes no new one; real daemons,
a real etcd, a producer sending throughout."""

from __future__ import annotations

import json
import subprocess
import sys

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, Message
from tests.failoverutil import Spawn, sent_once_placed
from tests.moveutil import KeyedProducer, check_once_in_order, owners, read_back, shard_node
from tests.test_shards import _key_for
from tests.waits import wait_until


def _counts(c: BrokerClient) -> dict[str, int]:
    return {s["shard"]: s["queues"] for s in c.cluster_status()["shards"]}


def _cli(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", "cluster", *args, "--broker", address],
                          capture_output=True, text=True, timeout=120, check=False)


def test_a_new_shard_takes_its_share_then_drains_away(spawn: Spawn, etcd: EtcdProcess) -> None:
    a, b = shard_node(spawn, etcd, "s1", "a"), shard_node(spawn, etcd, "s2", "b")
    with BrokerClient([a.address, b.address]) as c:
        c.create_topics({f"t{i}": 6 for i in range(4)})
        for i in range(4):
            wait_until(lambda i=i: sent_once_placed(c, f"t{i}", [Message(b"x", key=str(k)) for k in range(12)]), 30,
                       f"t{i} created on both shards")
        assert _counts(c) == {"s1": 12, "s2": 12}
        n = shard_node(spawn, etcd, "s3", "n")
        wait_until(lambda: any(s["shard"] == "s3" and s["master"] for s in c.cluster_status()["shards"]), 15,
                   "the new shard known")
        q = owners(c, "t0").index("s1")
        with KeyedProducer(c, "t0", _key_for(c, "t0", q)) as p:
            p.wait_more(20)
            plan = c.rebalance(dry_run=True)
            assert len(plan) == 8 and {m["to"] for m in plan} == {"s3"} and _counts(c)["s1"] == 12, "a dry run moves nothing"
            done = c.rebalance()
            assert [m["error"] for m in done] == [""] * 8
            assert _counts(c) == {"s1": 8, "s2": 8, "s3": 8}
            assert c.rebalance() == [], "even already: nothing to move"
            p.wait_more(20)

            shown = _cli(a.address, "drain", "s3")
            assert shown.returncode == 0, shown.stderr
            assert len(json.loads(shown.stdout)["moves"]) == 8
            assert _counts(c).get("s3", 0) == 0 and sum(_counts(c).values()) == 24
            s3 = next(s for s in c.cluster_status()["shards"] if s["shard"] == "s3")
            assert s3["draining"] and s3["drained"] and s3["read_only_segments"] == 8
            status = _cli(n.address, "status")
            assert "DRAINED" in status.stdout
            c.create_topic("fresh", queues=4)
            assert "s3" not in owners(c, "fresh"), "a draining shard takes no new queue"
            assert c.rebalance(undrain="s3") == [], "a cancelled drain moves nothing back"
            assert not next(s for s in c.cluster_status()["shards"] if s["shard"] == "s3")["draining"]
            p.wait_more(20)
        assert not p.errors, p.errors[:5]
        check_once_in_order(read_back(c, "t0", q), p)
        # removed: drained again (nothing to move), its node stopped; every queue still takes sends
        assert c.rebalance(drain="s3") == [] and next(s for s in c.cluster_status()["shards"] if s["shard"] == "s3")["drained"]
        n.stop()
        for t in [f"t{i}" for i in range(4)] + ["fresh"]:
            queues = len(owners(c, t))
            receipts = c.send(t, [Message(b"after removal", key=_key_for(c, t, k)) for k in range(queues)], ack="replica")
            assert sorted(r.queue_id for r in receipts) == list(range(queues))
