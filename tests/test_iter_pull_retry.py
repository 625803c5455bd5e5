"""``iter_pull`` makes a pull refused UNAVAILABLE again, as ``pull`` does, instead of raising it.

Found by CI (test_shard_groups.py, dead letters): a dead-letter topic was placed in etcd and
created on one shard but not yet on the other, whose node refused the pull UNAVAILABLE "being
created; retry in a moment". ``pull`` retries that; the pipelined ``iter_pull`` raised it to its
caller. Here a real daemon sits behind a gRPC proxy of this process that refuses chosen pulls as
that shard did, so the refusals fall exactly where the test wants them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from broker.client import BrokerClient, Message
from broker.client.errors import Unavailable
from tests.failoverutil import Spawn
from tests.inprocess import serving

MESSAGES = 3000
PER_PULL = 500
REFUSAL = "topic 't' is being created on shard 's1'; retry in a moment"


class _Refusing(grpc.GenericRpcHandler):
    """Forwards every call to the daemon at ``target``, refusing the pulls numbered in ``refused``
    (from 1, counted as they arrive) UNAVAILABLE."""

    def __init__(self, target: str, refused: range) -> None:
        self.channel = grpc.insecure_channel(target)
        self.refused = refused
        self.pulls = 0
        self.lock = threading.Lock()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method  # type: ignore[attr-defined]
        forward = self.channel.unary_unary(method)

        def handle(request: bytes, context: grpc.ServicerContext) -> Any:
            if method.endswith("/Pull"):
                with self.lock:
                    self.pulls += 1
                    refuse = self.pulls in self.refused
                if refuse:
                    context.abort(grpc.StatusCode.UNAVAILABLE, REFUSAL)
            try:
                return forward(request, timeout=context.time_remaining())
            except grpc.RpcError as exc:  # the daemon's answer, as it gave it
                context.set_trailing_metadata(exc.trailing_metadata())  # type: ignore[attr-defined]
                context.abort(exc.code(), exc.details())  # type: ignore[attr-defined]

        return grpc.unary_unary_rpc_method_handler(handle)


@contextlib.contextmanager
def _proxy(target: str, refused: range) -> Iterator[tuple[str, _Refusing]]:
    handler = _Refusing(target, refused)
    try:
        with serving(lambda server: server.add_generic_rpc_handlers((handler,))) as address:
            yield address, handler
    finally:
        handler.channel.close()


@pytest.fixture
def daemon(spawn: Spawn) -> str:
    node = spawn("a")
    with BrokerClient(node.address) as c:
        c.create_topic("t", queues=1)
        for start in range(0, MESSAGES, 1000):
            c.send("t", [Message(b"m%d" % k, key="k") for k in range(start, start + 1000)], ack="flush")
    return node.address


@pytest.mark.parametrize("refused", [range(1, 2), range(2, 4), range(4, 7)], ids=["first", "second-third", "later"])
def test_a_transient_refusal_mid_iteration_is_retried_and_nothing_is_skipped_or_repeated(daemon: str,
                                                                                          refused: range) -> None:
    with _proxy(daemon, refused) as (address, proxy), BrokerClient(address) as c:
        got = [(m.queue_offset, m.body) for r in c.iter_pull("t", 0, 0, max_messages=PER_PULL) for m in r]
    assert got == [(k, b"m%d" % k) for k in range(MESSAGES)]
    assert proxy.pulls > MESSAGES // PER_PULL + len(refused)  # every refusal was met, and pulled again


def test_a_refusal_that_does_not_pass_ends_the_iteration_with_it(daemon: str) -> None:
    with _proxy(daemon, range(2, 10**6)) as (address, _), BrokerClient(address, timeout_s=2.0) as c:
        pulls = c.iter_pull("t", 0, 0, max_messages=PER_PULL)
        assert [m.queue_offset for m in next(pulls)] == list(range(PER_PULL))
        with pytest.raises(Unavailable, match="being created"):
            next(pulls)
