"""A ``PullResponse`` read from its wire bytes, each run of batches a span of them.

The protobuf parser copies every ``bytes`` field into its own memory, and reading the repeated
``batches`` field copies each run again into a new ``bytes`` object: two copies of up to 16 MiB
per pull before the reader looks at a record (issue 18: 0.10 and 0.10-0.15 µs a 1 KiB row in the
Spark reader). The server builds this response by hand (``broker/daemon/wire.pull_response_bytes``):
the runs of batches and five integers. This reader walks them (``broker/protowire.py``) and
keeps each run as a span of the response: ``batch_views()`` gives views (no copy, for columnar
readers), ``batches`` gives ``bytes`` (one copy, for readers that slice bodies out as ``bytes``).

It takes only what it fully understands and leaves the rest to ``PullResponse.FromString``:
decoded messages (field 7, the any-language API's ``decode``), an unknown field, a wire type
other than the field's, a field running past its message. So every response gets the answer the
protobuf parser would give it (scalars: the last occurrence wins; integers cut to their type's
width).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.protowire import LEN, U32, NotFast, fields
from proto import tidemark_pb2 as pb

RESPONSE_FIELDS_MAX = 4096  # a pull answers a few runs of batches; beyond this, the protobuf parser


@dataclass(slots=True)
class PullResponseView:
    """The fields of a ``PullResponse`` without decoded messages; runs of batches as spans of ``data``."""

    data: bytes = b""
    spans: list[tuple[int, int]] = field(default_factory=list)
    skip_first: int = 0
    count: int = 0
    next_offset: int = 0
    min_offset: int = 0
    max_offset: int = 0
    messages: tuple[pb.PulledMessage, ...] = ()

    @property
    def batches(self) -> list[bytes]:
        """The runs of batches as ``bytes`` (one copy each), as ``PullResponse.batches`` reads."""
        return [self.data[a:z] for a, z in self.spans]

    def batch_views(self) -> list[memoryview]:
        """The runs of batches as views of the response (no copy)."""
        view = memoryview(self.data)
        return [view[a:z] for a, z in self.spans]


def parse_pull_response(data: bytes) -> PullResponseView | pb.PullResponse:
    """The response in ``data``: a ``PullResponseView`` when this reader takes it, else the
    protobuf parser's ``PullResponse`` (or its ``DecodeError``)."""
    try:
        response = PullResponseView(data=data)
        for number, wire, a, z in fields(data, 0, len(data), RESPONSE_FIELDS_MAX):
            if wire == LEN:
                if number != 1:
                    raise NotFast
                response.spans.append((a, z))
            elif number == 2:
                response.skip_first = a & U32
            elif number == 3:
                response.count = a & U32
            elif number == 4:
                response.next_offset = a
            elif number == 5:
                response.min_offset = a
            elif number == 6:
                response.max_offset = a
            else:
                raise NotFast
        return response
    except NotFast:
        return pb.PullResponse.FromString(data)
