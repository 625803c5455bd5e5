"""The tiered backend contract on posix, moto and a real radosgw; object names and retention rules."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest

from broker.invariant import CorruptionError
from broker.logformat import batch as bf
from tests.procs import free_port
from tests.s3server import ACCESS_KEY, SECRET_KEY
from tieredstore.backend import Backend, BackendError, ObjectExists, ObjectInfo, ObjectMissing
from tieredstore.index import ObjectIndex
from tieredstore.objects import TieredObject, describe, object_key, parse_key, runs, whole_batches
from tieredstore.posix import PosixBackend
from tieredstore.retention import plan_deletions
from tieredstore.s3 import S3Backend

pytestmark = pytest.mark.xdist_group("radosgw")  # make test's workers: one Ceph cluster (the session's radosgw) on one worker

_buckets = itertools.count()


def _s3(endpoint: str, **kwargs: Any) -> S3Backend:
    b = S3Backend(bucket=f"contract-{os.getpid()}-{next(_buckets)}", prefix="p/", endpoint=endpoint,
                  region="us-east-1", access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY, **kwargs)
    b.ensure_bucket()
    return b


@pytest.fixture(params=["posix", "moto", "radosgw"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "posix":
        b: Backend = PosixBackend(str(tmp_path / "tiered"), "n1")
    else:
        server = request.getfixturevalue("moto_s3" if request.param == "moto" else "radosgw")
        b = _s3(server.endpoint)
    yield b
    b.close()


def test_put_get_head_list_delete(backend: Backend) -> None:
    """Objects round-trip with metadata; ranged gets return exactly the asked bytes."""
    data = os.urandom(100_000)
    backend.put("log/a", data, {"tm-start": "0", "tm-crc32c": "abc"})
    assert backend.get("log/a") == data
    assert backend.get("log/a", 10, 20) == data[10:20]
    assert backend.get("log/a", 99_990) == data[99_990:]
    assert backend.get("log/a", 99_990, 200_000) == data[99_990:]
    head = backend.head("log/a")
    assert head is not None and head.size_bytes == len(data) and head.metadata["tm-crc32c"] == "abc"
    assert backend.head("log/missing") is None
    with pytest.raises(ObjectMissing):
        backend.get("log/missing")
    backend.delete("log/a")
    backend.delete("log/a")  # already gone: no error
    assert backend.head("log/a") is None and backend.list("log/") == []


def test_conditional_put_never_overwrites(backend: Backend) -> None:
    """A second put to an existing key raises ObjectExists and leaves the first bytes in place."""
    backend.put("log/k", b"first", {})
    with pytest.raises(ObjectExists):
        backend.put("log/k", b"second", {})
    assert backend.get("log/k") == b"first"


def test_list_by_prefix_in_key_order(backend: Backend) -> None:
    """list() returns keys under a prefix, sorted, with sizes; start_after skips a prefix of them."""
    for k in ("log/003", "log/001", "log/002", "other/001"):
        backend.put(k, k.encode() * 3, {})
    listed = backend.list("log/")
    assert [o.key for o in listed] == ["log/001", "log/002", "log/003"]
    assert all(o.size_bytes == 21 for o in listed)
    assert [o.key for o in backend.list("log/", start_after="log/001")] == ["log/002", "log/003"]


def test_posix_interrupted_put_leaves_no_object(tmp_path: Path) -> None:
    """A temporary file left by a crash is never listed as an object and clean_tmp removes it."""
    b = PosixBackend(str(tmp_path / "t"), "n1")
    (tmp_path / "t" / ".tmp" / "n1.deadbeef").write_bytes(b"partial")
    (tmp_path / "t" / ".tmp" / "n2.cafe").write_bytes(b"another node's")
    assert b.list("") == []
    assert b.clean_tmp() == 1
    assert sorted(os.listdir(tmp_path / "t" / ".tmp")) == ["n2.cafe"]


def test_s3_retries_with_backoff_then_fails() -> None:
    """An unreachable endpoint is retried with growing delays, counted per op, then reported."""

    retried: list[str] = []
    b = S3Backend(bucket="b", endpoint=f"http://127.0.0.1:{free_port()}", region="us-east-1", access_key_id="a",
                  secret_access_key="s", retries_max=3, on_retry=retried.append)
    t0 = time.monotonic()
    with pytest.raises(BackendError) as info:
        b.put("log/x", b"x", {})
    assert info.value.op == "put" and retried == ["put"] * 3
    assert time.monotonic() - t0 >= 0.05 + 0.1 + 0.2


def _batches(start: int, count: int, epoch: int = 1) -> bytes:
    out = b""
    for i in range(count):
        records, _ = bf.encode_records([(b"body-%d" % i, b"", b"")])
        topic = b"t"
        size = bf.HEADER_BYTES + len(topic) + len(records)
        out += bf.build_header(batch_bytes=size, record_count=1, base_offset=start + len(out), base_queue_offset=i,
                               store_time_ms=1000 + i, producer_id=0, base_sequence=-1, epoch=epoch, queue_id=0,
                               topic_raw=topic, body_crc=crc32c.crc32c(records)) + records
    return out


def test_describe_names_objects_by_range_epoch_and_crc() -> None:
    """An object's key carries its range, last epoch and CRC32C, and parses back."""
    data = _batches(4096, 5, epoch=3)
    d = describe(data, 4096)
    assert (d.obj.start, d.obj.end, d.obj.epoch, d.obj.crc, d.batches) == (4096, 4096 + len(data), 3, crc32c.crc32c(data), 5)
    assert parse_key(d.obj.key) == d.obj
    assert d.obj.key == object_key(4096, 4096 + len(data), 3, d.obj.crc)
    assert sorted([object_key(10, 20, 1, 0), object_key(9, 10, 1, 0), object_key(100, 200, 1, 0)]) == [
        object_key(9, 10, 1, 0), object_key(10, 20, 1, 0), object_key(100, 200, 1, 0)]  # key order = offset order
    assert parse_key("log/junk") is None


def test_describe_refuses_corrupt_or_cut_batches() -> None:
    """Nothing with a bad CRC, a wrong offset or a cut batch is described (so never uploaded)."""
    data = bytearray(_batches(0, 3))
    with pytest.raises(CorruptionError):
        describe(bytes(data), 64)  # offsets do not match
    with pytest.raises(CorruptionError):
        describe(bytes(data[:-1]), 0)
    data[-1] ^= 1
    with pytest.raises(CorruptionError):
        describe(bytes(data), 0)


def test_whole_batches_cuts_at_a_boundary() -> None:
    """An object is cut at the last batch boundary within the limit (or holds one big batch)."""
    data = _batches(0, 4)
    one = bf.peek_batch_bytes(data, 0)
    assert whole_batches(data, 0, one * 2 + 1) == one * 2
    assert whole_batches(data, 0, 1) == one
    assert whole_batches(data[:-3], 0, 10**9) == one * 3


def test_retention_plan_keeps_newest_unexpired_and_held() -> None:
    """Tiered retention deletes an expired prefix only: never the newest, nor at/above a hold."""
    objs = [TieredObject(i * 10, i * 10 + 10, 1, 0, modified_s=100.0 + i) for i in range(6)]
    assert plan_deletions(objs, 1000.0, 0, None) == []
    assert plan_deletions(objs, 1000.0, 1, None) == objs[:5]  # the newest stays: the break point
    assert plan_deletions(objs, 1000.0, 1, 30) == objs[:3]  # object [30, 40) holds offset 30
    assert plan_deletions(objs, 1000.0, 1, 35) == objs[:3]
    assert plan_deletions(objs, 103.5, 1000, None) == objs[:3]  # objects modified after 102.5 are young
    assert runs(objs[:2] + objs[3:]) == [objs[:2], objs[3:]]


class _HeldListing(PosixBackend):
    """A posix backend whose listing, once read, waits until released (a slow LIST)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.listed = threading.Event()
        self.release = threading.Event()

    def list(self, prefix: str, start_after: str = "") -> list[ObjectInfo]:
        out = super().list(prefix, start_after)
        self.listed.set()
        self.release.wait(10)
        return out


def test_a_listing_never_brings_back_an_object_removed_while_it_ran(tmp_path: Path) -> None:
    """Tiered retention removes an object from the index, then deletes it; a refresh whose listing
    began before that must not put it back (a read would then be served the deleted range from the
    block cache: CI saw a pull below tiered retention succeed)."""
    backend = _HeldListing(str(tmp_path))
    old, new = TieredObject(0, 10, 1, 0), TieredObject(10, 20, 1, 0)
    for o in (old, new):
        backend.put(o.key, b"x" * o.size_bytes, {})
    index = ObjectIndex(backend)
    backend.release.set()
    assert index.refresh() == [old, new]
    backend.release.clear()
    backend.listed.clear()
    refresh = threading.Thread(target=index.refresh)
    refresh.start()
    assert backend.listed.wait(10)  # the listing still names ``old``
    index.remove(old)
    backend.delete(old.key)
    backend.release.set()
    refresh.join(10)
    assert index.objects() == [new]
    assert index.refresh() == [new]
