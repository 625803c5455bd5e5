"""The posix-directory backend: one file per object under ``tieredstore.root``.

Spec of the file layout: docs/formats/tiered-objects.md. A file is
``MAGIC(4) | u16 version | u32 metadata length | metadata JSON | object bytes``, so an object
and its metadata appear together or not at all. A put writes ``.tmp/<node>.<random>``, fsyncs
it, then ``link()``s it to its key (``link`` fails on an existing name: conditional create,
atomic), unlinks the temporary name and fsyncs both directories. A crash leaves at most a
temporary file, which ``clean_tmp`` removes; never a partial object under a key.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import struct
import uuid

from broker.storage.failpoints import failpoint, fsync_dir
from tieredstore.backend import BackendError, ObjectExists, ObjectInfo, ObjectMissing

MAGIC = b"TMTO"
VERSION = 1
HEAD = struct.Struct("<4sHI")  # magic, version, metadata length
TMP_DIR = ".tmp"


class PosixBackend:
    name = "posix"

    def __init__(self, root: str, node_id: str = "") -> None:
        if not root:
            raise BackendError("open", "tieredstore.root is empty")
        self.root = os.path.abspath(root)
        self.node_id = node_id or "node"
        os.makedirs(os.path.join(self.root, TMP_DIR), exist_ok=True)

    def _path(self, key: str) -> str:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts) or parts[0] == TMP_DIR:
            raise BackendError("key", f"invalid object key {key!r}")
        return os.path.join(self.root, *parts)

    def put(self, key: str, data: bytes | memoryview, metadata: dict[str, str]) -> None:
        path = self._path(key)
        if os.path.exists(path):
            raise ObjectExists(key)
        meta = json.dumps(metadata, sort_keys=True, separators=(",", ":")).encode()
        tmp = os.path.join(self.root, TMP_DIR, f"{self.node_id}.{uuid.uuid4().hex}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                _write_all(fd, [HEAD.pack(MAGIC, VERSION, len(meta)), meta, data])
                os.fsync(fd)
            finally:
                os.close(fd)
            failpoint("posix_before_link")
            directory = os.path.dirname(path)
            os.makedirs(directory, exist_ok=True)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise ObjectExists(key) from None
            fsync_dir(directory)
        except OSError as exc:
            raise BackendError("put", f"{key}: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # not fsynced: a temporary name that survives a crash is removed by clean_tmp

    def _open(self, op: str, key: str) -> tuple[int, int, dict[str, str]]:
        """(fd, data start, metadata) of an object file."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectMissing(op, key) from None
        except OSError as exc:
            raise BackendError(op, f"{key}: {exc}") from exc
        head = os.pread(fd, HEAD.size, 0)
        if len(head) != HEAD.size:
            os.close(fd)
            raise BackendError(op, f"{key}: truncated object header")
        magic, version, meta_len = HEAD.unpack(head)
        if magic != MAGIC or version != VERSION:
            os.close(fd)
            raise BackendError(op, f"{key}: bad magic/version {magic!r}/{version}")
        meta = json.loads(os.pread(fd, meta_len, HEAD.size)) if meta_len else {}
        return fd, HEAD.size + meta_len, meta

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        fd, base, _ = self._open("get", key)
        try:
            size = os.fstat(fd).st_size - base
            stop = size if end is None else min(end, size)
            if start >= stop:
                return b""
            out = os.pread(fd, stop - start, base + start)
            if len(out) != stop - start:
                raise BackendError("get", f"{key}: short read at {start}")
            return out
        finally:
            os.close(fd)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            fd, base, meta = self._open("head", key)
        except ObjectMissing:
            return None
        try:
            st = os.fstat(fd)
            return ObjectInfo(key, st.st_size - base, st.st_mtime, meta)
        finally:
            os.close(fd)

    def list(self, prefix: str, start_after: str = "") -> list[ObjectInfo]:
        out: list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            if dirpath == self.root and TMP_DIR in dirnames:
                dirnames.remove(TMP_DIR)
            rel_dir = os.path.relpath(dirpath, self.root)
            for name in filenames:
                key = name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}"
                if not key.startswith(prefix) or key <= start_after:
                    continue
                info = self._stat(os.path.join(dirpath, name), key)
                if info is not None:
                    out.append(info)
        out.sort(key=lambda o: o.key)
        return out

    @staticmethod
    def _stat(path: str, key: str) -> ObjectInfo | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            head = os.pread(fd, HEAD.size, 0)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        meta_len = HEAD.unpack(head)[2] if len(head) == HEAD.size else 0
        return ObjectInfo(key, st.st_size - HEAD.size - meta_len, st.st_mtime)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise BackendError("delete", f"{key}: {exc}") from exc
        fsync_dir(os.path.dirname(path))

    def clean_tmp(self) -> int:
        """Remove this node's leftover temporary files (an interrupted put); return how many."""
        tmp_dir = os.path.join(self.root, TMP_DIR)
        removed = 0
        for name in os.listdir(tmp_dir):
            if name.startswith(self.node_id + "."):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(tmp_dir, name))
                    removed += 1
        return removed

    def close(self) -> None:
        pass


def _write_all(fd: int, parts: list[bytes | memoryview]) -> None:
    for part in parts:
        view = memoryview(part)
        while view:
            n = os.write(fd, view)
            if n <= 0:
                raise OSError(errno.EIO, "write returned 0")
            view = view[n:]
