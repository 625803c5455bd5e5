"""The staged files of an empty slave's bootstrap (replication/bundle.py): CRC, page release, close."""

from __future__ import annotations

import os
from pathlib import Path

import crc32c
import pytest

from replication import bundle


def test_a_staged_file_keeps_its_crc_and_bytes_across_page_releases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes written past several release steps are all there, with the running CRC of all of them."""
    monkeypatch.setattr(bundle, "RELEASE_STEP_BYTES", 4096)
    f = bundle._StagedFile(str(tmp_path / "seg"))
    chunks = [os.urandom(3000) for _ in range(10)]
    for c in chunks:
        f.write(c)
    f.close()
    data = b"".join(chunks)
    assert (tmp_path / "seg").read_bytes() == data and f.crc == crc32c.crc32c(data)
    assert f.released == 30000  # every second write crossed a step


def test_a_failing_sync_still_closes_every_staged_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync that fails for one file: every file is closed, every CRC noted, the error raised."""
    files = {name: bundle._StagedFile(str(tmp_path / name)) for name in ("a", "b", "c")}
    for f in files.values():
        f.write(b"x")
    real_fsync = os.fsync
    calls: list[int] = []

    def failing_once(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_once)
    crcs: dict[str, int] = {}
    with pytest.raises(OSError, match="Input/output"):
        bundle._close_all(files, crcs)
    assert all(f.file.closed for f in files.values()) and len(calls) == 3 and set(crcs) == {"a", "b", "c"}
