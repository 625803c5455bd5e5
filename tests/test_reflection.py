"""Server reflection, v1 and v1alpha, used the way grpcurl uses it: list the services, describe
the Broker service from the descriptors the server sends, and invoke Send, Pull and Status with
JSON requests through message classes built from those descriptors alone (no generated code).

grpcurl itself runs in tests/test_grpcurl.py; this test is a reflection client doing what
`grpcurl list`, `grpcurl describe tidemark.v1.Broker` and `grpcurl -d '{...}' HOST
tidemark.v1.Broker/Send` do, over both versions.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as r

from broker.client import BrokerClient
from tests.procs import DaemonProcess

VERSIONS = ["grpc.reflection.v1", "grpc.reflection.v1alpha"]


class Reflection:
    """A client of one reflection version (the messages are the same on the wire for both)."""

    def __init__(self, channel: grpc.Channel, version: str) -> None:
        self._call = channel.stream_stream(f"/{version}.ServerReflection/ServerReflectionInfo",
                                           request_serializer=r.ServerReflectionRequest.SerializeToString,
                                           response_deserializer=r.ServerReflectionResponse.FromString)

    def ask(self, **request: Any) -> r.ServerReflectionResponse:
        (resp,) = list(self._call(iter([r.ServerReflectionRequest(**request)]), timeout=10))
        assert not resp.HasField("error_response"), resp.error_response.error_message
        return resp

    def list(self) -> list[str]:
        return sorted(s.name for s in self.ask(list_services="").list_services_response.service)

    def pool_for(self, symbol: str) -> descriptor_pool.DescriptorPool:
        """A pool holding the file that defines ``symbol`` and every file it imports."""
        pool = descriptor_pool.DescriptorPool()
        files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
        todo = list(self.ask(file_containing_symbol=symbol).file_descriptor_response.file_descriptor_proto)
        while todo:
            fdp = descriptor_pb2.FileDescriptorProto.FromString(todo.pop())
            if fdp.name in files:
                continue
            files[fdp.name] = fdp
            for dep in fdp.dependency:
                if dep not in files:
                    todo += self.ask(file_by_filename=dep).file_descriptor_response.file_descriptor_proto

        def add(name: str) -> None:
            fdp = files.pop(name, None)
            if fdp is not None:
                for dep in fdp.dependency:
                    add(dep)
                pool.Add(fdp)

        for name in list(files):
            add(name)
        return pool


def invoke(channel: grpc.Channel, pool: descriptor_pool.DescriptorPool, method: str, request_json: str) -> dict:  # type: ignore[type-arg]
    """`grpcurl -d JSON host tidemark.v1.Broker/METHOD`: JSON in, JSON out, types from reflection."""
    service, name = method.rsplit("/", 1)
    m = pool.FindServiceByName(service).FindMethodByName(name)
    req_cls = message_factory.GetMessageClass(m.input_type)
    resp_cls = message_factory.GetMessageClass(m.output_type)
    request = json_format.Parse(request_json, req_cls())
    call = channel.unary_unary(f"/{service}/{name}", request_serializer=lambda x: x.SerializeToString(),
                               response_deserializer=resp_cls.FromString)
    return json_format.MessageToDict(call(request, timeout=10), preserving_proto_field_name=True)


@pytest.fixture
def channel(daemon: DaemonProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon.address) as ch:
        yield ch


@pytest.mark.parametrize("version", VERSIONS)
def test_list_and_describe(channel: grpc.Channel, version: str) -> None:
    refl = Reflection(channel, version)
    assert refl.list() == ["grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                           "grpc.reflection.v1alpha.ServerReflection", "tidemark.v1.Broker", "tidemark.v1.Replication"]
    pool = refl.pool_for("tidemark.v1.Broker")
    methods = {m.name for m in pool.FindServiceByName("tidemark.v1.Broker").methods}
    assert {"Send", "Pull", "Status", "CreateTopic", "Pop", "Ack", "Heartbeat"} <= methods
    status = pool.FindMessageTypeByName("tidemark.v1.NodeStatus")
    assert {"role", "epoch", "confirm_offset", "replicas", "coordinator", "errors"} <= set(status.fields_by_name)
    assert pool.FindEnumTypeByName("tidemark.v1.Role").values_by_name["ROLE_MASTER"].number == 1
    # the reflection services describe themselves too (grpcurl describe grpc.reflection.v1.ServerReflection)
    assert refl.pool_for("grpc.reflection.v1.ServerReflection").FindServiceByName(
        "grpc.reflection.v1.ServerReflection").FindMethodByName("ServerReflectionInfo").client_streaming


def test_invoke_send_pull_and_status_with_json(channel: grpc.Channel, daemon: DaemonProcess) -> None:
    pool = Reflection(channel, VERSIONS[0]).pool_for("tidemark.v1.Broker")
    created = invoke(channel, pool, "tidemark.v1.Broker/CreateTopic", '{"name": "orders", "queues": 2}')
    assert created["topic"]["name"] == "orders"
    body = base64.b64encode(b"hello from json").decode()  # bytes are base64 in proto's JSON mapping
    sent = invoke(channel, pool, "tidemark.v1.Broker/Send", json.dumps(
        {"ack": "ACK_FLUSH", "messages": [{"topic": "orders", "queue_id": 1, "key": "k", "body": body,
                                          "properties": {"from": "json"}}]}))
    (receipt,) = sent["message_receipts"]
    assert receipt["queue_id"] == 1 and "queue_offset" not in receipt  # 0 is omitted in JSON: the first one
    pulled = invoke(channel, pool, "tidemark.v1.Broker/Pull",
                    '{"topic": "orders", "queue_id": 1, "offset": "0", "decode": true}')
    (m,) = pulled["messages"]
    assert base64.b64decode(m["body"]) == b"hello from json" and m["properties"] == {"from": "json"} and m["key"] == "k"
    st = invoke(channel, pool, "tidemark.v1.Broker/Status", "{}")
    assert st["status"]["role"] == "ROLE_MASTER" and int(st["status"]["confirm_offset"]) > 0
    with BrokerClient(daemon.address) as c:
        assert [x.body for x in c.pull("orders", 1, 0)] == [b"hello from json"]


def test_an_unknown_method_and_bad_json_fail_clearly(channel: grpc.Channel) -> None:
    pool = Reflection(channel, VERSIONS[1]).pool_for("tidemark.v1.Broker")
    with pytest.raises(KeyError):
        pool.FindServiceByName("tidemark.v1.Broker").FindMethodByName("Nope")
    with pytest.raises(grpc.RpcError) as exc:
        invoke(channel, pool, "tidemark.v1.Broker/Pull", '{"topic": "missing", "queue_id": 0, "decode": true}')
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    unknown: Callable[..., Any] = channel.unary_unary("/tidemark.v1.Broker/Nope")
    with pytest.raises(grpc.RpcError) as exc:
        unknown(b"", timeout=5)
    assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED  # type: ignore[attr-defined]
