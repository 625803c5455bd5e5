"""`tidemark demo` runs to the end: it is the first thing a new reader tries."""

from __future__ import annotations

import subprocess
import sys

from tests.aptutil import require_tool


def test_demo_runs_and_loses_nothing() -> None:
    """The demo's failover, rejoin and restarts all succeed (exit 0, no message lost, a clean restart)."""
    require_tool("etcd", "etcd-server")
    r = subprocess.run([sys.executable, "-m", "broker.cli", "demo"], capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "(none lost)" in r.stdout and "rejoined as a slave by itself" in r.stdout and "(clean=True)" in r.stdout, r.stdout
    assert "etcd elected node-b" in r.stdout and "(each once)" in r.stdout and "is a switchover" in r.stdout, r.stdout
    assert "placed in etcd: queues 0->" in r.stdout and "split per shard" in r.stdout, r.stdout
    assert "s1's master: its queues served again" in r.stdout, r.stdout
    assert "group 'billing': a member bootstrapped from each shard's node" in r.stdout, r.stdout
    assert ", 0 twice; committed to the group's coordinator shard, lag 0 as any node describes it" in r.stdout, r.stdout
    assert ("until the commit ({'s1': 0, 's2': 0}), then visible on both ({'s1': 1, 's2': 1})" in r.stdout), r.stdout
    assert "moved from s1 to s2 with no data copied" in r.stdout and "all there; then `cluster rebalance`" in r.stdout, r.stdout
    assert "(`cluster move-slot`; a drain moves every slot of its shard): committed offsets" in r.stdout, r.stdout
    assert " went along; " in r.stdout, r.stdout
