"""The client's Pull response reader (broker/client/pull_wire.py) answers what the protobuf parser answers."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from broker.client import BrokerClient, Message
from broker.client.messages import PullResult
from broker.client.pull_wire import PullResponseView, parse_pull_response
from broker.daemon.wire import pull_response_bytes
from broker.logformat import batch as bf
from proto import tidemark_pb2 as pb
from tests.procs import DaemonProcess
from tests.wirefuzz import agree, mutated

SCALARS = ("skip_first", "count", "next_offset", "min_offset", "max_offset")


def _fields(response: Any) -> dict[str, Any]:
    return {**{f: getattr(response, f) for f in SCALARS}, "batches": [bytes(b) for b in response.batches],
            "messages": [m.SerializeToString() for m in response.messages]}


def _response(rng: random.Random) -> bytes:
    blobs = [rng.randbytes(rng.choice((0, 1, 64, 70_000))) for _ in range(rng.randrange(5))]
    scalars = {"skip_first": rng.choice((0, 3, 2**32 - 1)), "count": rng.choice((0, 1000, 2**32 - 1)),
               "next_offset": rng.choice((0, 5, 2**64 - 1)), "min_offset": rng.choice((0, 2**40)),
               "max_offset": rng.choice((0, 7, 2**63))}
    if rng.random() < 0.5:  # the server's own encoder, as the daemon answers
        return pull_response_bytes(blobs, **scalars)
    r = pb.PullResponse(batches=blobs, **scalars)  # type: ignore[arg-type]
    if rng.random() < 0.1:
        r.messages.add(queue_offset=1, body=b"decoded")
    return r.SerializeToString()


def test_the_reader_and_protobuf_agree_on_every_response() -> None:
    fast = agree(_response, lambda rng, data: mutated(rng, data, scalars=(2, 3, 4, 6), unknown=(8, 9, 100, 1, 2, 4, 7)),
                 parse_pull_response, pb.PullResponse.FromString, _fields, PullResponseView)
    assert fast > 1000  # most responses took the reader, not the fallback


def test_raw_batches_are_views_of_the_response_and_bodies_are_bytes() -> None:
    data = pull_response_bytes([b"a" * 100, b"b" * 50], skip_first=1, count=2, next_offset=9, min_offset=0, max_offset=9)
    parsed = parse_pull_response(data)
    assert isinstance(parsed, PullResponseView)
    views = parsed.batch_views()
    assert all(isinstance(v, memoryview) and v.obj is data for v in views)
    assert [bytes(v) for v in views] == parsed.batches == [b"a" * 100, b"b" * 50]
    assert all(type(b) is bytes for b in parsed.batches)


def test_decoded_messages_go_to_the_protobuf_parser() -> None:
    data = pb.PullResponse(messages=[pb.PulledMessage(queue_offset=1, body=b"b")], count=1).SerializeToString()
    parsed = parse_pull_response(data)
    assert isinstance(parsed, pb.PullResponse) and parsed.messages[0].body == b"b"


def test_the_client_reads_pulls_through_the_reader(spawn: Callable[..., DaemonProcess]) -> None:
    """Against a real daemon: pulls arrive as views, and messages, bodies and raw batches agree."""
    d = spawn("node")
    with BrokerClient(d.address) as c:
        c.create_topic("w", queues=1)
        c.send("w", [Message(body=b"m%d" % i, key=f"k{i}", properties={"i": str(i)}) for i in range(50)], ack="flush")
        result = c.pull("w", 0, 3, max_messages=20)
        assert isinstance(result._response, PullResponseView)
        assert [m.body for m in result] == result.bodies() == [b"m%d" % i for i in range(3, 23)]
        assert [m.key for m in result] == [f"k{i}" for i in range(3, 23)]
        assert [m.properties["i"] for m in result] == [str(i) for i in range(3, 23)]
        blobs, skip = result.raw_batches()
        assert skip == 0 and all(isinstance(b, memoryview) for b in blobs)  # cut to the 20 records answered
        assert sum(bf.decode_header(b).record_count for b in blobs) == 20
        streamed = [m.body for r in c.iter_pull("w", 0, 0, max_messages=7) for m in r]
        assert streamed == [b"m%d" % i for i in range(50)]
        assert isinstance(PullResult(parse_pull_response(pull_response_bytes(
            [], skip_first=0, count=0, next_offset=0, min_offset=0, max_offset=0))), PullResult)
