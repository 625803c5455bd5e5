"""Local reads: a reader on a node's host reads a pull's batches from the node's segment files.

A pull over gRPC costs both sides a copy per hop: the node reads the log into memory and gRPC
moves it through HTTP/2 and the loopback socket; the reader receives it. ``PullLocal`` answers the
same pull (the same checks: only below the confirm offset, roles, the fence) with where the
batches lie, ``(segment file, position, bytes)``, and the reader preads them: one copy, from the
page cache. Like HDFS's short-circuit local reads.

It is used only when it is sure to read the node's own bytes:

- the answer names the node's ``instance`` file and the token it holds
  (``broker/storage/instance.py``); a reader that does not find that token there (another host,
  another node at the same path) does not try local reads from that address for
  ``NOT_LOCAL_FOR_S`` (a restart or an upgrade may change the answer); a new token (a restarted,
  maybe re-bootstrapped node) closes every file it had open;
- it opens only segment files of that directory (``log/<20 digits>.log``), whatever an answer
  names;
- a file it cannot open for lack of permission (the data directory is the daemon user's, 0700 by
  default) turns local reads off for that address too: run the reader as that user to use them;
- a cached descriptor whose segment was deleted (retention) is closed at its next use, so a
  reader holds the disk space of at most ``OPEN_FILES_MAX`` deleted segments, until then;
- a segment gone since the answer (retention), a short read, a range in tiered storage
  (FAILED_PRECONDITION), or a node without ``PullLocal`` (UNIMPLEMENTED): that pull goes over
  gRPC instead.

The bytes are then checked like any pulled bytes by whoever decodes them (CRC32C, topic, queue,
queue offsets; ``spark_connector/decode.py``).
"""

from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from broker.storage.instance import matches
from broker.storage.regular import open_regular
from broker.storage.segment import parse_segment_name
from proto import tidemark_pb2 as pb

LOG_DIR = "log"  # DATA_DIR/log/<start offset, 20 digits>.log (docs/formats/README.md)
OPEN_FILES_MAX = 8  # segment files a client keeps open (each may be up to commitlog.segment_bytes)
NOT_LOCAL_FOR_S = 300.0  # how long an address found not readable locally is not tried again
NOT_LOCAL_MAX = 1024  # addresses remembered as not readable locally
_NOT_LOCAL: OrderedDict[str, tuple[float, str]] = OrderedDict()  # address -> (until, why), in this process
_NOT_LOCAL_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class LocalPullResponse:
    """The fields of a ``PullResponse``, its runs of batches read from the node's files."""

    batches: list[bytes]
    skip_first: int
    count: int
    next_offset: int
    min_offset: int
    max_offset: int


def not_local(address: str) -> str | None:
    """Why local reads are off for ``address`` in this process for now (None: they are tried)."""
    with _NOT_LOCAL_LOCK:
        entry = _NOT_LOCAL.get(address)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del _NOT_LOCAL[address]
            return None
        return entry[1]


def mark_not_local(address: str, why: str) -> None:
    """Turn local reads off for ``address`` for ``NOT_LOCAL_FOR_S`` (another host, no permission,
    an older node: retried later, since a restart or an upgrade may change that)."""
    with _NOT_LOCAL_LOCK:
        _NOT_LOCAL[address] = (time.monotonic() + NOT_LOCAL_FOR_S, why)
        _NOT_LOCAL.move_to_end(address)
        while len(_NOT_LOCAL) > NOT_LOCAL_MAX:
            _NOT_LOCAL.popitem(last=False)


def _close_all(fds: OrderedDict[str, int]) -> None:
    while fds:
        os.close(fds.popitem()[1])


class SegmentFiles:
    """The segment files one client reads: a small LRU of read-only descriptors of one node
    instance's files (a new instance token closes them all: a re-bootstrapped node keeps a new
    directory at the same path). Safe to share between threads; closed with the client, or when
    collected."""

    def __init__(self) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._instance: tuple[str, str] | None = None  # (instance file, token) the open files belong to
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    def read(self, address: str, response: pb.PullLocalResponse) -> LocalPullResponse | None:
        """The answer's batches read from its files; None when they cannot be (the pull then goes
        over gRPC; ``address`` is marked not local when it will not be for a while)."""
        with self._lock:
            if self._closed:
                return None
            try:
                batches = self._read(address, response)
            except (OverflowError, ValueError):  # an answer no node of ours gives (positions past 2^63, NUL)
                mark_not_local(address, "the node's PullLocal answer names impossible spans")
                return None
        if batches is None:
            return None
        return LocalPullResponse(batches, response.skip_first, response.count, response.next_offset,
                                 response.min_offset, response.max_offset)

    def _read(self, address: str, response: pb.PullLocalResponse) -> list[bytes] | None:
        if not response.spans:
            return []
        if not self._sees(response.instance_file, response.instance):
            mark_not_local(address, f"{response.instance_file} cannot be read or does not hold the node's instance token")
            return None
        log_dir = os.path.join(os.path.dirname(response.instance_file), LOG_DIR)
        for span in response.spans:  # only the node's segment files, whatever an answer names
            if os.path.dirname(span.path) != log_dir or parse_segment_name(os.path.basename(span.path)) is None:
                mark_not_local(address, f"the node named {span.path[:200]!r}, not a segment file of {log_dir}")
                return None
        batches: list[bytes] = []
        for span in response.spans:
            try:
                fd = self._open(span.path)
                data = os.pread(fd, span.length, span.position)
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.EPERM):
                    mark_not_local(address, f"cannot read {span.path}: {exc.strerror}")
                return None  # ENOENT: deleted by retention since the answer; the pull goes over gRPC
            if len(data) != span.length:
                return None
            batches.append(data)
        return batches

    def _sees(self, path: str, token: str) -> bool:
        """Whether ``path`` holds ``token``: checked once per instance; a new one closes the files
        of the one before."""
        if self._instance == (path, token):
            return True
        if not matches(path, token):
            return False
        _close_all(self._fds)
        self._instance = (path, token)
        return True

    def _open(self, path: str) -> int:
        """A descriptor of ``path``; a cached one whose file was deleted (retention) is closed, so
        it does not hold the disk space, and the path opened again (ENOENT: over gRPC)."""
        fd = self._fds.get(path)
        if fd is not None:
            if os.fstat(fd).st_nlink:
                self._fds.move_to_end(path)
                return fd
            del self._fds[path]
            os.close(fd)
        fd = open_regular(path, os.O_RDONLY)  # a FIFO or a symlink there: over gRPC (NotRegularFile, EINVAL)
        self._fds[path] = fd
        while len(self._fds) > OPEN_FILES_MAX:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def close(self) -> None:
        """Close every descriptor (a segment deleted meanwhile frees its space only then)."""
        with self._lock:
            self._closed = True
            _close_all(self._fds)
