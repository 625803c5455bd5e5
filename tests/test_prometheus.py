"""A real Prometheus (Debian's package) scrapes a live pair and a node whose metrics port wants
TLS and a token; every query of deploy/grafana/tidemark-dashboard.json and every alert rule of
deploy/prometheus/tidemark-alerts.yml is evaluated through Prometheus's HTTP API. A query that
fails, a rule whose evaluation errs, or a metric name that no node exports fails the test."""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from broker.client import BrokerClient, Message
from tests.aptutil import require_tool
from tests.certs import CA
from tests.procs import DaemonProcess, free_port
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "tidemark-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "tidemark-alerts.yml"
SCRAPER_TOKEN = "scrape-token-0123456789"
OPS_TOKEN = "ops-token-0123456789abc"
EXPORT_INTERVAL_S = 5.0  # node-state gauges are refreshed this often (broker/daemon/server.py)


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def rule_expressions() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def exported_names(text: str) -> set[str]:
    """Every series name a metrics page declares (a counter's _total, a histogram's _bucket ...)."""
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names.add(name)
        names.update({"counter": [f"{name}_total", f"{name}_created"],
                      "histogram": [f"{name}_bucket", f"{name}_count", f"{name}_sum", f"{name}_created"]}.get(kind, []))
    return names


class Prometheus:
    def __init__(self, binary: str, workdir: Path, targets: dict[str, Any], rules: Path) -> None:
        self.port = free_port()
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": [str(rules)],
                  "scrape_configs": [{"job_name": job, **cfg} for job, cfg in targets.items()]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                                      f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self._ready, 60, "prometheus ready")

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "prometheus exited: see prometheus.log"
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            body = json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as exc:  # a bad query: 400 with a JSON error
            body = json.loads(exc.read())
        return body

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.fixture
def prometheus_binary() -> str:
    return require_tool("prometheus", "prometheus")


@pytest.fixture
def pki(tmp_path: Path) -> tuple[CA, Any]:
    ca = CA.create(tmp_path, "ca")
    return ca, ca.issue("server", client=False)


def _get(url: str, ctx: ssl.SSLContext | None, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        return int(urllib.request.urlopen(request, timeout=5, context=ctx).status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture
def nodes(spawn: Callable[..., DaemonProcess], tmp_path: Path, pki: tuple[CA, Any]) -> Iterator[dict[str, Any]]:
    ca, server = pki
    tokens = tmp_path / "tokens"
    tokens.write_text(f"scraper metrics {SCRAPER_TOKEN}\nops admin,read,write,system {OPS_TOKEN}\n")
    ports = {name: free_port() for name in ("master", "slave", "secure")}
    master = spawn("master", config={"node.metrics_listen": f"127.0.0.1:{ports['master']}"})
    spawn("slave", config={"node.metrics_listen": f"127.0.0.1:{ports['slave']}", "node.role": "slave",
                           "node.master": master.address})
    secure = spawn("secure", config={
        "node.metrics_listen": f"127.0.0.1:{ports['secure']}", "node.metrics_tls": True, "node.metrics_auth": True,
        "tls.cert_file": server.cert, "tls.key_file": server.key, "replication.listen": f"127.0.0.1:{free_port()}",
        "auth.tokens_file": str(tokens)}, credentials=grpc.ssl_channel_credentials(Path(ca.cert).read_bytes()))
    yield {"master": master, "secure": secure, "ports": ports, "ca": ca, "tokens": tokens}


def test_the_metrics_port_wants_tls_and_a_metrics_token(nodes: dict[str, Any]) -> None:
    url = f"https://127.0.0.1:{nodes['ports']['secure']}/metrics"
    ctx = ssl.create_default_context(cafile=nodes["ca"].cert)
    wait_until(lambda: _get(url, ctx, SCRAPER_TOKEN) == 200, 30, "the TLS metrics port serving")
    assert _get(url, ctx) == 401  # no token
    assert _get(url, ctx, "wrong-token-0123456789") == 403
    with pytest.raises(OSError):  # plain HTTP on a TLS port gets nowhere (reset, or no answer)
        urllib.request.urlopen(url.replace("https", "http"), timeout=5)
    ops_status = _get(url, ctx, OPS_TOKEN)  # admin may scrape too
    assert ops_status == 200
    tokens_only_read = nodes["tokens"].read_text().replace("scraper metrics", "scraper read")
    nodes["tokens"].write_text(tokens_only_read)
    nodes["secure"].proc.send_signal(1)  # SIGHUP: tokens re-read; the scraper's token lost the metrics role
    wait_until(lambda: _get(url, ctx, SCRAPER_TOKEN) == 403, 10, "the token without the metrics role refused")


def test_every_dashboard_query_and_alert_rule_evaluates_on_a_live_pair(
        nodes: dict[str, Any], prometheus_binary: str, tmp_path: Path) -> None:
    ports = nodes["ports"]
    (tmp_path / "scrape.token").write_text(SCRAPER_TOKEN)
    (tmp_path / "prom").mkdir()
    prom = Prometheus(prometheus_binary, tmp_path / "prom", targets={
        "tidemark": {"static_configs": [{"targets": [f"127.0.0.1:{ports['master']}", f"127.0.0.1:{ports['slave']}"]}]},
        "tidemark-secure": {"scheme": "https", "tls_config": {"ca_file": nodes["ca"].cert},
                            "authorization": {"credentials_file": str(tmp_path / "scrape.token")},
                            "static_configs": [{"targets": [f"127.0.0.1:{ports['secure']}"]}]},
    }, rules=RULES)
    try:
        with BrokerClient(nodes["master"].address) as c:  # traffic, so that most series have samples
            c.create_topic("orders", queues=2)
            for ack in ("leader", "flush", "replica"):
                c.send("orders", [Message(b"x" * 100, key=str(i)) for i in range(50)], ack=ack)
            c.send("orders", [Message(b"later", deliver_at_ms=int(time.time() * 1000) + 600_000)])
            c.send("orders", [Message(b"soon", deliver_at_ms=int(time.time() * 1000) + 500)])
            c.pull("orders", 0, 0)
            c.commit_offset("g", "orders", 0, 10)
            popped = c.pop("w", "orders", max_messages=20, start="earliest")
            c.ack("w", popped[:10])
        targets_up = lambda: [t["health"] for t in prom.api("targets")["data"]["activeTargets"]]  # noqa: E731
        wait_until(lambda: targets_up() == ["up"] * 3, 30, "all three targets scraped")
        time.sleep(EXPORT_INTERVAL_S + 3)  # node-state gauges exported, a few samples for rate() windows
        known = set(prom.api("label/__name__/values")["data"])
        for port, scheme in ((ports["master"], "http"), (ports["slave"], "http")):
            known |= exported_names(urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/metrics", timeout=5).read().decode())
        queries = dashboard_queries() + rule_expressions()
        failures = []
        for q in queries:
            answer = prom.api("query", query=q)
            if answer.get("status") != "success":
                failures.append(f"{q}: {answer.get('error')}")
            unknown = {n for n in re.findall(r"\btidemark_\w+", q) if n not in known}
            if unknown:
                failures.append(f"{q}: unknown metrics {sorted(unknown)}")
        assert not failures, "\n".join(failures)
        assert len(queries) >= 50

        def value(q: str) -> list[Any]:
            return list(prom.api("query", query=q)["data"]["result"])

        # the panels an operator looks at first show data, from both nodes
        assert len(value("tidemark_is_master")) == 3 and len(value("tidemark_open_files")) == 3
        assert {r["metric"]["ack"] for r in value("sum by (ack) (tidemark_send_seconds_count)")} == \
            {"leader", "flush", "replica"}
        assert value('sum(tidemark_timer_pending{job="tidemark"})')[0]["value"][1] != "0"
        assert value("sum(tidemark_consumer_group_lag_messages)") and value("tidemark_pop_in_flight")
        assert value("tidemark_replica_lag_bytes")
        # every alert rule was evaluated by Prometheus itself without an error
        wait_until(lambda: all(r.get("lastEvaluation", "").startswith("2") for g in prom.api("rules")["data"]["groups"]
                               for r in g["rules"]), 30, "every rule evaluated once")
        bad = [(r["name"], r.get("lastError")) for g in prom.api("rules")["data"]["groups"] for r in g["rules"]
               if r.get("health") != "ok"]
        assert not bad, bad
    finally:
        prom.stop()


def test_metrics_protection_without_its_credentials_is_a_config_error(tmp_path: Path) -> None:
    for body, key in (("[node]\nmetrics_tls = true\n", "tls.cert_file"), ("[node]\nmetrics_auth = true\n", "auth.tokens_file")):
        path = tmp_path / "tidemark.toml"
        path.write_text(body)
        r = subprocess.run([sys.executable, "-m", "broker.cli", "config", "check", str(path)], capture_output=True,
                           text=True, timeout=60, check=False)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and key in r.stderr, r.stderr
