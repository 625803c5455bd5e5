"""Timer messages on real daemons: kill -9 in the middle of firing and of snapshot writes, power
loss, a corrupt newest snapshot, a crash between deliveries and their fired events, cancels
racing with firing, a promoted slave. Each checks: every timer fired exactly once, none early."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import crc32c
import grpc
import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import BrokerClient, BrokerError, Message
from broker.logformat import batch as bf
from broker.storage import atomic_file
from broker.timers import snapshot as snaps
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.crashutil import drop_unsynced_bytes
from tests.failoverutil import coordinated, in_sync, wait_master
from tests.procs import DaemonProcess
from tests.waits import wait_until

CONFIG = {"checkpoint.interval_ms": 50, "timer.snapshot_interval_ms": 200, "timer.precision_ms": 100,
          "commitlog.segment_bytes": 256 * 1024, "timer.log_segment_bytes": 64 * 1024}
QUEUES = 2


def _schedule(address: str, count: int, window_ms: int, lead_ms: int = 1500) -> dict[int, int]:
    """Schedule ``count`` timers due over ``window_ms`` after ``lead_ms``; {timer_offset: deliver_at_ms}."""
    out: dict[int, int] = {}
    start = int(time.time() * 1000) + lead_ms
    with BrokerClient(address) as c:
        for first in range(0, count, 500):
            msgs = [Message(body=b"timer-%d" % i, key=str(i % 7), properties={"i": str(i)},
                            deliver_at_ms=start + (i * window_ms) // count) for i in range(first, min(count, first + 500))]
            for r in c.send("t", msgs, ack="replica"):
                assert r.timer_offset is not None and r.queue_offset == -1
                out[r.timer_offset] = r.deliver_at_ms or 0
    return out


def _delivered(address: str) -> list[tuple[int, int, int]]:
    """(timer_offset, deliver_at_ms, store_time_ms) of every message in topic t."""
    got: list[tuple[int, int, int]] = []
    with BrokerClient(address) as c:
        for q in range(QUEUES):
            for res in c.iter_pull("t", q, 0, max_messages=5000):
                for m in res:
                    assert m.timer_offset is not None and m.properties.get("i") is not None
                    got.append((m.timer_offset, m.deliver_at_ms or 0, m.store_time_ms))
    return got


def _fired_events(address: str) -> Counter[int]:
    events: Counter[int] = Counter()
    with BrokerClient(address) as c:
        for res in c.iter_pull("__timer", 0, 0, max_messages=20_000):
            for m in res:
                p = m._all_properties()
                if p.get("__event") == "fired":
                    events[int(p["__timer_offset"])] += 1
    return events


def _wait_all_fired(address: str, timers: dict[int, int], timeout_s: float = 60, expect: int | None = None) -> None:
    """Until nothing is pending, every due time has passed and as many deliveries as timers are
    readable (the counts and the queues become visible in the same round, not the same instant)."""
    want = len(timers) if expect is None else expect
    with BrokerClient(address) as c:
        wait_until(lambda: (c.status()["timer_pending"] == 0 and time.time() * 1000 > max(timers.values()) + 300
                            and len(_delivered(address)) >= want), timeout_s, f"{want} timers fired", poll_s=0.2,
                   observe=lambda: {"timers pending": c.status()["timer_pending"], "delivered": len(_delivered(address))})


def _check_exactly_once(address: str, timers: dict[int, int]) -> None:
    got = _delivered(address)
    counts = Counter(off for off, _, _ in got)
    twice = [off for off, n in counts.items() if n > 1]
    assert not twice, f"{len(twice)} timers delivered more than once"
    assert set(counts) == set(timers), f"{len(set(timers) - set(counts))} timers never delivered"
    early = [(off, at, t) for off, at, t in got if t < at]
    assert not early, f"delivered early: {early[:5]}"
    assert all(timers[off] == at for off, at, _ in got)
    events = _fired_events(address)
    assert set(events) == set(timers) and max(events.values()) == 1, "one fired event per timer"


def _setup(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> tuple[DaemonProcess, str]:
    journal = str(tmp_path / "fsync.journal")
    d = spawn("node", config=CONFIG, env={"TIDEMARK_FSYNC_JOURNAL": journal})
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=QUEUES)
    return d, journal


FIRING_FAILPOINTS = ["timer_before_fire=exit@3", "timer_after_fire=exit@3", "timer_before_snapshot=exit@6",
                     "timer_after_snapshot=exit@6", "views_after_checkpoint=exit@40"]


@pytest.mark.parametrize("power_loss", [False, True], ids=["kill9", "power_loss"])
@pytest.mark.parametrize("failpoint", FIRING_FAILPOINTS)
def test_crash_while_firing_fires_each_timer_once(spawn: Callable[..., DaemonProcess], tmp_path: Path,
                                                   failpoint: str, power_loss: bool) -> None:
    d, journal = _setup(spawn, tmp_path)
    d.stop()
    d.env["TIDEMARK_FAILPOINTS"] = failpoint
    d.start()
    timers = _schedule(d.address, 3000, 2500)
    assert d.proc is not None
    assert d.proc.wait(60) == -9, f"the daemon should die at {failpoint}"
    if power_loss:
        drop_unsynced_bytes(journal)
    d.env.pop("TIDEMARK_FAILPOINTS")
    d.start()
    _wait_all_fired(d.address, timers)
    _check_exactly_once(d.address, timers)
    assert d.stop() == 0
    verify = subprocess.run([sys.executable, "-m", "broker.cli", "log", "verify", d.data_dir],
                            check=False, capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout


def test_corrupt_newest_snapshot_falls_back_to_the_older_one(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    d, _ = _setup(spawn, tmp_path)
    timers = _schedule(d.address, 2000, 3000, lead_ms=4000)
    snap_dir = os.path.join(d.data_dir, "timer", "snapshots")
    wait_until(lambda: _newest_snapshot_pending(snap_dir) == len(timers), 10,  # none fired yet
               "a wheel snapshot of all the pending timers", transient=lambda exc: isinstance(exc, FileNotFoundError))
    first = snaps.positions(snap_dir)[0]
    wait_until(lambda: os.path.exists(snaps.path_for(snap_dir, first) + ".bak") or snaps.positions(snap_dir)[0] != first,
               10, "a second copy of it (the next interval)")
    d.kill9()
    positions = snaps.positions(snap_dir)
    newest = snaps.path_for(snap_dir, positions[0])
    # the fallback is the previous snapshot, or the newest's own .bak when nothing changed since
    fallbacks = [f"snapshot@{p}+" for p in positions[1:2]]
    if os.path.exists(newest + ".bak"):
        fallbacks.append(f"snapshot@{positions[0]}+")
    assert fallbacks, "two snapshot copies should exist"
    with open(newest, "r+b") as f:
        f.seek(30)
        f.write(b"\xde\xad\xbe\xef")
    d.start()
    with BrokerClient(d.address) as c:
        assert c.status()["timer_wheel"]["loaded_from"].startswith(tuple(fallbacks))
    assert os.path.exists(snaps.path_for(snap_dir, positions[0]) + ".broken")
    _wait_all_fired(d.address, timers)
    _check_exactly_once(d.address, timers)


def _newest_snapshot_pending(snap_dir: str) -> int:

    positions = snaps.positions(snap_dir)
    if not positions:
        return -1
    with open(snaps.path_for(snap_dir, positions[0]), "rb") as f:
        return snaps.Snapshot.decode(atomic_file.decode(f.read(), snaps.MAGIC, snaps.VERSION).payload).pending


def test_fired_events_cut_off_by_a_crash_are_reappended(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Power cut inside the one write of a round: the deliveries survive, their fired events do not."""
    d, _ = _setup(spawn, tmp_path)
    d.stop()
    d.env["TIDEMARK_FAILPOINTS"] = "timer_after_fire=exit@2"
    d.start()
    timers = _schedule(d.address, 1000, 1000)
    assert d.proc is not None and d.proc.wait(60) == -9
    seg_dir = os.path.join(d.data_dir, "log")
    last = sorted(os.listdir(seg_dir))[-1]
    path = os.path.join(seg_dir, last)
    data = Path(path).read_bytes()
    pos = 0
    batches: list[tuple[int, bf.BatchHeader]] = []
    while pos < len(data):
        h = bf.decode_header(data, pos)
        batches.append((pos, h))
        pos += h.batch_bytes
    cut_at, tail = batches[-1]
    assert tail.topic == "__timer" and batches[-2][1].flags & bf.FLAG_TIMER_DELIVERY, "the round's last batch is its events"
    os.truncate(path, cut_at)
    d.env.pop("TIDEMARK_FAILPOINTS")
    d.start()
    _wait_all_fired(d.address, timers)
    _check_exactly_once(d.address, timers)
    assert "timer_fired_events_repaired" in Path(d.log_path).read_text()


def test_cancels_racing_with_firing_never_do_both(spawn: Callable[..., DaemonProcess]) -> None:
    d = spawn("node", config=CONFIG)
    with BrokerClient(d.address) as c:
        c.create_topic("t", queues=QUEUES)
        due = int(time.time() * 1000) + 1500
        receipts = list(c.send("t", [Message(body=b"r%d" % i, properties={"i": str(i)}, deliver_at_ms=due + (i % 5))
                                     for i in range(400)]))
    outcome: dict[int, str] = {}

    def cancel_some(part: list[int]) -> None:
        with BrokerClient(d.address) as cc:
            wait_until(lambda: time.time() * 1000 >= due - 30, 10, "30 ms before the timers are due", poll_s=0.001)
            for off in part:
                try:
                    cc.cancel_timer(off)
                    outcome[off] = "cancelled"
                except BrokerError as exc:
                    assert exc.code.name == "FAILED_PRECONDITION", exc
                    outcome[off] = "refused"

    offs = [r.timer_offset or 0 for r in receipts]
    threads = [threading.Thread(target=cancel_some, args=(offs[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    _wait_all_fired(d.address, {o: due + 5 for o in offs}, expect=sum(v == "refused" for v in outcome.values()))
    delivered = Counter(off for off, _, _ in _delivered(d.address))
    assert max(delivered.values(), default=1) == 1
    for off in offs:
        assert (outcome[off] == "cancelled") != (off in delivered), f"timer {off}: {outcome[off]}, delivered={off in delivered}"
    assert "cancelled" in outcome.values() and "refused" in outcome.values(), Counter(outcome.values())


def test_bad_timer_requests_get_clear_statuses(daemon: DaemonProcess) -> None:
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        with pytest.raises(BrokerError, match="max_delay_ms") as far:
            c.send("t", [Message(body=b"x", deliver_at_ms=int(time.time() * 1000) + 31 * 24 * 3600 * 1000)])
        assert far.value.code.name == "INVALID_ARGUMENT"
        with pytest.raises(BrokerError) as unknown:
            c.cancel_timer(123456)
        assert unknown.value.code.name == "NOT_FOUND"
        with pytest.raises(ValueError, match="reserved"):
            c.send("t", [Message(body=b"x", properties={"__topic": "y"}, deliver_at_ms=int(time.time() * 1000) + 5000)])
        r = c.send("t", [Message(body=b"now", deliver_at_ms=int(time.time() * 1000) - 10)])[0]
        assert r.timer_offset is None and r.queue_offset == 0  # already due: straight to its topic


    records, _ = bf.encode_records([(b"body", b"", bf.encode_props({"a": "b"}))])  # no __deliver_at_ms
    with grpc.insecure_channel(daemon.address) as ch:
        stub = pb_grpc.BrokerStub(ch)
        with pytest.raises(grpc.RpcError) as bad:
            stub.Send(pb.SendRequest(batches=[pb.ProduceBatch(topic="t", queue_id=0, record_count=1, records=records,
                                                              records_crc=crc32c.crc32c(records), delayed=True)]))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "__deliver_at_ms" in (bad.value.details() or "")


def test_cli_send_delay_and_cancel(daemon: DaemonProcess) -> None:
    def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "broker.cli", *args], input=stdin, capture_output=True,
                              text=True, timeout=60, check=False)

    assert cli("topic", "create", "t", "--broker", daemon.address).returncode == 0
    sent = cli("send", "t", "--broker", daemon.address, "--delay-ms", "60000", stdin="a\nb\n")
    assert sent.returncode == 0, sent.stderr

    receipts = [json.loads(line) for line in sent.stdout.splitlines()]
    assert len(receipts) == 2 and all(r["deliver_at_ms"] > time.time() * 1000 + 50_000 for r in receipts)
    ok = cli("cancel", "--broker", daemon.address, "--timer-offset", str(receipts[0]["timer_offset"]))
    assert ok.returncode == 0 and '"cancelled"' in ok.stdout
    again = cli("cancel", "--broker", daemon.address, "--timer-offset", str(receipts[0]["timer_offset"]))
    assert again.returncode == 1 and "FAILED_PRECONDITION" in again.stderr
    with BrokerClient(daemon.address) as c:
        assert c.status()["timer_pending"] == 1


def test_promoted_slave_fires_exactly_what_had_not_fired(spawn: Callable[..., DaemonProcess]) -> None:
    """The master dies in the middle of firing; the promoted slave fires the rest, none twice."""
    pair = {**CONFIG, "replication.min_insync_replicas": 2}
    m = spawn("m", config=pair, env={"TIDEMARK_FAILPOINTS": "timer_after_fire=exit@4"})
    s = spawn("s", config={**pair, "node.role": "slave", "node.master": m.address})
    with BrokerClient(m.address) as c:
        wait_until(lambda: all(r["in_sync"] for r in c.status()["replicas"] or [{"in_sync": False}]), 15,
                   "the slave in sync", poll_s=0.1, observe=lambda: c.status()["replicas"])
        c.create_topic("t", queues=QUEUES)  # min_insync_replicas = 2: only once the slave is in sync
    timers = _schedule(m.address, 2000, 2000)
    assert m.proc is not None and m.proc.wait(60) == -9
    with BrokerClient(s.address) as c:
        assert c.status()["timer_pending"] > 0, "the master should die before everything fired"
        c.promote()
    _wait_all_fired(s.address, timers)
    _check_exactly_once(s.address, timers)


def test_automatic_failover_fires_exactly_what_had_not_fired(spawn: Callable[..., DaemonProcess],
                                                             etcd: EtcdProcess) -> None:
    """The elected master dies in the middle of firing; etcd elects the slave, which fires the rest."""
    config = coordinated(etcd.endpoint, **CONFIG, **{"replication.min_insync_replicas": 2})
    m = spawn("m", config=config, env={"TIDEMARK_FAILPOINTS": "timer_after_fire=exit@4"})
    wait_master([m])  # alone in a new cluster: elected after a lease's time
    s = spawn("s", config=config)
    with BrokerClient(m.address) as c:
        wait_until(lambda: in_sync(m, s), 30, "the slave in sync", observe=lambda: c.status()["replicas"])
        c.create_topic("t", queues=QUEUES)
    timers = _schedule(m.address, 2000, 2000)
    assert m.proc is not None and m.proc.wait(60) == -9
    wait_master([m, s], among=[s])
    with BrokerClient(s.address) as c:
        assert c.status()["epoch"] == 2
    _wait_all_fired(s.address, timers)
    _check_exactly_once(s.address, timers)


def test_a_slave_bootstrapped_with_pending_timers_fires_them_after_promotion(spawn: Callable[..., DaemonProcess]) -> None:
    """The snapshot bundle carries the wheel: timers scheduled before the slave existed still fire once."""
    m = spawn("m", config=CONFIG)
    with BrokerClient(m.address) as c:
        c.create_topic("t", queues=QUEUES)
    timers = _schedule(m.address, 1000, 1000, lead_ms=3000)
    s = spawn("s", config={**CONFIG, "node.role": "slave", "node.master": m.address})
    with BrokerClient(s.address) as c:
        wait_until(lambda: c.status()["timer_pending"] == len(timers), 15, "the slave knowing every pending timer",
                   observe=lambda: c.status()["timer_pending"])
        assert c.status()["timer_wheel"]["pending"] == len(timers)
    m.kill9()
    with BrokerClient(s.address) as c:
        c.promote(unclean=True)  # the master is gone; the slave had everything (checked above)
    assert "bootstrapped" in Path(s.log_path).read_text()
    _wait_all_fired(s.address, timers)
    _check_exactly_once(s.address, timers)
