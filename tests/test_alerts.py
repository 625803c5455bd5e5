"""deploy/prometheus/tidemark-alerts.yml: valid rules (promtool), on metrics a real pair exports."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

from broker.client import BrokerClient, Message
from tests.aptutil import require_tool
from tests.procs import DaemonProcess, free_port
from tests.waits import wait_until

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "tidemark-alerts.yml"
EXPORT_INTERVAL_S = 5.0  # broker.server: node-state gauges are refreshed this often


def test_promtool_accepts_the_rules() -> None:
    """`promtool check rules` (Debian's prometheus package, installed if missing) finds every rule valid."""
    promtool = require_tool("promtool", "prometheus")
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def _scrape(port: int) -> tuple[set[str], dict[str, float]]:
    """(every metric name a rule may use, unlabelled sample values) from one /metrics page."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        if kind == "histogram":
            names.update({f"{name}_bucket", f"{name}_count", f"{name}_sum"})
    values = {m[0]: float(m[1]) for m in re.findall(r"^(tidemark_\w+) (\S+)$", text, re.M)}
    return names, values


def test_rules_use_metrics_a_master_and_slave_export(spawn: Callable[..., DaemonProcess]) -> None:
    """Every tidemark_* name in the rules exists; the pair reports master 1, in-sync 1, follower connected 1."""
    mport, sport = free_port(), free_port()
    master = spawn("master", config={"node.metrics_listen": f"127.0.0.1:{mport}"})
    spawn("slave", config={"node.metrics_listen": f"127.0.0.1:{sport}", "node.role": "slave",
                           "node.master": master.address})
    with BrokerClient(master.address) as c:
        c.create_topic("t")
        c.send("t", [Message(body=b"x")], ack="replica")
    used = set(re.findall(r"\btidemark_\w+", RULES.read_text()))

    def exported(scraped: tuple[set[str], dict[str, float], dict[str, float]]) -> bool:
        names, master_values, slave_values = scraped  # the node-state gauges are set at the first export
        return (not used - names and master_values.get("tidemark_insync_replicas") == 1
                and slave_values.get("tidemark_follower_connected") == 1)

    names, master_values, slave_values = wait_until(lambda: (*_scrape(mport), _scrape(sport)[1]), 3 * EXPORT_INTERVAL_S,
                                                    "the node-state gauges exported", accept=exported)
    assert used and not used - names, f"not exported: {sorted(used - names)}"
    assert master_values["tidemark_is_master"] == 1 and master_values["tidemark_insync_replicas"] == 1
    assert slave_values["tidemark_is_master"] == 0 and slave_values["tidemark_follower_connected"] == 1
    assert master_values["tidemark_epoch"] == slave_values["tidemark_epoch"] == 1


SHARDED_CASES = """
rule_files: [{rules}]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      # two shards, one master each: no alert; then s2's master is lost and etcd shows no master
      - series: 'tidemark_shard_info{{job="tidemark",instance="a",shard="s1"}}'
        values: '1x10'
      - series: 'tidemark_shard_info{{job="tidemark",instance="b",shard="s1"}}'
        values: '1x10'
      - series: 'tidemark_shard_info{{job="tidemark",instance="c",shard="s2"}}'
        values: '1x10'
      - series: 'tidemark_shard_info{{job="tidemark",instance="d",shard="s2"}}'
        values: '1x10'
      - series: 'tidemark_is_master{{job="tidemark",instance="a"}}'
        values: '1x10'
      - series: 'tidemark_is_master{{job="tidemark",instance="b"}}'
        values: '0x10'
      - series: 'tidemark_is_master{{job="tidemark",instance="c"}}'
        values: '1 1 1 0 0 0 0 0 0 0 0'
      - series: 'tidemark_is_master{{job="tidemark",instance="d"}}'
        values: '0x10'
      - series: 'tidemark_cluster_shard_has_master{{job="tidemark",instance="a",shard="s1"}}'
        values: '1x10'
      - series: 'tidemark_cluster_shard_has_master{{job="tidemark",instance="a",shard="s2"}}'
        values: '1 1 1 0 0 0 0 0 0 0 0'
    alert_rule_test:
      - eval_time: 2m
        alertname: TidemarkTwoMasters
        exp_alerts: []
      - eval_time: 2m
        alertname: TidemarkNoWritableMaster
        exp_alerts: []
      - eval_time: 6m
        alertname: TidemarkNoWritableMaster
        exp_alerts:
          - exp_labels: {{severity: critical, shard: s2}}
            exp_annotations: {no_master}
      - eval_time: 6m
        alertname: TidemarkShardWithoutMaster
        exp_alerts:
          - exp_labels: {{severity: critical, shard: s2}}
            exp_annotations: {shard_without}
"""


def _annotations(alert: str, shard: str) -> str:
    """The rule's annotations as the alert carries them for ``shard`` (a JSON object, valid YAML)."""
    block = RULES.read_text().split(f"- alert: {alert}\n", 1)[1].split("- alert:", 1)[0]
    found = dict(re.findall(r'^\s+(summary|description): "(.*)"$', block, re.M))
    return json.dumps({k: v.replace("{{ $labels.shard }}", shard).replace('\\"', '"') for k, v in found.items()})


def test_master_alerts_count_per_shard(tmp_path: Path) -> None:
    """`promtool test rules`: two shards with a master each raise no two-masters alert; a shard
    that lost its master raises the no-master alerts for that shard only."""
    promtool = require_tool("promtool", "prometheus")
    (tmp_path / "rules.yml").write_text(RULES.read_text())
    (tmp_path / "cases.yml").write_text(SHARDED_CASES.format(
        rules="rules.yml", no_master=_annotations("TidemarkNoWritableMaster", "s2"),
        shard_without=_annotations("TidemarkShardWithoutMaster", "s2")))
    r = subprocess.run([promtool, "test", "rules", "cases.yml"], capture_output=True, text=True, timeout=60,
                       check=False, cwd=tmp_path)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
