"""A promote/demote survives a restart: a configuration that contradicts it is refused (no second master)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from broker.client import BrokerClient, Message
from broker.store.incidents import Incidents
from broker.threads import NamedThread
from replication.role_record import FILE_NAME
from tests.procs import DaemonProcess, free_port
from tests.tieredutil import tiered_config
from tests.waits import wait_until

Spawn = Callable[..., DaemonProcess]


def test_restart_with_a_stale_role_is_refused_until_the_config_agrees(spawn: Spawn) -> None:
    """Switchover (demote, then promote), stop both: the old configs exit 2 naming the fix; edited configs start."""
    m_repl, s_repl = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    m = spawn("m", config={"replication.listen": m_repl})
    s = spawn("s", config={"replication.listen": s_repl, "node.role": "slave", "node.master": m_repl})
    with BrokerClient(m.address) as c:
        c.create_topic("t")
        c.send("t", [Message(body=b"before")], ack="replica")
        c.demote(master=s_repl)
    with BrokerClient(s.address) as c:
        assert c.promote() == 2  # within replication.max_lag_ms of hearing from m: clean
        c.send("t", [Message(body=b"after")], ack="replica")
    assert m.stop() == 0 and s.stop() == 0
    assert (Path(m.data_dir) / FILE_NAME).exists() and (Path(s.data_dir) / FILE_NAME).exists()

    for node, became in ((m, f"a slave of {s_repl} at run time (epoch 1"), (s, "master at run time (epoch 2")):
        node.start(wait=False)
        assert node.wait_exit(60) == 2
        last = node.tail_log(1)
        assert f"node.role: this node became {became}" in last, last

    s.config = {"replication.listen": s_repl, "node.role": "master"}
    m.config = {"replication.listen": m_repl, "node.role": "slave", "node.master": s_repl}
    s.start()
    m.start()
    assert not (Path(m.data_dir) / FILE_NAME).exists() and not (Path(s.data_dir) / FILE_NAME).exists()
    with BrokerClient(s.address) as c:
        c.send("t", [Message(body=b"restarted")], ack="replica")
        end = c.status()["max_offset"]
    with BrokerClient(m.address) as c:
        wait_until(lambda: c.status()["confirm_offset"] == end, 20, "the restarted slave confirming the new end",
                   observe=c.status)
        assert [x.body for x in c.pull("t", 0, 0)] == [b"before", b"after", b"restarted"]


def test_a_promote_retires_the_incident_of_the_follower_it_stopped(spawn: Spawn) -> None:
    """Demoted to follow a master that is not there, then promoted --unclean: status no longer shows
    the stopped follower's error as active (it kept its count)."""
    node = spawn("n")
    with BrokerClient(node.address) as c:
        c.demote(master=f"127.0.0.1:{free_port()}")  # nobody listens there: the follower fails and says so
        wait_until(lambda: c.status()["errors"].get("follower", {}).get("active") is True, 20,
                   "the follower's failure recorded", observe=c.status)
        assert c.promote(unclean=True) == 2
        st = c.status()
        assert st["role"] == "master"
        assert st["errors"]["follower"]["active"] is False, st["errors"]
        assert st["errors"]["follower"]["error"] == "" and st["errors"]["follower"]["count"] >= 1


def test_a_demote_retires_the_incident_of_the_uploader_it_stopped(spawn: Spawn, tmp_path: Path) -> None:
    """A master whose tiered uploads fail (its root became a file) is demoted: the uploader stops,
    and status no longer shows its error as active."""
    root = tmp_path / "tiered"
    node = spawn("n", config=tiered_config(str(root)))
    with BrokerClient(node.address) as c:
        c.create_topic("t")
        c.send("t", [Message(b"x" * 1000)] * 100, ack="flush")
        shutil.rmtree(root)
        root.write_bytes(b"not a directory")
        wait_until(lambda: c.status()["errors"].get("tiered_uploader", {}).get("active") is True, 20,
                   "the uploader's failure recorded", observe=c.status)
        c.demote(master=f"127.0.0.1:{free_port()}")
        st = c.status()
        assert st["role"] == "slave"
        assert st["errors"]["tiered_uploader"]["active"] is False, st["errors"]


def test_retiring_keeps_the_incidents_of_loops_that_still_run() -> None:
    """Only an incident whose recording thread ended is retired; one a live loop (or a caller) recorded stays active."""
    incidents = Incidents()
    ended = NamedThread(target=incidents.record, args=("follower", "UNAVAILABLE: gone"))
    ended.start()
    ended.join()
    incidents.record("coordinator", "etcd unreachable")  # this thread goes on: it may still clear it
    incidents.retire_ended("a role change")
    snap = incidents.snapshot()
    assert snap["follower"]["active"] is False and snap["follower"]["count"] == 1
    assert snap["coordinator"]["active"] is True
    ended = NamedThread(target=incidents.record, args=("follower", "UNAVAILABLE: again"))
    ended.start()
    ended.join()
    again = incidents.snapshot()["follower"]
    assert again["active"] is True and again["count"] == 2 and again["error"] == "UNAVAILABLE: again"
