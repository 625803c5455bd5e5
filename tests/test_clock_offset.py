"""The daemon's wall clock can be stepped without touching the host's (TIDEMARK_CLOCK_OFFSET_FILE,
broker/clock.py): what the chaos harness's clock jumps use. A real daemon; timers follow the
node's clock, both ways, and never fire before they are due on it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from broker.client import BrokerClient, Message
from tests.procs import DaemonProcess
from tests.waits import wait_until


def test_timers_and_store_times_follow_a_stepped_node_clock(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    offset = tmp_path / "clock-offset"
    offset.write_text("-5000\n")  # the node's clock starts 5 s behind the host's
    d = spawn("node", env={"TIDEMARK_CLOCK_OFFSET_FILE": str(offset)})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        due = int(time.time() * 1000) + 1_000  # due in 1 s of host time: 6 s of the node's
        c.send("t", [Message(b"late", deliver_at_ms=due)], ack="flush")
        time.sleep(3.5)
        assert not list(c.pull("t", 0, 0))  # due on the host's clock, not yet on the node's
        (m,) = wait_until(lambda: list(c.pull("t", 0, 0, max_wait_ms=500)), 10, "the timer fired on the node's clock")
        assert time.time() * 1000 >= due + 4_500 and m.store_time_ms >= due  # late, never early

        due = int(time.time() * 1000) + 20_000
        c.send("t", [Message(b"in 20 s", deliver_at_ms=due)], ack="flush")
        time.sleep(0.5)
        assert len(list(c.pull("t", 0, 0))) == 1
        offset.write_text("25000\n")  # the node's clock steps 30 s ahead
        t0 = time.time()
        wait_until(lambda: len(list(c.pull("t", 0, 0, max_wait_ms=500))) == 2, 10, "the timer fired on the stepped clock")
        m = next(iter(c.pull("t", 0, 1)))
        assert time.time() - t0 < 5 and m.body == b"in 20 s" and m.deliver_at_ms == due
        assert m.store_time_ms >= due  # never early on the node's own clock
        (plain,) = c.send("t", [Message(b"now")], ack="flush")
        got = next(iter(c.pull("t", 0, plain.queue_offset)))
        assert 24_000 < got.store_time_ms - time.time() * 1000 < 26_500  # stamped 25 s ahead


def test_a_timer_sent_after_the_node_clock_stepped_back_fires_when_due(spawn: Callable[..., DaemonProcess],
                                                                       tmp_path: Path) -> None:
    """A clock stepped ahead moves the firing cursor ahead; stepped back, the cursor must come back
    with it. The chaos harness found 695 acknowledged timers (seed 451366008) not fired 5-15 s after
    they were due: their master's clock had just come back from 23.7 s ahead, and the cursor and its
    once-a-second sweep waited for the clock to catch up (the timers would have fired 23.7 s late)."""
    offset = tmp_path / "clock-offset"
    offset.write_text("0\n")
    d = spawn("node", env={"TIDEMARK_CLOCK_OFFSET_FILE": str(offset)})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=1)
        offset.write_text("20000\n")  # 20 s ahead: the cursor walks there
        time.sleep(0.2)  # the daemon looks at the file every 50 ms
        (ahead,) = c.send("t", [Message(b"stamped ahead")], ack="flush")
        assert next(iter(c.pull("t", 0, ahead.queue_offset))).store_time_ms - time.time() * 1000 > 18_000
        time.sleep(1.0)
        offset.write_text("0\n")  # and back
        time.sleep(0.5)
        due = int(time.time() * 1000) + 1_000
        c.send("t", [Message(b"due in 1 s", deliver_at_ms=due)], ack="flush")
        m = wait_until(lambda: next(iter(c.pull("t", 0, ahead.queue_offset + 1, max_wait_ms=500)), None), 15,
                       "the timer fired", accept=lambda m: m is not None and m.body == b"due in 1 s")
        fired_after_ms = time.time() * 1000 - due
        assert m.store_time_ms >= due and fired_after_ms < 3_000, fired_after_ms
