"""Generated gRPC/protobuf modules for ``tidemark.proto`` (regenerate with ``make proto``)."""
