"""The S3 backend (boto3): path-style addressing, conditional create with ``If-None-Match: *``,
ranged gets, and retries with exponential backoff (our own, so errors are counted per op).

A put is one ``PutObject`` (objects are at most ``tieredstore.object_bytes``, 1 GiB at most, below
S3's 5 GiB single-put limit): S3 stores it whole or not at all, so an interrupted upload never
leaves a live partial object and no multipart upload is ever left behind.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
import botocore.exceptions
from botocore.config import Config as BotoConfig

from tieredstore.backend import BackendError, ObjectExists, ObjectInfo, ObjectMissing

T = TypeVar("T")
BACKOFF_S_FIRST = 0.05
BACKOFF_S_MAX = 5.0
RETRY_STATUS = (408, 409, 429, 500, 502, 503, 504)  # 409: a concurrent conditional write; retry it


class S3Backend:
    name = "s3"

    def __init__(self, *, bucket: str, prefix: str = "", endpoint: str = "", region: str = "",
                 access_key_id: str = "", secret_access_key: str = "", retries_max: int = 5,
                 on_retry: Callable[[str], None] | None = None) -> None:
        if not bucket:
            raise BackendError("open", "tieredstore.s3_bucket is empty")
        self.bucket = bucket
        self.prefix = prefix
        self.retries_max = retries_max
        self.on_retry = on_retry or (lambda op: None)
        kwargs: dict[str, Any] = {
            "config": BotoConfig(s3={"addressing_style": "path"}, retries={"max_attempts": 1, "mode": "standard"},
                                 connect_timeout=10, read_timeout=120, max_pool_connections=16,
                                 request_checksum_calculation="when_required",
                                 response_checksum_validation="when_required"),
        }
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        if region:
            kwargs["region_name"] = region
        if access_key_id:
            kwargs["aws_access_key_id"] = access_key_id
            kwargs["aws_secret_access_key"] = secret_access_key
        session = boto3.session.Session()
        if not region and session.region_name is None:
            kwargs["region_name"] = "us-east-1"
        self.client = session.client("s3", **kwargs)

    # -- retries --------------------------------------------------------------------------------
    def _call(self, op: str, fn: Callable[[], T]) -> T:
        delay = BACKOFF_S_FIRST
        for attempt in range(self.retries_max + 1):
            try:
                return fn()
            except botocore.exceptions.ClientError as exc:
                status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
                code = str(exc.response.get("Error", {}).get("Code", ""))
                if status not in RETRY_STATUS or attempt == self.retries_max:
                    raise _translate(op, status, code, exc) from exc
            except (botocore.exceptions.BotoCoreError, ConnectionError, OSError) as exc:
                if attempt == self.retries_max:
                    raise BackendError(op, f"{type(exc).__name__}: {exc}") from exc
            self.on_retry(op)
            time.sleep(delay)
            delay = min(BACKOFF_S_MAX, delay * 2)
        raise AssertionError("unreachable")

    # -- operations ----------------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str]) -> None:
        def attempt() -> object:  # a fresh reader per attempt: a retry sends the body from its start
            return self.client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=_ViewReader(memoryview(data)),
                                          ContentLength=len(data), Metadata=metadata, IfNoneMatch="*")

        try:
            self._call("put", attempt)
        except _PreconditionFailed:
            raise ObjectExists(key) from None

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if end is not None and end <= start:
            return b""
        rng = f"bytes={start}-" if end is None else f"bytes={start}-{end - 1}"
        try:  # the body is read inside the retried call: a connection lost mid-body retries the whole get
            return self._call("get", lambda: bytes(self.client.get_object(Bucket=self.bucket, Key=self.prefix + key,
                                                                          Range=rng)["Body"].read()))
        except _NotFound:
            raise ObjectMissing("get", key) from None
        except BackendError as exc:
            if "InvalidRange" in str(exc):
                return b""
            raise

    def head(self, key: str) -> ObjectInfo | None:
        try:
            r = self._call("head", lambda: self.client.head_object(Bucket=self.bucket, Key=self.prefix + key))
        except _NotFound:
            return None
        return ObjectInfo(key, int(r["ContentLength"]), r["LastModified"].timestamp(), dict(r.get("Metadata", {})))

    def list(self, prefix: str, start_after: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        token = ""
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + prefix, "MaxKeys": 1000}
            if token:
                kwargs["ContinuationToken"] = token
            elif start_after:
                kwargs["StartAfter"] = self.prefix + start_after
            r = self._call("list", lambda kw=kwargs: self.client.list_objects_v2(**kw))  # type: ignore[misc]
            for o in r.get("Contents", []):
                out.append(ObjectInfo(o["Key"][len(self.prefix):], int(o["Size"]), o["LastModified"].timestamp()))
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    def delete(self, key: str) -> None:
        self._call("delete", lambda: self.client.delete_object(Bucket=self.bucket, Key=self.prefix + key))

    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist (tests and first starts)."""
        try:
            self._call("head", lambda: self.client.head_bucket(Bucket=self.bucket))
        except _NotFound:
            self._call("put", lambda: self.client.create_bucket(Bucket=self.bucket))

    def close(self) -> None:
        self.client.close()


class _ViewReader(io.RawIOBase):
    """A seekable file over a memoryview, so a 64 MiB object is sent without a 64 MiB copy."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view.cast("B") if view.format != "B" else view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._view) - self._pos)
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        out = self._view[self._pos : end].tobytes()
        self._pos = end
        return out


class _PreconditionFailed(BackendError):
    pass


class _NotFound(BackendError):
    pass


def _translate(op: str, status: int, code: str, exc: Exception) -> BackendError:
    if status == 412 or code == "PreconditionFailed":
        return _PreconditionFailed(op, str(exc))
    if status == 404 or code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
        return _NotFound(op, str(exc))
    return BackendError(op, f"HTTP {status} {code}: {exc}")
