"""``iter_pull`` makes a pull refused UNAVAILABLE again, as ``pull`` does, instead of raising it.

Found by CI (test_shard_groups.py, dead letters): a dead-letter topic was placed in etcd and
created on one shard but not yet on the other, whose node refused the pull UNAVAILABLE "being
created; retry in a moment". ``pull`` retries that; the pipelined ``iter_pull`` raised it to its
caller. Here a real daemon sits behind a gRPC proxy of this process that refuses chosen pulls as
that shard did, so the refusals fall exactly where the test wants them.
"""

from __future__ import annotations

import contextlib

import pytest

from broker.client import BrokerClient, Message
from broker.client.errors import Unavailable
from tests.failoverutil import Spawn
from tests.inprocess import Forwarding, forwarding

MESSAGES = 3000
PER_PULL = 500
REFUSAL = "topic 't' is being created on shard 's1'; retry in a moment"


def _proxy(target: str, refused: range) -> contextlib.AbstractContextManager[tuple[str, Forwarding]]:
    """The daemon behind a proxy refusing the pulls numbered in ``refused`` (from 1) as the shard did."""
    return forwarding(target, "/Pull", refused=refused, refusal=REFUSAL)


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
    assert proxy.calls > MESSAGES // PER_PULL + len(refused)  # every refusal was met, and pulled again


def test_a_refusal_that_does_not_pass_ends_the_iteration_with_it(daemon: str) -> None:
    with _proxy(daemon, range(2, 10**6)) as (address, _), BrokerClient(address, timeout_s=2.0) as c:
        pulls = c.iter_pull("t", 0, 0, max_messages=PER_PULL)
        assert [m.queue_offset for m in next(pulls)] == list(range(PER_PULL))
        with pytest.raises(Unavailable, match="being created"):
            next(pulls)
