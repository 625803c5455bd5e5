"""The Python client reads well (DESIGN §13): reprs show what results hold, failures are
``BrokerError`` subclasses with the gRPC code (never a bare ``grpc.RpcError``), the package is
typed (``py.typed``) and every public method says what it does."""

from __future__ import annotations

import ast
import importlib.resources
import inspect
from pathlib import Path

import grpc
import pytest

import broker.client as client_pkg
from broker.client import (
    AlreadyExists,
    BrokerClient,
    BrokerError,
    InvalidArgument,
    Message,
    NotFound,
    OutOfRange,
)
from proto import tidemark_pb2 as pb
from tests.procs import DaemonProcess


def test_reprs_show_what_results_hold(daemon: DaemonProcess) -> None:
    with BrokerClient(daemon.address) as c:
        c.create_topic("orders", queues=2)
        sent = c.send("orders", [Message(b"body-%d" % i + b"x" * 40, key="k") for i in range(5)], ack="flush")
        r = repr(sent)
        assert r.startswith("Receipts(orders: 5 messages [") and ", ...]" in r
        qid = sent[0].queue_id
        # the acknowledged batch is readable once the dispatcher applied it, a few ms after the ack
        # at most (a checkpoint may be running): wait for it rather than race it
        pulled = c.pull("orders", qid, 0, max_wait_ms=5000)
        r = repr(pulled)
        assert f"PullResult(5 messages [orders/{qid}@0, orders/{qid}@1, orders/{qid}@2, ...]" in r
        assert "next_offset=5" in r
        m = repr(pulled[0])
        assert f"orders/{qid}@0" in m and "key='k'" in m and "b'body-0xxx" in m and "(46 B)" in m
        assert repr(Message(b"x" * 100, key="k")) == "Message(b'" + "x" * 32 + "'... (100 B), key='k')"
        popped = c.pop("g", "orders", max_messages=3, start="earliest")
        assert repr(popped).startswith("PopResult(orders: 3 messages in 1 runs")
        assert "delivery 1" in repr(popped[0]) and "b'body-" in repr(popped[0])


def test_failures_are_broker_errors_with_their_grpc_code(daemon: DaemonProcess) -> None:
    with BrokerClient(daemon.address) as c:
        c.create_topic("t")
        with pytest.raises(AlreadyExists) as exists:
            c.create_topic("t")
        assert exists.value.code == grpc.StatusCode.ALREADY_EXISTS and isinstance(exists.value, BrokerError)
        assert "ALREADY_EXISTS" in str(exists.value) and repr(exists.value).startswith("AlreadyExists(ALREADY_EXISTS,")
        with pytest.raises(NotFound):
            c.pull("nope", 0, 0)
        with pytest.raises(OutOfRange):
            c.pull("t", 0, 10)
        with pytest.raises(InvalidArgument):
            c.pull("t", 0, -1)
        with pytest.raises(InvalidArgument):
            list(c.iter_pull("t", 5, 0))  # the pipelined path too
        with pytest.raises(NotFound):
            c.send("nope", [Message(b"x")])
        st = c.typed_status()
        assert st.role == pb.ROLE_MASTER and st.epoch == c.status()["epoch"]


def test_the_client_package_is_typed_and_documented() -> None:
    assert (importlib.resources.files("broker") / "py.typed").is_file()
    pyproject = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    assert 'broker = ["py.typed"]' in pyproject  # shipped in the wheel, not only in the tree
    undocumented = []
    for name in client_pkg.__all__:
        obj = getattr(client_pkg, name)
        if not inspect.getdoc(obj):
            undocumented.append(name)
        if inspect.isclass(obj):
            (cls,) = ast.parse(inspect.getsource(obj)).body
            assert isinstance(cls, ast.ClassDef)
            for fn in cls.body:  # its methods (not functions nested in them)
                if isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_") and not ast.get_docstring(fn):
                    undocumented.append(f"{name}.{fn.name}")
    assert not undocumented, f"public names without a docstring: {undocumented}"
