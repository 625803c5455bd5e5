"""Log bytes cut from the commit log, kept for an operator in ``DATA_DIR/quarantine/``.

Two cuts keep what they remove: recovery's torn tail (``torn-S-E.broken``, bytes that failed their
checks) and a divergence from a new master (``diverged-S-E.log``, whole batches this node held that
the master's log does not: after an unclean election they can include writes acknowledged with
ack=leader, or confirmed by this node alone). Only ``tidemark log quarantine`` reads them back, for
an operator (``broker/cli/quarantine.py``); nothing deletes them. The format of each is the commit
log's: ``[S, E)`` at their original offsets (docs/formats/README.md).
"""

from __future__ import annotations

import os

from broker.storage.commitlog import CommitLog
from broker.storage.failpoints import durable_sync, fsync_dir
from broker.storage.regular import open_regular

QUARANTINE = "quarantine"
CHUNK_BYTES = 8 << 20


def quarantine_dir(data_dir: str) -> str:
    path = os.path.join(data_dir, QUARANTINE)
    os.makedirs(path, exist_ok=True)
    return path


def kept_bytes(data_dir: str) -> int:
    """Bytes of the files in ``quarantine/`` now (0 without one): the ``tidemark_quarantine_bytes`` gauge."""
    try:
        entries = list(os.scandir(os.path.join(data_dir, QUARANTINE)))
    except OSError:  # none yet (made on demand), or unreadable: nothing to count
        return 0
    total = 0
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
        except OSError:  # deleted by an operator meanwhile
            continue
    return total


def keep_log_range(data_dir: str, log_: CommitLog, start: int, end: int, kind: str, suffix: str) -> str:
    """Copy log bytes ``[start, end)`` to ``quarantine/<kind>-<start>-<end><suffix>``, durably
    (file and directory entry), before the caller cuts them; return the path."""
    directory = quarantine_dir(data_dir)
    path = os.path.join(directory, f"{kind}-{start:020d}-{end:020d}{suffix}")
    fd = open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        pos = start
        while pos < end:
            chunk = log_.read(pos, min(CHUNK_BYTES, end - pos))
            if not chunk:
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view):]
            pos += len(chunk)
        durable_sync(fd, path, data_only=False)
    finally:
        os.close(fd)
    fsync_dir(directory)
    return path
