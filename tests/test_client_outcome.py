"""A call whose outcome is unknown never ends as a refusal that says "not done".

Found by the chaos run in make test (seed 1573326303): a send carrying a transaction's commit was
in flight when both nodes lost power. It was applied and its answer was lost; the client's
retries then met only "this node is a slave" until its deadline, and it raised that refusal.
FAILED_PRECONDITION says the call was not executed, so the workload took a committed transaction
for refused. The node here answers as a real pair does in that sequence: the first attempt is
stored and refused UNAVAILABLE with ``tidemark-outcome: unknown`` (a master that lost its
mastership before acknowledging: ``check_still_master_after_append``), every later one
FAILED_PRECONDITION from a slave whose master is silent (``tidemark-master`` empty), or from a
fenced master that knows no other (the refusal a real store raises). It is a gRPC server in this
process: the sequence of a failover, made exact.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from broker.client import BrokerClient, BrokerError, Message
from broker.errors import BrokerError as StoreRefusal
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc
from tests.inprocess import serving
from tests.storeutil import open_store

Answer = tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]


class _FailingOver(pb_grpc.BrokerServicer):
    """Lists one topic; answers the first send with ``first`` (a master losing its mastership), every
    later one with ``later`` (a slave, or a fenced master)."""

    def __init__(self, first: Answer, later: Answer) -> None:
        self.first, self.later = first, later
        self.sends = 0
        self.lock = threading.Lock()

    def GetRoutes(self, request: pb.GetRoutesRequest, context: grpc.ServicerContext) -> pb.GetRoutesResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "one pair, not a cluster of shards")
        raise AssertionError("unreachable")

    def ListTopics(self, request: pb.ListTopicsRequest, context: grpc.ServicerContext) -> pb.ListTopicsResponse:
        return pb.ListTopicsResponse(topics=[pb.TopicInfo(name="t", queues=1, queue_max_offsets=[0])])

    def Send(self, request: pb.SendRequest, context: grpc.ServicerContext) -> pb.SendResponse:
        with self.lock:
            self.sends += 1
            first = self.sends == 1
        code, details, trailing = self.first if first else self.later
        context.set_trailing_metadata(trailing)
        context.abort(code, details)
        raise AssertionError("unreachable")


def _serving(servicer: _FailingOver) -> contextlib.AbstractContextManager[str]:
    """``servicer`` on a gRPC server of this process; its address."""
    return serving(functools.partial(pb_grpc.add_BrokerServicer_to_server, servicer))


@pytest.fixture
def node(request: pytest.FixtureRequest) -> Iterator[tuple[str, _FailingOver]]:
    servicer = _FailingOver(request.param, SLAVE)
    with _serving(servicer) as address:
        yield address, servicer


STORED_THEN_LOST = (grpc.StatusCode.UNAVAILABLE, "this node stopped being the master before acknowledging the "
                    "write: outcome unknown", (("tidemark-outcome", "unknown"),))
SLAVE = (grpc.StatusCode.FAILED_PRECONDITION, "this node is a slave; its master is silent or unknown (an election "
         "may be under way): retry", (("tidemark-master", ""),))


def _fenced_refusal(data_dir: Path) -> Answer:
    """What a real store answers a write once fenced, knowing no other master."""
    store = open_store(str(data_dir))
    try:
        store.fence("slave n2 knows epoch 3 > ours 2")
        with pytest.raises(StoreRefusal) as refused:
            store.check_writable()
    finally:
        store.crash_close()
    error = refused.value
    return getattr(grpc.StatusCode, error.code), error.message, tuple(error.metadata)


@pytest.mark.parametrize("node", [STORED_THEN_LOST], indirect=True)
def test_a_send_whose_first_answer_was_lost_ends_unknown_not_refused(node: tuple[str, _FailingOver]) -> None:
    address, servicer = node
    with BrokerClient(address, timeout_s=1.5) as c, pytest.raises(BrokerError) as gave_up:
        c.send("t", [Message(b"committed, maybe")], ack="leader")
    assert servicer.sends > 2, "retried on the refusals until the deadline"
    assert gave_up.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, gave_up.value
    assert "whether it took effect is not known" in gave_up.value.details
    assert "stopped being the master" in gave_up.value.details and "this node is a slave" in gave_up.value.details


@pytest.mark.parametrize("node", [SLAVE], indirect=True)
def test_a_send_refused_by_every_attempt_ends_refused(node: tuple[str, _FailingOver]) -> None:
    """Nothing of it was executed anywhere: the refusal is the answer (FAILED_PRECONDITION)."""
    address, servicer = node
    with BrokerClient(address, timeout_s=1.0) as c, pytest.raises(BrokerError) as refused:
        c.send("t", [Message(b"never stored")], ack="leader")
    assert servicer.sends > 2
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION, refused.value
    assert "this node is a slave" in refused.value.details


@pytest.mark.parametrize("node", [STORED_THEN_LOST], indirect=True)
def test_a_client_that_does_not_follow_the_master_says_unknown_too(node: tuple[str, _FailingOver]) -> None:
    """``follow_master=False``: the refusal ends the call at once, and still not as "not done"."""
    address, servicer = node
    with BrokerClient(address, timeout_s=1.5, follow_master=False) as c, pytest.raises(BrokerError) as gave_up:
        c.send("t", [Message(b"committed, maybe")], ack="leader")
    assert servicer.sends == 2
    assert gave_up.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, gave_up.value


def test_a_fenced_master_refusal_after_a_lost_answer_ends_unknown_not_refused(tmp_path: Path) -> None:
    """A master fenced after it stored a write (a newer epoch met meanwhile) refuses the retries: that
    refusal names no master, and it must not turn the lost answer into "not done" either. Without
    ``tidemark-master`` on it the client raised FAILED_PRECONDITION at once (stop 58's note)."""
    fenced = _fenced_refusal(tmp_path / "store")
    assert fenced[0] == grpc.StatusCode.FAILED_PRECONDITION and fenced[2] == (("tidemark-master", ""),), fenced
    servicer = _FailingOver(STORED_THEN_LOST, fenced)
    with _serving(servicer) as address:
        for follow_master in (True, False):
            servicer.sends = 0
            with (BrokerClient(address, timeout_s=1.5, follow_master=follow_master) as c,
                  pytest.raises(BrokerError) as gave_up):
                c.send("t", [Message(b"committed, maybe")], ack="leader")
            assert gave_up.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, (follow_master, gave_up.value)
            assert "whether it took effect is not known" in gave_up.value.details
            assert "this node is fenced" in gave_up.value.details
            assert servicer.sends > 2 if follow_master else servicer.sends == 2
