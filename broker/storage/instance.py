"""``DATA_DIR/instance``: random bytes chosen at each daemon start (docs/formats/README.md).

``PullLocal`` answers where a pull's batches lie in the node's segment files, for a reader on the
same host that reads them itself. Paths alone do not prove the reader sees this node's files:
another node (a slave on the same host, another cluster) may keep its log at the same path on
the reader's host. The answer names this file and its token; a reader that finds the token in
the file sees this node's directory.

The file is rewritten at every start (new token), without fsync: a copy lost to a power cut is
replaced at the next start, and until then a reader finds no match and pulls over gRPC. A start
that cannot write it (a full disk) goes on without it: the old file, if any, holds an older token,
so readers pull over gRPC until it is written. The daemon tries again every 5 s (its housekeeping
thread, ``lag-metrics``), so local reads come back once space returns: at once for a new reader,
within ``NOT_LOCAL_FOR_S`` (5 min) for one that found no match meanwhile (broker/client/local_reads.py).
"""

from __future__ import annotations

import contextlib
import os
import secrets

import structlog

from broker.storage.regular import open_regular

log = structlog.get_logger("storage.instance")
FILE_NAME = "instance"
TOKEN_BYTES = 16


class InstanceFile:
    """This start's token and the file that proves it to readers on this host."""

    def __init__(self, data_dir: str) -> None:
        self.path = os.path.abspath(os.path.join(data_dir, FILE_NAME))
        self.token = secrets.token_hex(TOKEN_BYTES)
        error = _write(self.path, self.token)
        self.written = error is None
        if error is not None:
            log.warning("instance_file_not_written", path=self.path, error=error,
                        note="local reads off until it is written (tried again every 5 s)")

    def ensure(self) -> None:
        """Write the file again if the last try failed (an attribute read when it did not). Called
        from one thread only: the daemon's housekeeping loop."""
        if self.written:
            return
        self.written = _write(self.path, self.token) is None
        if self.written:
            log.info("instance_file_written", path=self.path, note="local reads on again")


def _write(path: str, token: str) -> str | None:
    """Replace ``path`` with ``token``; the error when it could not be written."""
    tmp = path + ".tmp"
    try:
        with open(open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666), "w", encoding="ascii") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
        return None
    except OSError as exc:  # local reads are a shortcut: without them a reader pulls over gRPC
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return str(exc)


def matches(path: str, token: str) -> bool:
    """Whether ``path`` holds ``token`` (False when it cannot be read)."""
    try:
        with open(open_regular(path, os.O_RDONLY), encoding="ascii") as f:
            return f.read(2 * TOKEN_BYTES + 1).strip() == token
    except (OSError, UnicodeDecodeError):
        return False
