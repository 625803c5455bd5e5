"""``BrokerClient.producer()`` (broker/client/producer.py) against real daemons: calls from many
threads ride few requests and land where their receipts say, in order per key; a call refused for
a reason of its own fails alone; the buffer bounds what waits; over two shards in a real etcd, a
call's keys go to their owners, a stale route is followed, and a queue moved under a stream of
calls loses, repeats and reorders nothing."""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future

import crc32c
import pytest

from broker.cli.etcd_process import EtcdProcess
from broker.client import (
    BrokerClient,
    FailedPrecondition,
    Message,
    NotFound,
    Producer,
    Receipts,
    ResourceExhausted,
    Unavailable,
)
from tests.failoverutil import TOPIC, Pair, Spawn, create_topic, in_sync, sent_once_placed, wait_master
from tests.inprocess import Forwarding, forwarding
from tests.moveutil import owners, read_back, shard_node
from tests.procs import free_port
from tests.test_shards import _key_of
from tests.waits import wait_until

Sent = list[tuple[str, Future[Receipts], list[Message]]]


class Stream:
    """A thread making calls of one message per key through ``producer`` until stopped, keeping
    ``in_flight`` of them outstanding (it waits for the oldest's outcome, not its success)."""

    def __init__(self, producer: Producer, topic: str, keys: list[str], in_flight: int) -> None:
        self.producer, self.topic, self.keys, self.in_flight = producer, topic, keys, in_flight
        self.sent: Sent = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stream")

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            messages = [Message(f"{n}:{k}".encode(), key=k) for k in self.keys]
            self.sent.append(("stream", self.producer.send(self.topic, messages), messages))
            if len(self.sent) > self.in_flight:
                self.sent[-self.in_flight][1].exception(30)
            n += 1

    def flowing(self, count: int, what: str) -> None:
        """Until ``count`` more calls were made, the last but ``in_flight`` of them acknowledged."""
        target = len(self.sent) + count
        wait_until(lambda: len(self.sent) > target and self.sent[-self.in_flight - 1][1].exception(30) is None,
                   30, what)


def _send_requests(port: int) -> float:
    """Send requests the node answered OK (its metrics port)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(r'^tidemark_send_requests_total\{outcome="ok"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _stored(c: BrokerClient, topic: str, queues: int) -> dict[tuple[int, int], bytes]:
    """Every message of ``topic``: (queue, offset) -> body."""
    return {(q, m.queue_offset): m.body for q in range(queues) for r in c.iter_pull(topic, q, 0) for m in r}


def _threads(count: int, work: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=work, args=(t,), name=f"caller-{t}") for t in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)


def _check_in_order(sent: Sent, stored: dict[tuple[int, int], bytes]) -> int:
    """Each message stored once, at its receipt; one thread's messages of a key in queue order."""
    last: dict[tuple[str, str | None], tuple[int, int]] = {}
    count = 0
    for thread, future, messages in sent:
        for m, r in zip(messages, future.result(0), strict=True):
            assert stored[(r.queue_id, r.queue_offset)] == m.body, "the receipt names where the message is"
            before = last.get((thread, m.key))
            assert before is None or (before[0] == r.queue_id and before[1] < r.queue_offset), "in order per key"
            last[(thread, m.key)] = (r.queue_id, r.queue_offset)
            count += 1
    bodies = list(stored.values())
    assert len(bodies) == len(set(bodies)), "no message stored twice"
    return count


def test_calls_from_many_threads_ride_few_requests_and_land_where_their_receipts_say(spawn: Spawn) -> None:
    port = free_port()
    node = spawn("node", config={"node.metrics_listen": f"127.0.0.1:{port}"})
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=4)
        c.send("t", [Message(b"first")])
        before = _send_requests(port)
        sent: Sent = []
        lock = threading.Lock()
        with c.producer(linger_ms=20) as p:
            def caller(t: int) -> None:
                for n in range(150):
                    messages = [Message(f"{t}:{n}:{j}".encode(), key=f"k{(n + j) % 5}") for j in range(1 + n % 4)]
                    future = p.send("t", messages)
                    with lock:
                        sent.append((str(t), future, messages))

            _threads(6, caller)
            due = int(time.time() * 1000) + 1500
            timer = p.send("t", [Message(b"late", key="k1", deliver_at_ms=due), Message(b"now", key="k1")])
            p.flush(30)
            assert all(f.done() for _, f, _ in sent)
        requests = _send_requests(port) - before
        late, now = timer.result(0)
        assert late.timer_offset is not None and now.timer_offset is None
        wait_until(lambda: b"late" in _stored(c, "t", 4).values(), 20, "the timer fired")
        stored = _stored(c, "t", 4)
        count = _check_in_order(sent, stored)
        assert count == sum(6 * (1 + n % 4) for n in range(150))
        assert len(stored) == count + 3, "the first message, the timer once, the message beside it"
        assert requests < 900 / 5, f"900 calls made {requests:.0f} requests: calls waiting together share one"
        with pytest.raises(FailedPrecondition, match="closed"):
            p.send("t", [Message(b"after")])


def _losing(target: str, lost: range) -> contextlib.AbstractContextManager[tuple[str, Forwarding]]:
    """The daemon behind a proxy that loses the answers of the Sends numbered in ``lost`` (from 1)."""
    return forwarding(target, "/Send", lost=lost)


def test_calls_refused_for_one_topic_go_again_alone_in_order_each_with_a_new_producer(spawn: Spawn) -> None:
    """Calls for two topics wait together in one request; one topic is gone on the node (the
    client still knows its queue count), so the node refuses the request. Each call is then sent
    on its own, in the order it was made, and only the gone topic's calls fail. The first one
    sent alone is stored but every answer to it is lost: it fails, and the next call, sent with a
    new producer id, is stored (with the same one it would be answered as a duplicate of it)."""
    node = spawn("node")
    with BrokerClient(node.address) as c:
        c.create_topic("kept", queues=2)
        c.create_topic("gone", queues=2)
    q0, q1 = _key_of(0, 2, "a"), _key_of(1, 2, "b")
    # Sends through the proxy: 1 below; 2 the merged request (refused NOT_FOUND); 3 the first call
    # alone, 4-7 its retries (one address: five attempts)
    with _losing(node.address, range(3, 8)) as (address, _), BrokerClient(address) as c:
        c.send("gone", [Message(b"x")])  # the client learns its queue count
        with BrokerClient(node.address) as other:
            other.delete_topic("gone")
        plan = [("kept", [("X", q0)]), ("gone", [("G", q0)]), ("kept", [("W", q1)]), ("kept", [("Y0", q0), ("Y1", q1)])]
        with c.producer(linger_ms=300) as p:
            calls = [p.send(t, [Message(b.encode(), key=k) for b, k in ms]) for t, ms in plan]
            assert not calls[0].cancel(), "a queued call is under way"
            p.flush(30)
        with pytest.raises(Unavailable, match="lost"):
            calls[0].result(0)
        with pytest.raises(NotFound, match="gone"):
            calls[1].result(0)
        w, y = calls[2].result(0), calls[3].result(0)
        stored = _stored(c, "kept", 2)
        assert [b for (q, _), b in sorted(stored.items()) if q == 1] == [b"W", b"Y1"], "queue 1: in the calls' order"
        assert [b for (q, _), b in sorted(stored.items()) if q == 0] == [b"X", b"Y0"], "X stored once, its answer lost"
        assert stored[(w[0].queue_id, w[0].queue_offset)] == b"W"
        assert [stored[(r.queue_id, r.queue_offset)] for r in y] == [b"Y0", b"Y1"]


def test_delayed_messages_of_many_calls_survive_a_lost_answer_and_fire_once(spawn: Spawn) -> None:
    """Seven calls, each with a delayed message for another queue, wait together: their __timer
    batches share one sequence, and a node remembers only a producer's last five, so a request
    carries five at most. The first request's answer is lost: its retry is answered as the
    duplicate it is, every call succeeds, each timer fires once, and later calls are stored."""
    node = spawn("node")
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=8)
    keys = [_key_of(q, 8, "k") for q in range(8)]
    with _losing(node.address, range(1, 2)) as (address, _), BrokerClient(address) as c:
        c.send("t", [Message(b"first")])
        due = int(time.time() * 1000) + 1500
        with c.producer(linger_ms=300) as p:
            calls = [p.send("t", [Message(f"late{q}".encode(), key=keys[q], deliver_at_ms=due),
                                  Message(f"now{q}".encode(), key=keys[0])]) for q in range(1, 8)]
            p.flush(30)
            later = [p.send("t", [Message(f"after{i}".encode(), key=keys[0])]) for i in range(3)]
        for f in calls + later:
            assert all(not r.duplicate or r.timer_offset is not None or r.queue_id == 0 for r in f.result(0))
        wait_until(lambda: sum(b.startswith(b"late") for b in _stored(c, "t", 8).values()) >= 7, 20, "the timers fired")
        time.sleep(0.5)
        stored = _stored(c, "t", 8)
        assert sorted(b for b in stored.values() if b.startswith(b"late")) == [f"late{q}".encode() for q in range(1, 8)]
        assert [b for (q, _), b in sorted(stored.items()) if q == 0 and not b.startswith(b"late")] == [
            b"first", *(f"now{q}".encode() for q in range(1, 8)), b"after0", b"after1", b"after2"]


def test_the_buffer_bounds_what_waits_and_drains_when_the_node_answers(spawn: Spawn) -> None:
    """With the node stopped, calls fill the buffer; the next one waits ``max_block_ms`` and is
    refused with nothing of it queued; once the node runs again every queued call is stored."""
    node = spawn("node")
    with BrokerClient(node.address, timeout_s=30) as c:
        c.create_topic("t", queues=1)
        c.send("t", [Message(b"first")])
        body = b"b" * 16_000
        with c.producer(buffer_bytes=64_000, max_block_ms=300, linger_ms=0) as p:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGSTOP)
            try:
                queued = [p.send("t", [Message(body + bytes([i]))]) for i in range(3)]
                started = time.monotonic()
                with pytest.raises(ResourceExhausted, match="buffer"):
                    for i in range(3, 10):
                        queued.append(p.send("t", [Message(body + bytes([i]))]))
                waited = time.monotonic() - started
                assert 0.25 < waited < 5, waited
                assert not any(f.done() for f in queued)
            finally:
                node.proc.send_signal(signal.SIGCONT)
            p.flush(30)
        assert all(len(f.result(0)) == 1 for f in queued)
        assert sorted(_stored(c, "t", 1).values()) == sorted([b"first", *(body + bytes([i]) for i in range(len(queued)))])


def _two_shards(spawn: Spawn, etcd: EtcdProcess) -> dict[str, str]:
    return {s: shard_node(spawn, etcd, s, n).address for s, n in (("s1", "a"), ("s2", "b"))}


def test_over_two_shards_a_call_goes_to_each_owner_and_a_stale_route_is_followed(spawn: Spawn, etcd: EtcdProcess) -> None:
    nodes = _two_shards(spawn, etcd)
    with BrokerClient(nodes["s1"]) as c:
        c.create_topic("t", queues=8)
        keys = [f"k{i}" for i in range(32)]
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"probe", key=k) for k in keys]), 15, "every queue created")
        placed = owners(c, "t")
        assert sorted(set(placed)) == ["s1", "s2"]
        sent: Sent = []
        with c.producer() as p:
            for n in range(40):
                if n == 20:  # every route wrong: each lane's request is refused naming the owner, then followed
                    p.flush(30)  # (while a lane holds a queue's calls, new calls of it go there, not by the routes)
                    for q in range(8):
                        c._routes.moved("t", q, "s1" if placed[q] == "s2" else "s2", "")
                messages = [Message(f"{n}:{k}".encode(), key=k) for k in keys]
                sent.append(("one", p.send("t", messages), messages))
            p.flush(30)
        assert [c._routes.owner("t", q) for q in range(8)] == placed, "the refusals corrected the routes"
        for _, f, messages in sent:  # a key keeps its queue
            assert [r.queue_id for r in f.result(0)] == [crc32c.crc32c(m.key.encode()) % 8 for m in messages if m.key]
        stored = {k: v for k, v in _stored(c, "t", 8).items() if v != b"probe"}
        assert _check_in_order(sent, stored) == 40 * 32 == len(stored)
        for q, shard in enumerate(placed):  # each queue's messages on its owner's node
            with BrokerClient(nodes[shard]) as direct:
                assert len([m for r in direct.iter_pull("t", q, 0) for m in r if m.body != b"probe"]) == len(
                    [o for (qq, o) in stored if qq == q])


def test_a_queue_moved_under_a_stream_of_calls_loses_repeats_and_reorders_nothing(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A thread keeps calls of 16 keyed messages in flight through the producer while a queue moves
    s1 -> s2 -> s1: each lane sends what was refused to the new owner before anything newer, and
    every message is read back once, in order per key, where its receipt says."""
    nodes = _two_shards(spawn, etcd)
    with BrokerClient(nodes["s1"]) as c, BrokerClient(nodes["s2"]) as admin:
        c.create_topic("t", queues=4)
        keys = [f"k{i}" for i in range(16)]
        wait_until(lambda: sent_once_placed(c, "t", [Message(b"probe", key=k) for k in keys]), 15, "every queue created")
        q = owners(c, "t").index("s1")
        with c.producer(linger_ms=2) as p:
            with Stream(p, "t", keys, 8) as stream:
                stream.flowing(50, "calls flowing")
                moved = admin.move_queue("t", q, "s2")
                assert [s["shard"] for s in moved] == ["s1", "s2"]
                stream.flowing(50, "calls flowing after the move")
                admin.move_queue("t", q, "s1")
                stream.flowing(50, "calls flowing after the move back")
            p.flush(30)
        sent = stream.sent
        errors = [f.exception(0) for _, f, _ in sent if f.exception(0) is not None]
        assert not errors, errors[:3]
        stored = {}
        for queue in range(4):
            read = read_back(c, "t", queue)
            assert [o for o, _ in read] == list(range(len(read))), "offsets continue over the segments"
            stored.update({(queue, o): b for o, b in read if b != b"probe"})
        assert _check_in_order(sent, stored) == len(sent) * 16 == len(stored)


def test_a_kill9_of_the_master_mid_stream_loses_and_repeats_nothing_acknowledged(spawn: Spawn, etcd: EtcdProcess) -> None:
    """A pair on etcd; a thread keeps producer calls in flight while the master is killed: every
    call ends (acknowledged, or an error within the client's timeout), every acknowledged message
    is on the new master at its receipt, and no message is stored twice (retries land once)."""
    pair = Pair(spawn, etcd)
    master = wait_master(pair.nodes)
    slave = pair.other(master)
    create_topic(master, pair.nodes, 2)
    wait_until(lambda: in_sync(master, slave), 30, "the slave in sync")
    with BrokerClient([pair.a.address, pair.b.address], timeout_s=15) as c, c.producer(linger_ms=2) as p:
        with Stream(p, TOPIC, [f"k{k}" for k in range(10)], 4) as stream:
            stream.flowing(50, "calls flowing")
            master.kill9()
            wait_master(pair.nodes, 30, among=[slave])
            stream.flowing(50, "calls acknowledged by the new master")
        p.flush(30)
    sent = stream.sent
    acked = [(f, m) for _, f, m in sent if f.exception(0) is None]
    assert len(acked) > 100 and len(acked) >= len(sent) - 8, f"{len(sent) - len(acked)} calls failed"
    with BrokerClient(slave.address) as reader:
        stored = {(q, m.queue_offset): m.body for q in range(2) for r in reader.iter_pull(TOPIC, q, 0) for m in r}
    bodies = list(stored.values())
    assert len(bodies) == len(set(bodies)), "no message stored twice"
    for f, messages in acked:
        for m, r in zip(messages, f.result(0), strict=True):
            assert stored.get((r.queue_id, r.queue_offset)) == m.body, "an acknowledged message lost"
