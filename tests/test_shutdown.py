"""SIGTERM under load: every acknowledged message survives and the next start is clean (no replay)."""

from __future__ import annotations

import os
import signal
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from broker.client import BrokerClient, BrokerError, Message
from tests.procs import DaemonProcess
from tests.waits import wait_until

Spawn = Callable[..., DaemonProcess]
PRODUCERS = 3
BATCH = 50


def _produce(address: str, name: str, acked: dict[bytes, tuple[int, int]], stop: threading.Event,
             errors: list[str], lock: threading.Lock) -> None:
    with BrokerClient(address, timeout_s=10) as c:
        i = 0
        while not stop.is_set():
            bodies = [f"{name}-{i + k}".encode() for k in range(BATCH)]
            try:
                receipts = c.send("load", [Message(body=b, key=f"{name}-{i + k}") for k, b in enumerate(bodies)],
                                  ack="flush")
            except BrokerError as exc:
                errors.append(exc.code.name)
                return
            with lock:
                for b, r in zip(bodies, receipts, strict=True):
                    acked[b] = (r.queue_id, r.queue_offset)
            i += BATCH


def test_sigterm_under_load_loses_nothing_and_restarts_clean(spawn: Spawn) -> None:
    """Producers with ack=flush while SIGTERM arrives: exit 0, all acked messages at their receipts, clean start."""
    d = spawn("node")
    with BrokerClient(d.address) as c:
        c.create_topic("load", queues=4)
    acked: dict[bytes, tuple[int, int]] = {}
    errors: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    threads = [threading.Thread(target=_produce, args=(d.address, f"p{n}", acked, stop, errors, lock))
               for n in range(PRODUCERS)]
    for t in threads:
        t.start()

    def acked_by_each() -> list[int]:
        with lock:
            return [sum(1 for b in acked if b.startswith(b"p%d-" % n)) for n in range(PRODUCERS)]

    wait_until(acked_by_each, 30, "ten batches acknowledged to each producer", accept=lambda n: min(n) >= 10 * BATCH)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    code = d.wait_exit(60)
    stop.set()
    for t in threads:
        t.join(60)
    assert code == 0
    assert len(acked) >= 500, len(acked)
    assert errors and set(errors) <= {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"}, errors  # sends were in flight
    assert "stopped" in d.tail_log(5) and "clean=True" in d.tail_log(5)
    assert "Traceback" not in d.tail_log(10_000), "the stop printed a traceback"

    d.start()
    with BrokerClient(d.address) as c:
        report = c.status()["recovery"]
        assert report["clean"] is True and report["scanned_bytes"] == 0 and report["replayed_bytes"] == 0, report
        assert report["truncated_bytes"] == 0
        found: dict[bytes, tuple[int, int]] = {}
        for q in range(4):
            for res in c.iter_pull("load", q, 0, max_messages=10_000):
                for m in res:
                    found[m.body] = (m.queue_id, m.queue_offset)
    missing = [b for b, where in acked.items() if found.get(b) != where]
    assert not missing, f"{len(missing)} acknowledged messages lost or moved, e.g. {missing[:3]}"


def test_data_directory_is_private(spawn: Spawn) -> None:
    """The data directory is 0700 and nothing the daemon writes is readable by group or others (umask 077)."""
    d = spawn("node")
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        c.send("t", [Message(body=b"secret")], ack="flush")
    assert d.stop() == 0
    root = Path(d.data_dir)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    exposed = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            mode = stat.S_IMODE(os.lstat(os.path.join(dirpath, name)).st_mode)
            if mode & 0o077:
                exposed.append((os.path.join(dirpath, name), oct(mode)))
    assert not exposed, exposed
