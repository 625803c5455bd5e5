"""The one path for every small persisted file (DESIGN §3, problem S2).

Format (docs/formats/small-file.md)::

    magic 4 | version u16 | reserved u16 | generation u64 | payload_len u32 | payload | crc32c u32

Persist: write ``NAME.tmp`` → fsync → if ``NAME`` is valid keep it as ``NAME.bak`` (an invalid
``NAME`` is quarantined as ``NAME.broken``, never rotated over a good ``.bak``) → rename
``NAME.tmp`` → ``NAME`` → fsync the directory.

Load: the valid copy with the highest generation among ``NAME`` and ``NAME.bak``; every invalid
copy is renamed ``*.broken`` and logged. ``None`` means no copy exists at all. Every copy (and
``NAME.tmp``) is opened as a regular file only (``regular.open_regular``): a FIFO or a symlink in
its place raises ``NotRegularFile`` and is left where it is.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import crc32c
import structlog

from broker.storage.failpoints import durable_sync, failpoint, fsync_dir, note_created
from broker.storage.regular import open_regular, read_regular

log = structlog.get_logger("atomic_file")

_HEADER = struct.Struct("<4sHHQI")  # magic, version, reserved, generation, payload_len
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size


@dataclass(frozen=True)
class Loaded:
    """A valid copy: its payload, generation and which file it came from."""

    payload: bytes
    generation: int
    path: str


class InvalidFile(Exception):
    """The file exists but fails validation; the message says how."""


def encode(magic: bytes, version: int, generation: int, payload: bytes) -> bytes:
    """Frame ``payload`` with header and trailing CRC32C."""
    if len(magic) != 4:
        raise ValueError("magic must be 4 bytes")
    head = _HEADER.pack(magic, version, 0, generation, len(payload))
    body = head + payload
    return body + _CRC.pack(crc32c.crc32c(body))


def decode(data: bytes, magic: bytes, version: int) -> Loaded:
    """Validate framing, magic, version and CRC; return the payload (path left empty)."""
    if len(data) < HEADER_BYTES + _CRC.size:
        raise InvalidFile(f"too short ({len(data)} bytes)")
    got_magic, got_version, _, generation, payload_len = _HEADER.unpack_from(data, 0)
    if got_magic != magic:
        raise InvalidFile(f"bad magic {got_magic!r}, expected {magic!r}")
    if got_version != version:
        raise InvalidFile(f"unsupported format version {got_version}, expected {version}")
    end = HEADER_BYTES + payload_len
    if end + _CRC.size != len(data):
        raise InvalidFile(f"length {len(data)} does not match payload length {payload_len}")
    (stored_crc,) = _CRC.unpack_from(data, end)
    if crc32c.crc32c(data[:end]) != stored_crc:
        raise InvalidFile("checksum mismatch")
    return Loaded(bytes(data[HEADER_BYTES:end]), generation, "")


def read_copy(path: str, magic: bytes, version: int) -> Loaded | None:
    """Return the file's valid content, None if absent; raise InvalidFile when corrupt, and
    ``NotRegularFile`` when it is not a regular file (never quarantined: an operator looks first)."""
    try:
        data = read_regular(path)
    except FileNotFoundError:
        return None
    loaded = decode(data, magic, version)
    return Loaded(loaded.payload, loaded.generation, path)


def quarantine(path: str, reason: str) -> str:
    """Rename a bad file to ``*.broken`` (keeping earlier ones) and log why."""
    target = path + ".broken"
    n = 1
    while os.path.exists(target):
        n += 1
        target = f"{path}.broken.{n}"
    os.rename(path, target)
    log.warning("file_quarantined", path=path, moved_to=target, reason=reason)
    return target


def load(path: str, magic: bytes, version: int) -> Loaded | None:
    """Newest valid copy of ``path`` or ``path.bak``; invalid copies are quarantined."""
    best: Loaded | None = None
    for candidate in (path, path + ".bak"):
        try:
            loaded = read_copy(candidate, magic, version)
        except InvalidFile as exc:
            quarantine(candidate, str(exc))
            continue
        if loaded is not None and (best is None or loaded.generation > best.generation):
            best = loaded
    return best


def exists_any(path: str) -> bool:
    """Whether any copy (valid or not) of ``path`` was ever written."""
    return any(os.path.exists(path + s) for s in ("", ".bak", ".broken"))


def persist(path: str, magic: bytes, version: int, payload: bytes, *, generation: int | None = None) -> int:
    """Atomically replace ``path`` with ``payload``; return the generation written."""
    directory = os.path.dirname(path) or "."
    current: Loaded | None = None
    current_invalid = ""
    try:
        current = read_copy(path, magic, version)
    except InvalidFile as exc:
        current_invalid = str(exc)
    if generation is None:
        previous = current.generation if current else 0
        try:
            bak = read_copy(path + ".bak", magic, version)
            if bak is not None:
                previous = max(previous, bak.generation)
        except InvalidFile:
            pass
        generation = previous + 1
    tmp = path + ".tmp"
    data = encode(magic, version, generation, payload)
    fd = open_regular(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    note_created(tmp)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        failpoint("atomicfile_before_fsync")
        durable_sync(fd, tmp, data_only=False)
    finally:
        os.close(fd)
    if current is not None:
        os.replace(path, path + ".bak")
    elif current_invalid:
        quarantine(path, current_invalid)
    failpoint("atomicfile_before_rename")
    os.replace(tmp, path)
    fsync_dir(directory)
    failpoint("atomicfile_after_rename")
    return generation
