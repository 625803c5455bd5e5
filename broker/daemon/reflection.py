"""Server reflection under both names tools ask for: ``grpc.reflection.v1`` (grpcurl and newer
tools try it first) and ``grpc.reflection.v1alpha`` (older ones).

grpcio-reflection ships only v1alpha. The v1 protocol is the same messages with the same field
numbers under another package, so one servicer answers both: the v1 service is registered with
v1alpha's (de)serializers, and a copy of v1alpha's file descriptor renamed to the v1 package is
added to the descriptor pool so that ``describe grpc.reflection.v1.ServerReflection`` works too.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE = reflection.SERVICE_NAME
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """v1alpha's file descriptor, renamed to v1, in ``pool`` (once)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(fdp)
    old = f".{fdp.package}."
    fdp.name, fdp.package = _V1_FILE, V1_PACKAGE
    for message in fdp.message_type:
        for f in message.field:
            if f.type_name.startswith(old):
                f.type_name = f".{V1_PACKAGE}." + f.type_name[len(old):]
    for service in fdp.service:
        for method in service.method:
            method.input_type = f".{V1_PACKAGE}." + method.input_type[len(old):]
            method.output_type = f".{V1_PACKAGE}." + method.output_type[len(old):]
    fdp.ClearField("options")
    pool.Add(fdp)


def enable(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Serve reflection for ``service_names`` (the reflection services are added) as v1 and v1alpha."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.aio.ReflectionServicer([*service_names, V1_SERVICE, V1ALPHA_SERVICE])
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha.ServerReflectionRequest.FromString,
        response_serializer=v1alpha.ServerReflectionResponse.SerializeToString,
    )
    for name in (V1_SERVICE, V1ALPHA_SERVICE):
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": info}),))
