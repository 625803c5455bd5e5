"""examples/node: a Node.js client written from proto/tidemark.proto alone (@grpc/grpc-js and
@grpc/proto-loader, pinned by its lockfile) against a live daemon: it creates a topic, sends a
plain and a delayed message, pulls both back decoded, commits an offset, pops and acks them for a
second group, drains 250 jobs with a consumer loop of bulk pops and acks, runs a committed and an
aborted transaction and reads the typed status.
What it printed is checked against what the daemon holds, through the Python client."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.client import BrokerClient
from tests.aptutil import require_tool
from tests.procs import DaemonProcess

pytestmark = pytest.mark.xdist_group("node")  # make test's workers: npm ci in the shared examples/node

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "node"


@pytest.fixture(scope="module")
def node() -> str:
    """node, with the example's packages installed from its lockfile (npm ci; cached in node_modules)."""
    node_bin = require_tool("node", "nodejs")
    npm = require_tool("npm", "npm")
    marker = EXAMPLE / "node_modules" / ".package-lock.json"
    lock = EXAMPLE / "package-lock.json"
    if not marker.exists() or marker.stat().st_mtime < lock.stat().st_mtime:
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--prefer-offline"], cwd=EXAMPLE, capture_output=True,
                           text=True, timeout=600, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
    return node_bin


def _run(node: str, address: str, *args: str, env: dict[str, str] | None = None) -> list[dict]:  # type: ignore[type-arg]
    r = subprocess.run([node, str(EXAMPLE / "client.js"), address, *args], capture_output=True, text=True, timeout=120,
                       check=False, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stdout + r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_the_node_example_sends_pulls_commits_and_reads_status(node: str, spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node")
    steps = {s["step"]: s for s in _run(node, d.address, "orders")}
    sent = steps["send"]["receipts"]
    assert [r["queue_offset"] for r in sent] == ["0", "-1"]  # the delayed one has no queue offset until it fires
    assert sent[1]["timer_offset"] == sent[1]["commit_offset"] != "0"
    assert steps["pull"]["bodies"] == ["hello from node", "delayed from node"]
    assert steps["commit"] == {"step": "commit", "found": True, "offset": "2"}
    assert steps["pop"] == {"step": "pop", "bodies": ["hello from node", "delayed from node"],
                            "delivery_counts": [1, 1], "not_acked": 0}
    loop = steps["consume_loop"]  # every job once, 100 at most a pop, each pop acking the batch before, none refused
    assert (loop["consumed"], loop["distinct"], loop["refused"]) == (250, 250, 0) and 3 <= loop["pops"] <= 250, loop
    assert steps["status"]["role"] == "ROLE_MASTER" and steps["status"]["epoch"] == 1
    assert steps["read_committed"] == {"step": "read_committed", "bodies": ["node-tx-ok 1", "node-tx-ok 2"],
                                       "offsets": ["0", "1"], "next_offset": "4", "uncommitted": 4}
    assert steps["transaction_one"] == {"step": "transaction_one", "outcome": "TRANSACTION_OUTCOME_COMMITTED",
                                        "began": True, "receipts": 1}
    assert steps["status"]["transactions"] == {"committed": "2", "aborted": "1", "open": "0"}
    assert steps["transaction"]["counted"] is True, "a Node producer's transaction is counted (ACK_LEADER sends)"
    with BrokerClient(d.address) as c:  # what Node sent is what our own client reads
        msgs = list(c.pull("orders", 0, 0))
        assert [m.body for m in msgs] == [b"hello from node", b"delayed from node", b"node-tx-one"]
        assert msgs[0].key == "order-1" and msgs[0].properties == {"lang": "node"}
        assert msgs[1].deliver_at_ms == int(sent[1]["deliver_at_ms"]) and msgs[1].timer_offset == int(sent[1]["timer_offset"])
        assert msgs[1].store_time_ms >= msgs[1].deliver_at_ms  # fired, never early
        assert c.committed_offset("node-example", "orders", 0) == 2
        assert c.committed_offset("node-example-tx", "orders", 0) == 2  # committed with the transaction
        assert sum(int(q["in_flight"]) for q in c.describe_group("node-example-pop")["queues"]) == 0  # acked
        assert sum(int(q["in_flight"]) for q in c.describe_group("node-example-workers")["queues"]) == 0
        assert int(steps["status"]["max_offset"]) <= c.status()["max_offset"]


def test_the_node_example_fails_with_one_line_and_the_grpc_code(node: str, spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node")
    r = subprocess.run([node, str(EXAMPLE / "client.js"), d.address, "__timer"], capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 1
    assert r.stderr.strip().startswith("tidemark example: INVALID_ARGUMENT") and len(r.stderr.strip().splitlines()) == 1
