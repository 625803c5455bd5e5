"""Snapshot bundles (DESIGN §4; spec docs/formats/snapshot-bundle.md).

Master: under the views lock, bring every view to the confirm offset S and checkpoint it, then
copy the checkpoint files, the consume-queue files (to their checkpointed lengths) and an LMDB
copy into a staging directory. The log bytes [L, S) (L = the local log start, or with tiered
storage min(S, tiered uploaded offset): see ``bundle_log_start``) are read straight
from the segments while retention is held back. Everything is streamed as CRC32C-checked chunks;
the last message is the manifest (S, L, epochs, cluster id, and each file's length and CRC32C).

Slave: ``install`` writes the chunks into ``<data_dir>.bootstrap``, checks every chunk and every
file, writes its identity and epoch history, fsyncs, and renames the staging directory into
place: a bundle is only ever installed where no data directory exists (or an empty one).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import crc32c
import grpc
import structlog

from broker.storage import atomic_file, epochs, identity
from broker.storage.dirlock import LOCK_NAME, DirLock, only_lock_inside
from broker.storage.failpoints import fsync_dir
from broker.storage.segment import segment_name
from broker.store import Store
from proto import tidemark_pb2 as pb
from proto import tidemark_pb2_grpc as pb_grpc

log = structlog.get_logger("replication.bundle")
CHUNK_BYTES = 1 << 20


def bundle_log_start(store: Store, snapshot: int) -> int:
    """L: where the new slave's local log starts (DESIGN §4).

    With tiered storage, L = min(S, tiered uploaded offset as the log records it at S): everything
    below is in object storage, so it is not copied. Never above that offset (a later promotion
    would lack confirmed data held nowhere else), never below the master's own log start.
    Without tiered storage, L = the master's local log start.
    """
    local = store.log.min_offset
    if store.reads.cold_reader is None:
        return local
    return max(local, min(snapshot, store.views.metadata.tiered_uploaded_offset))


def make_bundle(store: Store, staging: str) -> tuple[dict[str, Any], int]:
    """Checkpoint every view at one offset and stage their files; return (manifest, retention hold id)."""
    dispatcher = store.dispatcher
    with dispatcher.lock:
        dispatcher.apply_until(store.watermarks.confirm_offset)
        dispatcher.checkpoint_views()
        snapshot = store.views.applied_min()
        log_start = bundle_log_start(store, snapshot)
        hold = store.retention.hold(log_start)
        for view in store.views.all:
            view.stage(store.data_dir, staging)
        epoch_entries = store.epochs.snapshot()
    manifest = {"snapshot_offset": snapshot, "log_start": log_start, "cluster_id": store.identity.cluster_id,
                "epochs": epoch_entries, "files": []}
    return manifest, hold


def _chunks(path: str, rel: str, start: int, length: int, files: list[dict[str, Any]], read: Any) -> Iterator[pb.SnapshotChunk]:
    crc = 0
    pos = 0
    while pos < length:
        data = read(start + pos, min(CHUNK_BYTES, length - pos))
        if not data:
            raise OSError(f"{path}: short read at {start + pos}")
        c = crc32c.crc32c(data)
        crc = crc32c.crc32c(data, crc)
        yield pb.SnapshotChunk(path=rel, offset=pos, data=data, crc32c=c)
        pos += len(data)
    files.append({"path": rel, "bytes": length, "crc32c": crc})


def stream_bundle(store: Store, request: pb.SnapshotRequest, context: grpc.ServicerContext) -> Iterator[pb.SnapshotChunk]:
    if request.cluster_id and request.cluster_id != store.identity.cluster_id:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cluster mismatch: master is {store.identity.cluster_id}")
    if store.role != "master" or store.fenced_reason:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "snapshots come from an unfenced master")
    staging = tempfile.mkdtemp(prefix="bundle-", dir=store.data_dir)
    hold = 0
    try:
        manifest, hold = make_bundle(store, staging)
        files: list[dict[str, Any]] = []
        for root, _, names in os.walk(staging):
            for name in sorted(names):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, staging)
                with open(path, "rb") as f:
                    yield from _chunks(path, rel, 0, os.path.getsize(path), files,
                                       lambda at, n, f=f: (f.seek(at), f.read(n))[1])
        log_start = manifest["log_start"]
        for seg in store.log.segments:  # the log bytes [L, S), segment by segment (the first may start at L inside one)
            if seg.start_offset >= manifest["snapshot_offset"]:
                break
            if seg.end_offset <= log_start:
                continue
            first = max(seg.start_offset, log_start)
            length = min(seg.end_offset, manifest["snapshot_offset"]) - first
            yield from _chunks(seg.path, f"log/{segment_name(first)}", first - seg.start_offset, length, files, seg.read)
        manifest["files"] = files
        store.retention.release(hold)  # before the last yield: the client may never read past it
        shutil.rmtree(staging, ignore_errors=True)
        log.info("snapshot_streamed", snapshot_offset=manifest["snapshot_offset"], log_start=manifest["log_start"],
                 files=len(files), bytes=sum(f["bytes"] for f in files))
        yield pb.SnapshotChunk(manifest_json=json.dumps(manifest))
    finally:
        store.retention.release(hold)
        shutil.rmtree(staging, ignore_errors=True)


class BundleError(Exception):
    pass


def install(master: str, data_dir: str, lock: DirLock, cluster_id: str = "", timeout_s: float = 600.0,
            channel: Callable[[str], grpc.Channel] | None = None,
            metadata: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """Fetch a bundle from ``master`` and install it as ``data_dir``, which holds nothing but its
    ``LOCK`` (``lock``, held by the caller; on success it holds the new directory's lock).
    ``channel`` opens the connection (default: plaintext); ``metadata`` goes with the call (a token)."""
    if not only_lock_inside(data_dir):
        raise BundleError(f"{data_dir} is not empty: a bundle is only installed into an empty directory")
    staging = data_dir.rstrip("/") + ".bootstrap"
    staged_lock = DirLock.acquire(staging)  # ours before we touch it: a second bootstrap is refused here
    for name in os.listdir(staging):  # what an interrupted earlier attempt left
        if name != LOCK_NAME:
            path = os.path.join(staging, name)
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
    try:
        manifest = _fetch_and_install(master, data_dir, staging, cluster_id, timeout_s, channel, metadata)
    except BaseException:
        staged_lock.release()
        raise
    lock.release()
    lock.fd = staged_lock.fd
    lock.moved_to(data_dir)
    return manifest


class _StagedFile:
    """A bundle file being written to the staging directory: its running CRC32C, and every
    ``RELEASE_STEP_BYTES`` its written bytes synced and their pages given back to the kernel. The
    install reads the log files no more, and writing into pages recycled this way is several times
    cheaper on this VM than into pages it never touched (docs/operations.md §3): a 1 GiB bootstrap
    took 3.6-4.0 s, and 2.1-3.0 s with it."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.crc = 0
        self.written = 0
        self.released = 0

    def write(self, data: bytes) -> None:
        self.file.write(data)
        self.crc = crc32c.crc32c(data, self.crc)
        self.written += len(data)
        if self.written - self.released >= RELEASE_STEP_BYTES:
            self.file.flush()
            os.fdatasync(self.file.fileno())
            try:  # advice: a refusal costs speed, never the bootstrap
                os.posix_fadvise(self.file.fileno(), self.released, self.written - self.released, os.POSIX_FADV_DONTNEED)
            except OSError as exc:
                log.warning("page_cache_release_skipped", path=self.file.name, error=str(exc))
            self.released = self.written

    def close(self) -> None:
        """Sync and close; the descriptor is closed even when the sync fails."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        finally:
            self.file.close()


RELEASE_STEP_BYTES = 32 << 20


def _close_all(handles: dict[str, _StagedFile], crcs: dict[str, int]) -> None:
    """Close every staged file (each synced) and note its CRC; the first failure is raised once all
    are closed, unless an error is already on its way out (it stays the one reported)."""
    first: OSError | None = None
    for rel, f in handles.items():
        try:
            f.close()
        except OSError as exc:
            first = first or exc
        crcs[rel] = f.crc
    if first is not None and sys.exc_info()[1] is None:
        raise first


def _fetch_and_install(master: str, data_dir: str, staging: str, cluster_id: str, timeout_s: float,
                       channel: Callable[[str], grpc.Channel] | None,
                       metadata: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    crcs: dict[str, int] = {}
    manifest: dict[str, Any] | None = None
    options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 64 << 20)]
    with channel(master) if channel else grpc.insecure_channel(master, options=options) as ch:
        stream = pb_grpc.ReplicationStub(ch).Snapshot(pb.SnapshotRequest(cluster_id=cluster_id), timeout=timeout_s,
                                                      metadata=metadata)
        handles: dict[str, _StagedFile] = {}
        try:
            for chunk in stream:
                if chunk.manifest_json:
                    manifest = json.loads(chunk.manifest_json)
                    break
                if crc32c.crc32c(chunk.data) != chunk.crc32c:
                    raise BundleError(f"chunk of {chunk.path} at {chunk.offset}: checksum mismatch")
                rel = os.path.normpath(chunk.path)
                if rel.startswith("..") or os.path.isabs(rel):
                    raise BundleError(f"bad path in bundle: {chunk.path!r}")
                f = handles.get(rel)
                if f is None:
                    path = os.path.join(staging, rel)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    f = handles[rel] = _StagedFile(path)
                if f.written != chunk.offset:
                    raise BundleError(f"chunk of {chunk.path} at {chunk.offset}, expected {f.written}")
                f.write(chunk.data)
        finally:
            _close_all(handles, crcs)
    if manifest is None:
        raise BundleError("the bundle stream ended without a manifest")
    for entry in manifest["files"]:
        rel = os.path.normpath(entry["path"])
        if rel.startswith("..") or os.path.isabs(rel):
            raise BundleError(f"bad path in manifest: {entry['path']!r}")
        if entry["bytes"] == 0 and rel not in crcs:  # an empty file travels as no chunk at all
            os.makedirs(os.path.dirname(os.path.join(staging, rel)), exist_ok=True)
            open(os.path.join(staging, rel), "wb").close()
            crcs[rel] = 0
        if crcs.get(rel) != entry["crc32c"] or os.path.getsize(os.path.join(staging, rel)) != entry["bytes"]:
            raise BundleError(f"{rel}: length or checksum differs from the manifest")
    log_dir = os.path.join(staging, "log")
    os.makedirs(log_dir, exist_ok=True)
    if not os.listdir(log_dir):  # an empty log still needs its first segment at L
        open(os.path.join(log_dir, segment_name(manifest["log_start"])), "wb").close()
    ident = identity.Identity(manifest["cluster_id"], uuid.uuid4().hex[:12])
    atomic_file.persist(os.path.join(staging, identity.FILE_NAME), identity.MAGIC, identity.VERSION,
                        json.dumps(ident.__dict__).encode())
    atomic_file.persist(os.path.join(staging, epochs.FILE_NAME), epochs.MAGIC, epochs.VERSION,
                        json.dumps({"entries": manifest["epochs"]}).encode())
    for root, dirs, _ in os.walk(staging):
        for d in dirs:
            fsync_dir(os.path.join(root, d))
    fsync_dir(staging)
    replaced = f"{data_dir.rstrip('/')}.replaced-{os.getpid()}"
    if os.path.isdir(data_dir):  # holds only our LOCK: rename it away rather than unlock it
        os.rename(data_dir, replaced)
    os.rename(staging, data_dir)  # fails if another process made data_dir meanwhile: nothing is lost
    fsync_dir(os.path.dirname(os.path.abspath(data_dir)))
    shutil.rmtree(replaced, ignore_errors=True)
    log.info("snapshot_installed", data_dir=data_dir, snapshot_offset=manifest["snapshot_offset"],
             log_start=manifest["log_start"], files=len(manifest["files"]))
    return manifest
