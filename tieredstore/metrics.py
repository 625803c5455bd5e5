"""Prometheus metrics of tiered storage, in the daemon's registry (``broker.metrics.REGISTRY``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from broker.metrics import REGISTRY

UPLOADED_OFFSET = Gauge("tidemark_tiered_uploaded_offset_bytes",
                        "Tiered uploaded offset: every log byte below it is in object storage", registry=REGISTRY)
UPLOAD_LAG = Gauge("tidemark_tiered_upload_lag_bytes", "Confirm offset minus the tiered uploaded offset (master)",
                   registry=REGISTRY)
UPLOADED_BYTES = Counter("tidemark_tiered_uploaded_bytes", "Log bytes uploaded as objects", registry=REGISTRY)
UPLOADED_OBJECTS = Counter("tidemark_tiered_uploaded_objects", "Objects uploaded", registry=REGISTRY)
READ_BYTES = Counter("tidemark_tiered_read_bytes", "Object bytes fetched from the backend for reads below the local log",
                     registry=REGISTRY)
CACHE_HITS = Counter("tidemark_tiered_cache_hits", "Read-through cache hits (blocks)", registry=REGISTRY)
BACKEND_ERRORS = Counter("tidemark_tiered_backend_errors", "Backend operations that failed or were retried, by op",
                         ["op"], registry=REGISTRY)
DELETED_OBJECTS = Counter("tidemark_tiered_deleted_objects", "Objects deleted by tiered retention", registry=REGISTRY)
PUT_SECONDS = Histogram("tidemark_tiered_put_seconds", "Duration of one object put", registry=REGISTRY,
                        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0))
