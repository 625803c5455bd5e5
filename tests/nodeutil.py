"""A daemon seen from outside, for the service, replication and tiered tests: its status, its log
files, the consumer offsets recorded in its ``__metadata`` log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from broker.client import BrokerClient
from broker.logformat import system_records
from tests.procs import DaemonProcess
from tests.waits import wait_until


def status(d: DaemonProcess) -> dict[str, Any]:
    with BrokerClient(d.address) as c:
        return c.status()


def log_bytes(d: DaemonProcess) -> tuple[int, bytes]:
    """(first offset, every byte) of a node's local log, from its segment files alone: the first offset is
    the first file's name, so the two always match even while retention deletes head segments (a file
    gone between listing and reading makes it read again)."""

    def read() -> tuple[int, bytes]:
        segs = sorted((Path(d.data_dir) / "log").glob("*.log"))
        return int(segs[0].name[:20]), b"".join(p.read_bytes() for p in segs)

    return wait_until(read, 10, f"a read of {d.data_dir}/log between two deletions", poll_s=0,
                      transient=lambda exc: isinstance(exc, FileNotFoundError))


def offsets_recorded(address: str, group: str, topic: str, offsets: dict[int, int]) -> bool:
    """Whether ``__metadata`` holds an ``offsets.commit`` record of each {queue: offset} of ``group`` on
    ``topic``. Pulls serve confirmed records only: such a record is flushed (and on the in-sync slaves)."""
    want = {(group, topic, q, o) for q, o in offsets.items()}
    with BrokerClient(address) as c:
        for res in c.iter_pull(system_records.METADATA_TOPIC, 0, 0, max_messages=10_000):
            for m in res:
                if m.key == system_records.OFFSETS_COMMIT:
                    want -= {tuple(e) for e in json.loads(m.body)["offsets"]}
    return not want
