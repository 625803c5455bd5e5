"""``DATA_DIR/instance``: random bytes chosen at each daemon start (docs/formats/README.md).

``PullLocal`` answers where a pull's batches lie in the node's segment files, for a reader on the
same host that reads them itself. Paths alone do not prove the reader sees this node's files:
another node (a slave on the same host, another cluster) may keep its log at the same path on
the reader's host. The answer names this file and its token; a reader that finds the token in
the file sees this node's directory.

The file is rewritten at every start (new token), without fsync: a copy lost to a power cut is
replaced at the next start, and until then a reader finds no match and pulls over gRPC. A start
that cannot write it (a full disk) goes on without it: the old file, if any, holds an older token,
so readers pull over gRPC until a start writes it again.
"""

from __future__ import annotations

import contextlib
import os
import secrets

import structlog

log = structlog.get_logger("storage.instance")
FILE_NAME = "instance"
TOKEN_BYTES = 16


def publish(data_dir: str) -> tuple[str, str]:
    """Write a new token to ``DATA_DIR/instance``; return (the file's absolute path, the token)."""
    path = os.path.abspath(os.path.join(data_dir, FILE_NAME))
    token = secrets.token_hex(TOKEN_BYTES)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="ascii") as f:
            f.write(token + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # local reads are a shortcut: without them a reader pulls over gRPC
        log.warning("instance_file_not_written", path=path, error=str(exc), note="local reads off until the next start")
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return path, token


def matches(path: str, token: str) -> bool:
    """Whether ``path`` holds ``token`` (False when it cannot be read)."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read(2 * TOKEN_BYTES + 1).strip() == token
    except (OSError, UnicodeDecodeError):
        return False
