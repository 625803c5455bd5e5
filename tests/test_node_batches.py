"""examples/node/batches.js: the log's record format in JavaScript, a Node client's fast path.
Its SendRequest wire is the one protobufjs writes for the same request, its records are byte for
byte the Python client's, a live daemon stores what it sends (and answers a retry as duplicates),
and it decodes pulled batches as our own client does."""

from __future__ import annotations

import base64
import json
import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c

from broker.client import BrokerClient, Message
from broker.client.messages import encode_messages
from proto import tidemark_pb2 as pb
from tests.procs import DaemonProcess
from tests.test_node_client import node  # noqa: F401 - the fixture: node with the example's packages

CHECK = Path(__file__).resolve().parent / "node" / "batches_check.js"
QUEUES = 4


def _messages() -> list[Message]:
    rng = random.Random(40)
    out = [
        Message(b"plain", key="order-1"),
        Message(b"", key="empty body"),
        Message(b"no key or properties"),
        Message("ünïcødé ✓".encode(), key="ключ-7", properties={"lang": "node", "note": "é ✓", "empty": ""}),
        Message(rng.randbytes(100_000), key="big", properties={"v": "x" * 60_000}),
    ]
    out += [Message(rng.randbytes(rng.randrange(0, 300)), key=f"k{i}" if i % 3 else "",
                    properties={f"p{j}": str(j) for j in range(i % 4)}) for i in range(60)]
    return out


def _run(node_bin: str, messages: list[Message], *args: str) -> Any:
    spec = {"messages": [{"key": m.key or "", "properties": m.properties or {},
                          "body": base64.b64encode(m.body).decode()} for m in messages]}
    r = subprocess.run([node_bin, str(CHECK), *args], input=json.dumps(spec), capture_output=True, text=True,
                       timeout=120, check=False, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def _queue_of(m: Message, queues: int) -> int:
    return crc32c.crc32c(m.key.encode()) % queues if m.key else 0  # keyless: queue 0 in batches_check.js


def test_the_wire_is_protobufs_and_the_records_are_the_python_clients(node: str) -> None:  # noqa: F811
    messages = _messages()
    got = _run(node, messages, "encode")
    wire, other, reused = (pb.SendRequest.FromString(bytes.fromhex(got[k])) for k in ("wire", "protobufjs", "encoder"))
    assert wire == other == reused and got["wire"] == got["encoder"]
    assert got["smaller"] == got["smaller_fresh"] and got["same_buffer"]  # written over the bigger one's bytes
    assert wire.ack == pb.ACK_FLUSH and wire.timeout_ms == 2500 and len(wire.batches) == len(set(got["queues"]))
    for i, batch in enumerate(wire.batches):
        idxs = [j for j, m in enumerate(messages) if _queue_of(m, QUEUES) == batch.queue_id]
        records, _ = encode_messages(messages, idxs)
        assert batch.records == records  # byte for byte what our client encodes
        assert batch.record_count == len(idxs) and batch.records_crc == crc32c.crc32c(records)
        assert (batch.producer_id, batch.base_sequence) == (((1 << 62) + 5, 300) if i == 0 else (0, -1))


def test_a_send_from_node_is_stored_and_its_retry_answered_as_duplicates(
        node: str, spawn: Callable[..., DaemonProcess]) -> None:  # noqa: F811
    d = spawn("node")
    messages = _messages()
    with BrokerClient(d.address) as c:
        c.create_topic("orders", queues=QUEUES)
        got = _run(node, messages, "send", d.address, "orders", str(QUEUES))
        assert [r["duplicate"] for r in got["first"]] == [False] * len(got["queues"])
        assert all(r["duplicate"] for r in got["retried"])
        assert [r["commit_offset"] for r in got["retried"]] == [r["commit_offset"] for r in got["first"]]
        for q in range(QUEUES):
            sent = [m for m in messages if _queue_of(m, QUEUES) == q]
            pulled = list(c.pull("orders", q, 0, max_messages=1000))
            assert [(m.key, m.properties, m.body) for m in pulled] == [(m.key or None, m.properties or {}, m.body)
                                                                        for m in sent]


def test_node_decodes_pulled_batches_as_our_client_does(node: str, spawn: Callable[..., DaemonProcess]) -> None:  # noqa: F811
    d = spawn("node")
    messages = _messages()
    with BrokerClient(d.address) as c:
        c.create_topic("orders", queues=QUEUES)
        for start in range(0, len(messages), 9):  # several batches, pulled 7 at a time: runs start mid-batch
            c.send("orders", messages[start:start + 9], ack="flush")
        due = int(time.time() * 1000) + 300  # a fired timer: its fields read out of its properties
        c.send("orders", [Message(b"due", key="k1", properties={"p": "v"}, deliver_at_ms=due)], ack="flush")
        timer_queue = _queue_of(Message(b"", key="k1"), QUEUES)
        deadline = time.monotonic() + 10
        while not any(m.deliver_at_ms == due for m in c.pull("orders", timer_queue, 0, max_messages=1000)):
            assert time.monotonic() < deadline, "the timer fired"
            time.sleep(0.1)
        got = _run(node, [], "pull", d.address, "orders", str(QUEUES))
        assert got["cut_refused"] and all(got["cut_refused"]), got["cut_refused"]
        for q in range(QUEUES):
            ours = list(c.pull("orders", q, 0, max_messages=1000))
            assert ours, "every queue holds messages"
            theirs = got[str(q)]
            assert [(m["queue_offset"], m["commit_offset"], m["store_time_ms"], m["key"], m["properties"],
                     base64.b64decode(m["body"]), m["same_body"], m["deliver_at_ms"], m["timer_offset"]) for m in theirs] == \
                [(m.queue_offset, m.commit_offset, m.store_time_ms, m.key or "", m.properties, m.body, True,
                  m.deliver_at_ms or 0, m.timer_offset or 0) for m in ours]
