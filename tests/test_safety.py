"""Safe by default (DESIGN §10): what an operator can mistype or a stranger can send loses nothing."""

from __future__ import annotations

import errno
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker.client import BrokerClient, BrokerError, Message
from broker.daemon.failures import unexpected as _unexpected
from broker.store.incidents import Incidents
from broker.store.offset_buffer import OffsetBuffer
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from replication.master_loop import STREAMS_MAX
from tests.procs import ArgvDaemon, DaemonProcess, free_port
from tests.waits import wait_until


def _cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, check=False)


def test_a_second_daemon_on_a_locked_directory_exits_with_one_line(spawn: Callable[..., DaemonProcess]) -> None:
    """Two daemons on one directory: the second refuses (exit 1, one line naming the holder's pid);
    the first keeps serving, and what it acknowledged is all there after a restart."""
    first = spawn("n")
    with BrokerClient(first.address) as c:
        c.create_topic("t")
        c.send("t", [Message(b"%d" % i) for i in range(200)], ack="flush")
    second = spawn("n", start=False, log_path=first.log_path + ".second")  # the same directory, another port
    second.start(wait=False)
    code = second.wait_exit(30)
    lines = [line for line in second.tail_log(50).splitlines() if line.strip()]
    assert code == 1
    assert lines[-1] == f"tidemark: refusing to start: data directory {first.data_dir} is in use by pid {first.proc.pid}"  # type: ignore[union-attr]
    assert not any("Traceback" in line for line in lines)
    with BrokerClient(first.address) as c:
        c.send("t", [Message(b"after")], ack="flush")
    first.kill9()
    first.start()
    with BrokerClient(first.address) as c:
        assert len(c.pull("t", 0, 0, max_messages=1000)) == 201


def test_log_verify_reads_a_live_directory_and_says_so(spawn: Callable[..., DaemonProcess]) -> None:
    """``log verify`` on a directory a daemon holds: no write, a note naming the pid, a clean check."""
    d = spawn("n")
    with BrokerClient(d.address) as c:
        c.create_topic("t")
        c.send("t", [Message(b"x" * 100)] * 50, ack="flush")
    r = _cli("log", "verify", d.data_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"in use by pid {d.proc.pid}" in r.stderr  # type: ignore[union-attr]
    assert "0 problems" in r.stdout


# -- protected mode ------------------------------------------------------------------------------------
def test_a_non_loopback_port_without_protection_refuses_to_start(tmp_path: Path) -> None:
    """Protected mode: 0.0.0.0 without TLS or tokens exits 2 with one line naming the keys, and the
    data directory is never created; with security.insecure_network it serves and says so."""
    r = _cli("serve", "--data-dir", str(tmp_path / "d"), "--listen", f"0.0.0.0:{free_port()}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("tidemark: node.listen: 0.0.0.0:")
    assert "tls.cert_file" in r.stderr and "auth.tokens_file" in r.stderr and "security.insecure_network" in r.stderr
    assert not (tmp_path / "d").exists()


def test_insecure_network_serves_with_a_warning(spawn: Callable[..., DaemonProcess]) -> None:
    """security.insecure_network = true: it starts, warns in the log, shows it in status and metrics."""
    port = free_port()
    d = spawn("n", port=port, start=False, config={"security.insecure_network": "true",
                                                   "node.metrics_listen": f"127.0.0.1:{free_port()}"})
    d.address = f"127.0.0.1:{port}"
    d.command = lambda: [sys.executable, "-m", "broker.cli", "serve", "--data-dir", d.data_dir,  # type: ignore[method-assign]
                         "--listen", f"0.0.0.0:{port}"]
    d.start()
    with BrokerClient(d.address) as c:
        assert c.status()["security"]["insecure_network"] == ["node.listen"]
    assert "insecure_network" in Path(d.log_path).read_text()


# -- tokens with roles ---------------------------------------------------------------------------------
TOKEN_OPS = "ops-token-0123456789"
TOKEN_APP = "app-token-0123456789"
TOKEN_NEW = "new-token-0123456789"


def _tokens(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "tokens"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_roles_decide_each_call_and_system_topics_need_the_system_role(spawn: Callable[..., DaemonProcess],
                                                                     tmp_path: Path) -> None:
    """A read/write token sends but cannot create topics or read __timer (users' delayed messages);
    the admin/system token can; two tokens are valid at once; anonymous callers only read user topics."""
    tokens = _tokens(tmp_path, f"ops admin,system,read,write {TOKEN_OPS}", f"app read,write {TOKEN_APP}")
    d = spawn("n", config={"auth.tokens_file": tokens})
    with BrokerClient(d.address, token=TOKEN_OPS) as ops, BrokerClient(d.address, token=TOKEN_APP) as app, \
            BrokerClient(d.address) as anon:
        ops.create_topic("t")
        with pytest.raises(BrokerError) as denied:
            app.create_topic("u")
        assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED and "admin" in denied.value.details
        app.send("t", [Message(b"now"), Message(b"later", deliver_at_ms=int(time.time() * 1000) + 60_000)])
        wait_until(lambda: len(anon.pull("t", 0, 0)) == 1, 10, what="the send to be readable")  # views apply after acks
        for client in (app, anon):
            for local_reads in (False, True):  # PullLocal (the segment files' spans) is checked as Pull is
                with pytest.raises(BrokerError) as hidden:
                    client.pull("__timer", 0, 0, local_reads=local_reads)
                assert hidden.value.code == grpc.StatusCode.PERMISSION_DENIED and "system role" in hidden.value.details
        wait_until(lambda: len(ops.pull("__timer", 0, 0)) == 1, 10, what="the scheduled record to be readable")
        assert len(ops.pull("__timer", 0, 0, local_reads=True)) == 1
        with pytest.raises(BrokerError) as unauthenticated:
            anon.send("t", [Message(b"x")])
        assert unauthenticated.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_tokens_rotate_with_both_valid_in_between(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Rotation: add the new token (SIGHUP), both work; remove the old (SIGHUP), only the new works."""
    tokens = _tokens(tmp_path, f"app read,write,admin {TOKEN_APP}")
    d = spawn("n", config={"auth.tokens_file": tokens})
    with BrokerClient(d.address, token=TOKEN_APP) as c:
        c.create_topic("t")

    def works(token: str) -> bool:
        with BrokerClient(d.address, token=token) as c:
            try:
                c.send("t", [Message(b"x")])
            except BrokerError:
                return False
            return True

    _tokens(tmp_path, f"app read,write {TOKEN_APP}", f"app2 read,write {TOKEN_NEW}")
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: works(TOKEN_NEW), 10, what="the new token to be accepted")
    assert works(TOKEN_APP)
    _tokens(tmp_path, f"app2 read,write {TOKEN_NEW}")
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: not works(TOKEN_APP), 10, what="the old token to be refused")
    assert works(TOKEN_NEW)
    assert TOKEN_APP not in Path(d.log_path).read_text() and TOKEN_NEW not in Path(d.log_path).read_text()


# -- a fake replica ------------------------------------------------------------------------------------
def _fake_replica(address: str, cluster_id: str, epoch: int, ack: int | None,
                  metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode | None:
    """Open a replication stream as a made-up slave; optionally acknowledge ``ack``; the stream's end code."""
    sent = queue.Queue[pb.SlaveMessage]()
    sent.put(pb.SlaveMessage(hello=pb.Hello(protocol_version=1, cluster_id=cluster_id, node_id="intruder",
                                            epochs=[pb.EpochEntry(epoch=epoch, start_offset=0)] if epoch else [],
                                            log_end=0, address="127.0.0.1:1")))

    def outgoing() -> Iterator[pb.SlaveMessage]:
        while True:
            msg = sent.get()
            if msg is None:
                return
            yield msg

    with grpc.insecure_channel(address) as ch:
        try:
            for msg in pb_grpc.ReplicationStub(ch).Stream(outgoing(), timeout=5, metadata=metadata):
                if msg.WhichOneof("kind") == "data" and msg.data.batches and ack is not None:
                    sent.put(pb.SlaveMessage(ack=pb.ReplicaAck(flushed_offset=ack)))
                    ack = None
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
        finally:
            sent.put(None)  # type: ignore[arg-type]
    return None


def test_a_fake_replica_changes_nothing(spawn: Callable[..., DaemonProcess]) -> None:
    """Over the client port, with no credential: an ack beyond what was sent ends the stream and
    confirms nothing (ack=replica with min_insync_replicas = 2 stays refused); a Hello with epoch 99
    does not fence the master."""
    d = spawn("m", config={"replication.max_lag_ms": 500})
    with BrokerClient(d.address) as c:
        cluster = c.status()["cluster_id"]
        c.create_topic("t")  # metadata writes wait for replicas too: create it before asking for two
        end = c.status()["max_offset"]
    d.stop()
    d.config["replication.min_insync_replicas"] = 2
    d.start()
    code = _fake_replica(d.address, cluster, 0, ack=2**64 - 1)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    log_text = Path(d.log_path).read_text()
    assert "replication_protocol_violation" in log_text and "beyond" in log_text
    with BrokerClient(d.address) as c:
        assert all(r["acked_offset"] <= end for r in c.status()["replicas"])  # the claim was never counted
        # it leaves the in-sync set like a replica that went silent (after max_lag_ms), then the
        # master refuses ack=replica: nothing was ever confirmed on its word
        wait_until(lambda: not any(r["in_sync"] for r in c.status()["replicas"]), 10, what="the replica to expire",
                   observe=c.status)
        with pytest.raises(BrokerError) as refused:
            c.send("t", [Message(b"x")], ack="replica")
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert _fake_replica(d.address, cluster, 99, ack=None) == grpc.StatusCode.PERMISSION_DENIED
    with BrokerClient(d.address) as c:
        st = c.status()
        assert st["fenced"] == "" and st["role"] == "master"
        c.send("t", [Message(b"still a master")], ack="flush")


# -- one line, never a traceback -------------------------------------------------------------------------
def _one_line(r: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    for fragment in fragments:
        assert fragment in r.stderr, (fragment, r.stderr)


def test_start_up_failures_are_one_line(spawn: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """Ports in use, an unusable data directory, bad flag values: one line and the right exit code."""
    busy = spawn("busy")
    serve = ("serve", "--data-dir", str(tmp_path / "d"))
    _one_line(_cli(*serve, "--listen", busy.address), 1, "node.listen", "in use")
    _one_line(_cli(*serve, "--listen", f"127.0.0.1:{free_port()}", "--metrics-listen", busy.address), 1,
              "node.metrics_listen", "in use")
    assert not (tmp_path / "d").exists()  # ports are checked before the directory is touched
    (tmp_path / "file").write_text("not a directory")
    _one_line(_cli("serve", "--data-dir", str(tmp_path / "file" / "d"), "--listen", f"127.0.0.1:{free_port()}"), 1,
              "data directory", "Not a directory")
    _one_line(_cli(*serve, "--listen", "127.0.0.1:99999"), 2, "node.listen")
    for args, fragment in ((("topic", "create", "t", "--queues", "0"), "--queues"),
                           (("topic", "create", "t", "--queues", "-1"), "--queues"),
                           (("cancel", "--timer-offset", "-1"), "--timer-offset"),
                           (("topic", "list"), "")):
        port = "99999" if fragment == "" else str(busy.port)
        _one_line(_cli(*args, "--broker", f"127.0.0.1:{port}"), 2, fragment or "--broker")


def test_bad_requests_get_invalid_argument_and_short_echoes(daemon: DaemonProcess) -> None:
    """Undecodable bytes, a negative offset, a name ending in a newline, a 10 KB name: INVALID_ARGUMENT,
    with the name echoed at most 200 characters (never RESOURCE_EXHAUSTED from oversized metadata)."""
    with grpc.insecure_channel(daemon.address) as ch:
        raw = ch.unary_unary("/tidemark.v1.Broker/Pull", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as undecodable:
            raw(b"\xff\xff\xff", timeout=5)
        assert undecodable.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        with pytest.raises(BrokerError) as negative:
            c.pull("t", 0, -1)
        assert negative.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(BrokerError) as newline:
            c.create_topic("name\n")
        assert newline.value.code == grpc.StatusCode.INVALID_ARGUMENT
        for call in (lambda: c.create_topic("x" * 10_000), lambda: c.pull("y" * 10_000, 0, 0)):
            with pytest.raises(BrokerError) as long_name:
                call()
            assert long_name.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            assert len(long_name.value.details) < 400
        assert list(c.list_topics()) == ["t"]


# -- a slave whose disk fills ------------------------------------------------------------------------------
@pytest.mark.root
@pytest.mark.parametrize("min_free_bytes", [4 << 20, 0])
def test_a_slave_whose_disk_fills_catches_up_when_space_returns(spawn: Callable[..., DaemonProcess], small_fs: Path,
                                                               min_free_bytes: int) -> None:
    """The slave's disk fills (below storage.min_free_bytes, or a real ENOSPC): it keeps its process and
    stream, says "disk full" in status, and catches up byte for byte once space returns, no restart."""
    master = spawn("m", config={"commitlog.segment_bytes": 1 << 20})
    slave = spawn(str(small_fs / "s"), config={"node.role": "slave", "node.master": master.address,
                                                "storage.min_free_bytes": min_free_bytes,
                                                "commitlog.segment_bytes": 1 << 20})
    with BrokerClient(master.address) as c:
        c.create_topic("t")
    filler = small_fs / "filler"
    st = os.statvfs(small_fs)
    with open(filler, "wb") as f:  # leave 2 MiB: less than the master is about to write
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - (2 << 20)))
    with BrokerClient(master.address) as c:
        for i in range(30):
            c.send("t", [Message(b"%04d-" % i + b"x" * 4000) for _ in range(50)], ack="flush")
        end = c.status()["max_offset"]
    with BrokerClient(slave.address) as s:
        wait_until(lambda: "disk full" in s.status()["replication"]["error"], 30, what="the slave to report a full disk",
                   observe=s.status)
        assert s.status()["errors"]["follower"]["active"] is True
        assert s.status()["max_offset"] < end
        pid = slave.proc.pid  # type: ignore[union-attr]
        filler.unlink()
        wait_until(lambda: s.status()["max_offset"] == end, 60, what="the slave to catch up", observe=s.status)
        st2 = s.status()
        assert st2["replication"]["error"] == "" and st2["errors"]["follower"]["active"] is False
    assert slave.proc is not None and slave.proc.poll() is None and slave.proc.pid == pid
    assert _segments(master.data_dir) == _segments(slave.data_dir)


def _segments(data_dir: str) -> bytes:
    log_dir = Path(data_dir) / "log"
    return b"".join((log_dir / n).read_bytes() for n in sorted(os.listdir(log_dir)))


# -- bounded open files ------------------------------------------------------------------------------------
def test_many_queues_under_a_low_descriptor_limit(spawn: Callable[..., DaemonProcess]) -> None:
    """2,000 queues under ``ulimit -n 256``: every queue takes a message and gives it back, the daemon
    never holds more descriptors than its limit allows, and a kill -9 restart serves them all again."""
    d = spawn("n", start=False, config={"limits.open_files_max": 64})
    base = d.command
    d.command = lambda: ["prlimit", "--nofile=256:256", *base()]  # type: ignore[method-assign]
    d.start()
    topics = [f"t{i}" for i in range(500)]
    with BrokerClient(d.address) as c:
        for t in topics:
            c.create_topic(t, queues=4)
        for t in topics:
            c.send(t, [Message(b"%s-%d" % (t.encode(), q), key=str(q)) for q in range(8)], ack="flush")
        assert d.proc is not None
        fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        assert fds < 256, fds

        def everything() -> list[bytes]:
            return sorted(b for t in topics for q in range(4) for b in c.pull(t, q, 0).bodies())

        want = sorted(b"%s-%d" % (t.encode(), q) for t in topics for q in range(8))
        wait_until(lambda: everything() == want, 30, what="every message to be readable")
        assert len(os.listdir(f"/proc/{d.proc.pid}/fd")) < 256
    d.kill9()
    d.start()
    with BrokerClient(d.address) as c:
        assert sorted(b for t in topics for q in range(4) for b in c.pull(t, q, 0).bodies()) == want


def test_a_request_that_finds_the_process_out_of_descriptors_is_resource_exhausted() -> None:
    """Once every idle file was given back, what is left of the descriptor limit is held by sockets:
    a request that still cannot open a file is told RESOURCE_EXHAUSTED (retry later), not INTERNAL
    (a bug); any other unexpected failure stays INTERNAL."""
    for code in (errno.EMFILE, errno.ENFILE):
        refused = _unexpected(OSError(code, os.strerror(code)))
        assert refused.code == "RESOURCE_EXHAUSTED" and "file descriptors" in refused.message
    assert _unexpected(OSError(errno.EIO, os.strerror(errno.EIO))).code == "INTERNAL"
    assert _unexpected(ValueError("a bug")).code == "INTERNAL"


# -- long-polls hold no thread -------------------------------------------------------------------------------
def test_a_thousand_idle_long_polls_starve_nothing(daemon: DaemonProcess) -> None:
    """2,000 pulls parked on an empty queue (a burst beyond gRPC's default pending-call limit): health,
    status and ack=flush sends still answer at once; one message then wakes every pull; a pull beyond
    the end is refused at once, not after its wait."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("idle")
        c.create_topic("busy")
    channels = [grpc.insecure_channel(daemon.address) for _ in range(4)]
    try:
        stubs = [pb_grpc.BrokerStub(ch) for ch in channels]
        polls = [stubs[i % 4].Pull.future(pb.PullRequest(topic="idle", queue_id=0, offset=0, max_messages=10,
                                                         max_wait_ms=30_000), timeout=60) for i in range(2000)]
        with BrokerClient(daemon.address) as c:
            wait_until(lambda: c.status()["long_polls"] >= 2000, 30, what="2,000 parked pulls")
        with BrokerClient(daemon.address) as c:
            t0 = time.monotonic()
            health = health_pb2_grpc.HealthStub(channels[0]).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert c.status()["role"] == "master"
            for i in range(20):
                c.send("busy", [Message(b"%d" % i)] * 100, ack="flush")
            assert time.monotonic() - t0 < 10, "health, status and 20 sends took longer than 10 s"
            assert not any(p.done() for p in polls)
            c.send("idle", [Message(b"wake up")], ack="flush")
        answers = [p.result(timeout=30) for p in polls]
        assert all(a.count == 1 for a in answers)
        with BrokerClient(daemon.address) as c:
            t0 = time.monotonic()
            with pytest.raises(BrokerError) as beyond:
                c.pull("idle", 0, 5, max_wait_ms=5_000)
            assert beyond.value.code == grpc.StatusCode.OUT_OF_RANGE and time.monotonic() - t0 < 2
    finally:
        for ch in channels:
            ch.close()



def test_per_topic_metrics_are_bounded(spawn: Callable[..., DaemonProcess]) -> None:
    """120 topics with pending timers: /metrics carries at most 100 topic series plus one "__other__"."""
    metrics_port = free_port()
    d = spawn("n", config={"node.metrics_listen": f"127.0.0.1:{metrics_port}"})
    later = int(time.time() * 1000) + 600_000
    with BrokerClient(d.address) as c:
        for i in range(120):
            c.create_topic(f"secret-{i}")
            c.send(f"secret-{i}", [Message(b"x", deliver_at_ms=later)] * (i + 1))
        wait_until(lambda: c.status()["timer_pending"] == sum(range(1, 121)), 30, what="every timer to be pending")

    def series() -> list[str]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        return [line for line in text.splitlines() if line.startswith("tidemark_timer_pending{")]

    lines = wait_until(series, 10, what="timer series", accept=lambda s: any('topic="__other__"' in x for x in s))
    assert len(lines) == 101
    assert 'tidemark_timer_pending{topic="secret-119"} 120.0' in lines  # the largest keep their own series
    assert sum(float(x.rsplit(" ", 1)[1]) for x in lines) == sum(range(1, 121))


# -- the README's replication runbook ---------------------------------------------------------------------------
def _readme_runbook() -> list[str]:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("## A pair and a failover\n"):]
    block = section[section.index("```sh\n") + 6:]
    return block[:block.index("```")].splitlines()


def test_the_readme_runbook_never_makes_two_masters(tmp_path: Path) -> None:
    """Every command of the README's replication block, run in order (a kill -9 where it says so):
    after each step at most one node is an unfenced master, and the end state is B master, A its slave."""
    ports = {"7600": str(free_port()), "7601": str(free_port())}
    nodes: list[ArgvDaemon] = []

    def mapped(word: str) -> str:
        for old, new in ports.items():
            word = word.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        return word.replace("/srv/", f"{tmp_path}/")

    def masters() -> list[str]:
        out = []
        for n in nodes:
            if n.proc is not None and n.proc.poll() is None:
                with BrokerClient(n.address) as c:
                    st = c.status()
                if st["role"] == "master" and not st["fenced"]:
                    out.append(n.address)
        return out

    try:
        for line in _readme_runbook():
            command, _, comment = line.partition("#")
            words = [mapped(w) for w in command.split()]
            if not words:
                continue
            if words[:2] == ["kill", "-9"]:
                nodes[int(words[2].lstrip("%")) - 1].kill9()
            elif words[:2] == ["tidemark", "serve"]:
                assert words[-1] == "&", line
                argv = words[1:-1]
                listen = argv[argv.index("--listen") + 1]
                node = ArgvDaemon(argv, argv[argv.index("--data-dir") + 1], int(listen.rpartition(":")[2]))
                node.log_path = f"{tmp_path}/node{len(nodes)}.log"
                nodes.append(node.start())
            else:
                assert words[0] == "tidemark", line
                r = _cli(*words[1:])
                assert r.returncode == 0, (line, r.stderr)
                if "in_sync true" in comment:
                    address = words[words.index("--broker") + 1]
                    with BrokerClient(address) as c:
                        wait_until(lambda: c.status()["replication"]["in_sync"], 30, what=line)
            assert len(masters()) <= 1, (line, masters())
        a, b = nodes[2], nodes[1]  # A as it came back, and B
        with BrokerClient(b.address) as c:
            assert c.status()["role"] == "master"
            c.send("orders", [Message(b"after the failover")], ack="replica")
            end = c.status()["max_offset"]
        with BrokerClient(a.address) as c:
            assert c.status()["role"] == "slave"
            wait_until(lambda: c.status()["max_offset"] == end, 30, what="A to follow B")
        assert masters() == [b.address]
    finally:
        for n in nodes:
            n.kill9()


def test_a_failing_background_flush_is_visible_then_clears() -> None:
    """The consumer-offset flusher's failures are recorded (status errors, a metric), never swallowed;
    the offsets stay buffered and go out on the next try; success clears the error."""
    incidents = Incidents()
    written: list[list[tuple[str, str, int, int]]] = []
    fail = [True]

    def write(entries: list[tuple[str, str, int, int]]) -> None:
        if fail[0]:
            raise OSError(28, "No space left on device")
        written.append(entries)

    buffer = OffsetBuffer(10, 100, write, incidents.report_to("offsets"))
    buffer.start()
    try:
        buffer.commit([("g", "t", 0, 5)])
        wait_until(lambda: incidents.snapshot().get("offsets", {}).get("active"), 5, what="the failure to be recorded")
        assert "No space left" in str(incidents.snapshot()["offsets"]["error"]) and not written
        fail[0] = False
        wait_until(lambda: written, 5, what="the retried flush")
        assert written == [[("g", "t", 0, 5)]]
        wait_until(lambda: not incidents.snapshot()["offsets"]["active"], 5, what="the error to clear")
    finally:
        buffer.stop()


def test_a_cancelled_long_poll_ends_at_once(daemon: DaemonProcess) -> None:
    """A client that gives up on a long-poll frees it: the daemon stops counting (and re-reading) it."""
    with BrokerClient(daemon.address) as c:
        c.create_topic("idle")
        with grpc.insecure_channel(daemon.address) as ch:
            poll = pb_grpc.BrokerStub(ch).Pull.future(pb.PullRequest(topic="idle", queue_id=0, offset=0, max_messages=1,
                                                                     max_wait_ms=30_000), timeout=60)
            wait_until(lambda: c.status()["long_polls"] == 1, 10, what="the pull to park")
            poll.cancel()
            wait_until(lambda: c.status()["long_polls"] == 0, 5, what="the cancelled pull to end")


def test_replication_streams_on_the_client_port_are_bounded(spawn: Callable[..., DaemonProcess]) -> None:
    """At most STREAMS_MAX replication streams are open at once on the client port (each one a
    replica entry and a send window): one more is refused with RESOURCE_EXHAUSTED, and once one
    closes a new one is served."""
    d = spawn("m")
    with BrokerClient(d.address) as c:
        cluster = c.status()["cluster_id"]
    done = threading.Event()

    def outgoing(node_id: str) -> Iterator[pb.SlaveMessage]:
        yield pb.SlaveMessage(hello=pb.Hello(protocol_version=1, cluster_id=cluster, node_id=node_id, log_end=0,
                                             address="127.0.0.1:1"))
        done.wait(30)

    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.ReplicationStub(ch)

        def open_stream(i: int) -> Any:
            responses = stub.Stream(outgoing(f"r{i}"), timeout=30)
            assert next(responses).WhichOneof("kind") == "welcome"
            return responses

        streams = [open_stream(i) for i in range(STREAMS_MAX)]
        with pytest.raises(grpc.RpcError) as refused:
            open_stream(STREAMS_MAX)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        streams.pop().cancel()

        def served() -> bool:
            try:
                streams.append(open_stream(STREAMS_MAX + 1))
            except grpc.RpcError:
                return False
            return True

        wait_until(served, 10, what="a stream served once another closed")
        done.set()
        for s in streams:
            s.cancel()
