"""Tiered upload under replication: gated by the confirm offset, resumed exactly after failover."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.client import BrokerClient
from tests.nodeutil import log_bytes, status
from tests.procs import DaemonProcess
from tests.tieredutil import (
    Sender,
    caught_up,
    check_chain,
    objects,
    promote_while_sending,
    read_all,
    tiered_config,
)
from tests.waits import holds_for, wait_until
from tieredstore.posix import PosixBackend

QUEUES = 2


def _pair(spawn: Callable[..., DaemonProcess], root: str, master_env: dict[str, str] | None = None,
          **extra: object) -> tuple[DaemonProcess, DaemonProcess]:
    cfg = tiered_config(root, **{"replication.max_lag_ms": 60_000, **extra})
    m = spawn("m", config=cfg, env=master_env or {})
    s = spawn("s", config={**cfg, "node.role": "slave", "node.master": m.address})
    # with min_insync_replicas = 2 (some callers) even the create needs the slave in sync first
    wait_until(lambda: bool(status(m)["replicas"]) and all(r["in_sync"] for r in status(m)["replicas"]), what="in sync")
    with BrokerClient(m.address) as c:
        c.create_topic("t", queues=QUEUES)
    return m, s


def test_upload_never_passes_the_confirm_offset_while_the_slave_is_paused(spawn: Callable[..., DaemonProcess],
                                                                         tmp_path: Path) -> None:
    """SIGSTOP the slave: ack=leader writes go on, the confirm offset stalls, and so does the upload."""
    root = str(tmp_path / "tiered")
    m, s = _pair(spawn, root)
    backend = PosixBackend(root)
    sender = Sender([m.address], "t", "replica")
    sender.start()
    wait_until(lambda: len(objects(backend)) >= 3, what="first uploads")
    sender.stop.set()
    sender.join(10)
    assert s.proc is not None
    os.kill(s.proc.pid, signal.SIGSTOP)
    try:
        paused = Sender([m.address], "t", "leader")
        paused.start()

        def upload_within_confirm() -> bool:
            st = status(m)
            newest = max(o.end for o in objects(backend))
            confirm = int(st["confirm_offset"])
            assert int(st["tiered_uploaded_offset"]) <= confirm, st
            assert newest <= int(status(m)["confirm_offset"]), f"object up to {newest} passes confirm {confirm}"
            return True

        samples = holds_for(upload_within_confirm, 4, "the upload within the confirm offset")
        paused.stop.set()
        paused.join(10)
        st = status(m)
        assert int(st["max_offset"]) - int(st["confirm_offset"]) > 1 << 20, "the confirm offset did not stall"
        assert max(o.end for o in objects(backend)) <= int(st["confirm_offset"])
        assert samples > 20 and len(paused.acked) > 1000
    finally:
        os.kill(s.proc.pid, signal.SIGCONT)
    wait_until(lambda: status(m)["confirm_offset"] == status(m)["max_offset"], what="confirm after resume")
    wait_until(lambda: caught_up(m), what="upload after resume")
    _, stored = check_chain(backend)
    start, local = log_bytes(m)
    assert start == 0 and stored == local[: len(stored)]
    wait_until(lambda: status(s)["tiered_uploaded_offset"] >= status(m)["tiered_uploaded_offset"], what="progress on the slave")


@pytest.mark.parametrize("crash_point", ["tiered_before_put", "tiered_after_put", "posix_before_link", "tiered_after_record"])
def test_master_killed_mid_upload_promoted_slave_resumes_at_the_break_point(
        spawn: Callable[..., DaemonProcess], tmp_path: Path, crash_point: str) -> None:
    """The master dies at its 5th upload; the promoted slave resumes with no gap, overlap or partial object."""
    root = str(tmp_path / "tiered")
    insync = {"replication.min_insync_replicas": 2}
    m, s = _pair(spawn, root, {"TIDEMARK_FAILPOINTS": f"{crash_point}=exit@5"}, **insync)
    old_node = status(m)["node_id"]
    sender = Sender([m.address, s.address], "t", "replica")
    sender.start()
    assert m.proc is not None
    m.proc.wait(60)  # the failpoint killed it
    backend = PosixBackend(root)
    by_old = [o for o in objects(backend) if backend.head(o.key).metadata["tm-node"] == old_node]  # type: ignore[union-attr]
    assert len(by_old) == (5 if crash_point in ("tiered_after_put", "tiered_after_record") else 4)
    promote_while_sending(s, sender)
    sender.stop.set()
    sender.join(30)
    wait_until(lambda: caught_up(s), what="upload on the new master")
    objs, stored = check_chain(backend)
    assert objs[0].start == 0
    start, local = log_bytes(s)
    assert start == 0 and stored == local[: len(stored)], "object bytes differ from the log"
    assert len(stored) >= len(local) - 512
    assert any(backend.head(o.key).metadata["tm-node"] != old_node for o in objs)  # type: ignore[union-attr]
    # the new master started exactly at the end of the old master's last object, and recorded that
    with BrokerClient(s.address) as c:
        meta = c.pull("__metadata", 0, 0, max_messages=100_000)
    records = [json.loads(m_.body) for m_ in meta if m_.key == "tiered.uploaded"]
    resumed = [r for r in records if r.get("resumed")]
    if crash_point == "tiered_after_put":
        assert [r["end"] for r in resumed] == [by_old[-1].end]  # uploaded but never recorded by the old master
    ends = [r["end"] for r in records]
    assert ends == sorted(ends) and len(set(ends)) == len(ends)
    assert sorted(read_all(s.address, "t", QUEUES)) == sorted(set(read_all(s.address, "t", QUEUES)))
    assert set(sender.acked) <= set(read_all(s.address, "t", QUEUES))
