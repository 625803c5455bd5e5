"""Many concurrent topic creates (issue 13): each acknowledged create is durable, visible at once
(a send right after it succeeds) and survives a power cut, while queue files are created lazily."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from broker.client import BrokerClient, BrokerError, Message
from tests.crashutil import drop_unsynced_bytes
from tests.procs import DaemonProcess
from tests.waits import wait_until

QUEUES = 4
CREATORS = 8
CONFIG = {"checkpoint.interval_ms": 20}  # checkpoints (and their directory syncs) all through the run


def _creator(address: str, index: int, created: list[str], sent: list[bytes], stop: threading.Event) -> None:
    """Create topics one call each; send one message to every third one right after its create."""
    try:
        with BrokerClient(address, timeout_s=5) as c:
            n = 0
            while not stop.is_set():
                name = f"c{index}-{n}"
                c.create_topic(name, queues=QUEUES)
                created.append(name)
                if n % 3 == 0:  # visible at once: the send needs the metadata view to know the topic
                    body = f"{name}/first".encode()
                    c.send(name, [Message(body, key=str(n))], ack="flush")
                    sent.append(body)
                n += 1
    except BrokerError:
        return  # the daemon was killed


def test_concurrent_creates_survive_a_power_cut(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Eight clients create topics at once; after kill -9 and dropping every unsynced byte, every
    acknowledged topic exists with its queues and every acknowledged first message is readable."""

    journal = str(tmp_path / "fsync.journal")
    d = spawn("node", config=CONFIG, env={"TIDEMARK_FSYNC_JOURNAL": journal})
    created: list[list[str]] = [[] for _ in range(CREATORS)]
    sent: list[bytes] = []
    stop = threading.Event()
    threads = [threading.Thread(target=_creator, args=(d.address, i, created[i], sent, stop), daemon=True)
               for i in range(CREATORS)]
    for t in threads:
        t.start()
    wait_until(lambda: sum(map(len, created)) >= 300, 60, "300 acknowledged creates")
    d.kill9()
    stop.set()
    for t in threads:
        t.join(30)
    acked = sorted(n for names in created for n in names)
    drop_unsynced_bytes(journal)
    d.start()
    with BrokerClient(d.address) as c:
        topics = c.list_topics()
        missing = [n for n in acked if n not in topics]
        assert not missing, f"{len(missing)} acknowledged topics lost, e.g. {missing[:5]}"
        assert all(topics[n]["queues"] == QUEUES for n in acked)
        got = sorted(b for n in acked for q in range(QUEUES) for b in c.pull(n, q, 0, max_messages=10).bodies())
        assert set(sent) <= set(got), "an acknowledged first message was lost"
        quiet = next(n for n in acked if int(n.rsplit("-", 1)[1]) % 3)  # no first message: no queue file yet
        for i in range(QUEUES):  # keyless calls rotate over the queues
            c.send(quiet, [Message(f"late-{i}".encode())], ack="flush")
        want = [f"late-{i}".encode() for i in range(QUEUES)]
        wait_until(lambda: sorted(b for q in range(QUEUES) for b in c.pull(quiet, q, 0, max_messages=10).bodies()),
                   10, "the sends after the restart to be readable", accept=lambda got: got == want)
    assert d.stop() == 0
    verify = subprocess.run([sys.executable, "-m", "broker.cli", "log", "verify", d.data_dir],
                            check=False, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout
