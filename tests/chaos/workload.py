"""The chaos run's clients, one process each: ``python -m tests.chaos.workload ROLE --run DIR ...``.

Roles: ``producer`` (ack=replica sends; some keyed for the order check, some delayed), ``subscriber``
(a subscribe-mode member that commits its offsets), ``popper`` (pop mode, acks what it got),
``carrier`` (pop mode, each pop carrying the acks of the one before),
``creator`` (topic creates), ``sampler`` (each node's status every ~100 ms), ``transactor``
(transactions over the queues of a second topic, some aborted), ``txreader`` (a read_committed
reader of that topic) and ``txpopper`` (a carrying pop group of that topic). Each writes its
operations to its own history file (tests/chaos/history.py) until SIGTERM, then finishes the
operation in hand and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import functools
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from broker.client import BrokerClient, BrokerError, Message, TransactionAborted
from broker.client.core import SEND_RETRYABLE
from broker.client.messages import PoppedMessage
from tests.chaos.history import Recorder, now_ms

TOPIC = "chaos"
QUEUES = 4
TXN_TOPIC = "chaos-tx"
TXN_QUEUES = 2
TXN_TIMEOUT_MS = 5000
SUB_GROUP = "chaos-sub"
POP_GROUP = "chaos-pop"
TXN_POP_GROUP = "chaos-txpop"
TIMEOUT_S = 10.0
# errors that guarantee the call changed nothing; anything else after a call was sent is indeterminate
FAILED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)

stopping = threading.Event()


def outcome_of(exc: BaseException) -> str:
    return "fail" if isinstance(exc, BrokerError) and exc.code in FAILED else "unknown"


def attempt(rec: Recorder, op: str, value: dict[str, Any], call: Callable[[], dict[str, Any] | None]) -> Any:
    """Run ``call``, record it with its outcome; return its result (None when it failed)."""
    t0 = now_ms()
    try:
        result = call()
    except Exception as exc:  # every failure is an outcome to record, never a crash of the client
        rec.record(op, value, outcome_of(exc), t0, error=repr(exc))
        return None
    rec.record(op, value, "ok", t0, result=result)
    return result


def body_id(body: bytes) -> str:
    return body.split(b"|", 1)[0].decode()


# -- producer ------------------------------------------------------------------------------------
def producer(rec: Recorder, client: BrokerClient, rng: random.Random, args: argparse.Namespace) -> None:
    n = 0
    kseq: dict[str, int] = {}
    pad = b"x" * args.body_bytes
    while not stopping.is_set():
        msgs, values = [], []
        for _ in range(rng.randint(5, 40)):
            mid = f"{rec.client}-{n}"
            n += 1
            key = f"{rec.client}-k{rng.randrange(8)}" if rng.random() < 0.3 else None
            seq = None
            if key is not None:
                seq = kseq.get(key, 0)
                kseq[key] = seq + 1
            due = int(time.time() * 1000) + rng.randint(300, 4000) if key is None and rng.random() < 0.08 else None
            msgs.append(Message(mid.encode() + b"|" + pad, key=key, deliver_at_ms=due))
            values.append({"id": mid, "key": key, "kseq": seq, "deliver_at_ms": due})

        def send(msgs: list[Message] = msgs) -> dict[str, Any]:
            receipts = client.send(TOPIC, msgs, ack="replica")
            return {"receipts": [{"queue_id": r.queue_id, "queue_offset": r.queue_offset,
                                  "commit_offset": r.commit_offset, "timer_offset": r.timer_offset or 0}
                                 for r in receipts]}

        attempt(rec, "send", {"topic": TOPIC, "msgs": values}, send)
        stopping.wait(args.pause_s)


# -- subscribe-mode member -----------------------------------------------------------------------
def subscriber(rec: Recorder, client: BrokerClient, rng: random.Random, args: argparse.Namespace) -> None:
    fresh: set[tuple[str, int]] = set()
    lock = threading.Lock()

    def assigned(queues: set[tuple[str, int]]) -> None:
        with lock:
            fresh.update(queues)

    positions: dict[tuple[str, int], int] = {}
    last_commit = time.monotonic()
    with client.consumer(SUB_GROUP, TOPIC, session_timeout_ms=3000, auto_offset_reset="earliest",
                         client_id=rec.client, on_assigned=assigned) as member:
        while not stopping.is_set():
            t0 = now_ms()
            try:
                got = member.poll(timeout_ms=500)
            except Exception as exc:  # a poll that failed: try again (the member rejoins by itself)
                rec.record("poll", {"group": SUB_GROUP}, outcome_of(exc), t0, error=repr(exc))
                stopping.wait(0.2)
                continue
            done = now_ms()
            by_queue: dict[tuple[str, int], list[list[Any]]] = {}
            for m in got:
                by_queue.setdefault((m.topic, m.queue_id), []).append(
                    [m.queue_offset, body_id(m.body), m.store_time_ms, m.deliver_at_ms or 0])
            for (topic, q), rows in by_queue.items():
                with lock:
                    new = (topic, q) in fresh
                    fresh.discard((topic, q))
                if new:
                    rec.record("assign", {"group": SUB_GROUP, "topic": topic, "queue_id": q, "offset": rows[0][0]},
                               "ok", t0, complete_ms=done)
                rec.record("recv", {"group": SUB_GROUP, "topic": topic, "queue_id": q, "msgs": rows}, "ok", t0,
                           complete_ms=done)
                positions[(topic, q)] = rows[-1][0] + 1
            if time.monotonic() - last_commit >= args.commit_every_s and positions:
                held = member.assignment
                todo = {k: v for k, v in positions.items() if k in held}
                for (topic, q), offset in todo.items():
                    attempt(rec, "commit", {"group": SUB_GROUP, "topic": topic, "queue_id": q, "offset": offset},
                            functools.partial(_commit, client, topic, q, offset))
                positions.clear()
                last_commit = time.monotonic()


def _commit(client: BrokerClient, topic: str, queue_id: int, offset: int) -> dict[str, Any]:
    client.commit_offsets(SUB_GROUP, {(topic, queue_id): offset})
    return {}


# -- pop-mode consumer ---------------------------------------------------------------------------
def popper(rec: Recorder, client: BrokerClient, rng: random.Random, args: argparse.Namespace) -> None:
    value = {"group": POP_GROUP, "topic": TOPIC}
    while not stopping.is_set():
        t0 = now_ms()
        try:
            messages = list(client.pop(POP_GROUP, TOPIC, max_messages=200, invisible_ms=args.invisible_ms,
                                       max_wait_ms=500, start="earliest"))
        except Exception as exc:  # recorded; the next pop tries again
            rec.record("pop", value, outcome_of(exc), t0, error=repr(exc))
            stopping.wait(0.1)
            continue
        rows = [[m.queue_id, m.queue_offset, body_id(m.body)] for m in messages]
        rec.record("pop", value, "ok", t0, result={"msgs": [[*r, m.delivery_count] for r, m in zip(rows, messages,
                                                                                                   strict=True)]})
        if not messages:
            continue
        attempt(rec, "ack", {**value, "msgs": rows}, functools.partial(_ack, client, messages))


def carrier(rec: Recorder, client: BrokerClient, rng: random.Random, args: argparse.Namespace,
            group: str = POP_GROUP, topic: str = TOPIC) -> None:
    """Pop mode as a consumer loop: each pop carries the acks of the messages it got before
    (``pop(ack=...)``), recorded as an ``ack`` op with the pop's outcome (a pop that failed: the acks
    may or may not be done; they are carried again by the next one)."""
    value = {"group": group, "topic": topic}
    previous: list[PoppedMessage] = []
    while not stopping.is_set():
        t0 = now_ms()
        by_handle = {m.receipt_handle: (m.queue_id, m.queue_offset) for m in previous}
        acked = {**value, "msgs": [[m.queue_id, m.queue_offset, body_id(m.body)] for m in previous]}
        try:
            got = client.pop(group, topic, max_messages=rng.randint(1, 200), invisible_ms=args.invisible_ms,
                             max_wait_ms=500, start="earliest", ack=previous or None)
        except Exception as exc:  # recorded; the next pop carries the same acks again
            rec.record("pop", value, outcome_of(exc), t0, error=repr(exc))
            if previous:
                rec.record("ack", acked, outcome_of(exc), t0, error=repr(exc))
            stopping.wait(0.1)
            continue
        messages = list(got)
        rec.record("pop", value, "ok", t0, result={"msgs": [[m.queue_id, m.queue_offset, body_id(m.body),
                                                             m.delivery_count] for m in messages]})
        if previous:
            refused = [list(by_handle[h]) for h in got.ack_failures if h in by_handle]
            rec.record("ack", acked, "ok", t0, result={"refused": refused})
        previous = messages


def txpopper(rec: Recorder, client: BrokerClient, rng: random.Random, args: argparse.Namespace) -> None:
    """A carrying pop group of TXN_TOPIC (read_committed: aborted transactions' messages are never
    leased; its queues move between shards, away and back, in a run of shards)."""
    carrier(rec, client, rng, args, TXN_POP_GROUP, TXN_TOPIC)


def _ack(client: BrokerClient, messages: list[PoppedMessage]) -> dict[str, Any]:
    """Ack by each message's own handle: a refusal names the message whose lease had ended."""
    by_handle = {m.receipt_handle: (m.queue_id, m.queue_offset) for m in messages}
    return {"refused": [list(by_handle[h]) for h in client.ack(POP_GROUP, messages) if h in by_handle]}


# -- transactions --------------------------------------------------------------------------------
def transactor(rec: Recorder, client: BrokerClient, rng: random.Random, args: argparse.Namespace) -> None:
    """Transactions of 2-12 messages over TXN_TOPIC's queues, one in five aborted on purpose. Each is
    one ``txn`` op: its ids, whether commit was called, and the outcome (ok: committed; fail: it
    never became visible — aborted by us or by the broker, or never begun; unknown: a commit whose
    answer was lost)."""
    n = 0
    while not stopping.is_set():
        ids = [f"{rec.client}-x{n}-{i}" for i in range(rng.randint(2, 12))]
        n += 1
        msgs = [Message(mid.encode() + b"|", key=f"k{rng.randrange(64)}") for mid in ids]
        commit = rng.random() >= 0.2
        value: dict[str, Any] = {"topic": TXN_TOPIC, "ids": ids, "commit": commit}
        t0 = now_ms()
        try:
            tx = client.begin_transaction(f"{rec.client}-tx", timeout_ms=TXN_TIMEOUT_MS)
        except Exception as exc:  # nothing begun that could commit
            rec.record("txn", value, "fail", t0, error=repr(exc), result={"ended": "not begun"})
            stopping.wait(0.2)
            continue
        # the last send carries the commit (SendRequest.commit) in half the committed ones, and in a
        # third of those it is the only send: begin, messages and commit in one call
        carried = commit and rng.random() < 0.5
        half = 0 if carried and rng.random() < 1 / 3 else len(msgs) // 2
        value["carried"] = carried
        try:
            if half:  # two sends: a transaction spans calls (the first begins it)
                tx.send(TXN_TOPIC, msgs[:half])
                value["producer_id"] = tx.producer_id
            if carried:
                _send_and_commit(rec, tx, msgs[half:], value, t0)
                continue
            tx.send(TXN_TOPIC, msgs[half:])
        except Exception as exc:  # never committed: it can only end aborted (our abort, its timeout)
            with contextlib.suppress(Exception):
                tx.abort()
            rec.record("txn", {**value, "commit": False}, "fail", t0, error=repr(exc), result={"ended": "send failed"})
            stopping.wait(0.2)
            continue
        if not commit:
            with contextlib.suppress(Exception):  # if this abort is lost, the timeout aborts it
                tx.abort()
            rec.record("txn", value, "fail", t0, result={"ended": "aborted by us"})
            continue
        _commit_txn(rec, tx, value, t0)


def _commit_txn(rec: Recorder, tx: Any, value: dict[str, Any], t0: float, after: str = "") -> None:
    """``commit()`` and its ``txn`` op (``after``: the failure of unknown outcome before it)."""
    try:
        tx.commit()
    except TransactionAborted as exc:
        rec.record("txn", value, "fail", t0, error=repr(exc), result={"ended": "aborted at commit"})
        return
    except Exception as exc:
        rec.record("txn", value, "unknown", t0, error=repr(exc))
        with contextlib.suppress(Exception):  # a retried end answers the first outcome: learn it
            tx.commit()
        return
    rec.record("txn", value, "ok", t0, result={"after": after} if after else None)


def _send_and_commit(rec: Recorder, tx: Any, msgs: list[Message], value: dict[str, Any], t0: float) -> None:
    """The transaction's last send, carrying its commit: one ``txn`` op as ``transactor``'s. After a
    failure whose outcome is unknown, ``commit()`` learns it (the client's count covers the send;
    a retry of an ended transaction answers its first outcome); a definite refusal decided nothing."""
    try:
        tx.send(TXN_TOPIC, msgs, commit=True)
    except TransactionAborted as exc:
        rec.record("txn", value, "fail", t0, error=repr(exc), result={"ended": "aborted at commit"})
        return
    except BrokerError as exc:
        if exc.code not in SEND_RETRYABLE and exc.code != grpc.StatusCode.NOT_FOUND:  # refused: nothing decided
            with contextlib.suppress(Exception):  # if this abort is lost, the timeout aborts it
                tx.abort()
            rec.record("txn", value, "fail", t0, error=repr(exc), result={"ended": "refused, aborted"})
            return
        _commit_txn(rec, tx, value, t0, after=repr(exc))
        return
    except Exception as exc:
        rec.record("txn", value, "unknown", t0, error=repr(exc))
        return
    rec.record("txn", value, "ok", t0)


def txreader(rec: Recorder, client: BrokerClient, rng: random.Random, args: argparse.Namespace) -> None:
    """A read_committed reader of TXN_TOPIC: every id it sees, with where, as ``txn_recv`` ops."""
    positions = dict.fromkeys(range(TXN_QUEUES), 0)
    while not stopping.is_set():
        for q in range(TXN_QUEUES):
            t0 = now_ms()
            try:
                got = client.pull(TXN_TOPIC, q, positions[q], max_messages=2000, max_wait_ms=100)
            except Exception as exc:  # a failover: pull again
                rec.record("txn_recv", {"queue_id": q}, outcome_of(exc), t0, error=repr(exc))
                stopping.wait(0.2)
                continue
            rows = [[m.queue_offset, body_id(m.body)] for m in got]
            if rows:
                rec.record("txn_recv", {"queue_id": q, "msgs": rows}, "ok", t0)
            positions[q] = got.next_offset


# -- topic creates -------------------------------------------------------------------------------
def creator(rec: Recorder, client: BrokerClient, rng: random.Random, args: argparse.Namespace) -> None:
    n = 0
    while not stopping.is_set():
        name = f"chaos-t-{rec.client}-{n}"
        n += 1
        attempt(rec, "create_topic", {"topic": name}, functools.partial(_create, client, name))
        stopping.wait(1.0)


def _create(client: BrokerClient, name: str) -> dict[str, Any]:
    client.create_topic(name, queues=2)
    return {}


# -- status sampler ------------------------------------------------------------------------------
STATUS_FIELDS = ("role", "epoch", "node_id", "fenced", "confirm_offset", "max_offset", "flushed_offset",
                 "tiered_uploaded_offset")


def sampler(rec: Recorder, client: BrokerClient, rng: random.Random, args: argparse.Namespace) -> None:
    nodes = [(name, BrokerClient(addr, timeout_s=1.0, follow_master=False))
             for name, addr in zip(args.names.split(","), args.addresses.split(","), strict=True)]
    while not stopping.is_set():
        for name, c in nodes:
            attempt(rec, "status", {"node": name}, functools.partial(_status, c))
        stopping.wait(0.1)


def _status(c: BrokerClient) -> dict[str, Any]:
    st = c.status()
    # a master's write permit (None: unbounded); 0 once it lapsed: the node acknowledges nothing
    coordinator = st.get("coordinator") or {}
    return {**{k: st.get(k) for k in STATUS_FIELDS}, "permit_ms": coordinator.get("lease_remaining_ms"),
            "shard": coordinator.get("shard", "")}


ROLES: dict[str, Callable[[Recorder, BrokerClient, random.Random, argparse.Namespace], None]] = {
    "producer": producer, "subscriber": subscriber, "popper": popper, "carrier": carrier, "creator": creator,
    "sampler": sampler,
    "transactor": transactor, "txreader": txreader, "txpopper": txpopper}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--run", required=True, help="the run's directory (history files go in <run>/history)")
    p.add_argument("--name", required=True, help="this client's name in the history")
    p.add_argument("--addresses", required=True, help="client addresses of the nodes, comma-separated")
    p.add_argument("--names", default="a,b", help="the nodes' names, in the order of --addresses")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pause-s", type=float, default=0.02)
    p.add_argument("--body-bytes", type=int, default=200)
    p.add_argument("--commit-every-s", type=float, default=1.0)
    p.add_argument("--invisible-ms", type=int, default=5000)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks before it kills a client that hangs
    rec = Recorder(args.run, args.name)
    rng = random.Random(f"{args.seed}-{args.name}")
    client = BrokerClient(args.addresses.split(","), timeout_s=TIMEOUT_S)
    try:
        ROLES[args.role](rec, client, rng, args)
    finally:
        rec.close()
        client.close()


if __name__ == "__main__":
    main()
