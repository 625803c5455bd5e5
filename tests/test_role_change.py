"""A promote/demote survives a restart: a configuration that contradicts it is refused (no second master)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from broker.client import BrokerClient, Message
from replication.role_record import FILE_NAME
from tests.procs import DaemonProcess, free_port
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
