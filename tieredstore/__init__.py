"""tieredstore: confirmed log ranges in object storage, safe under failover (DESIGN §6).

- ``backend``: the five-operation interface; ``posix`` (a shared directory) and ``s3`` (boto3).
- ``objects``: object names, metadata, checks (docs/formats/tiered-objects.md).
- ``uploader``: master-only upload below the confirm offset, break point from the object store.
- ``reader``/``cache``/``index``: read-through of ranges below the local log start.
- ``retention``: whole-object retention that honours ``store.retention.read_floor()``.
- ``plugin``: the ``tidemark.plugins`` entry point that wires it into a daemon.
"""
