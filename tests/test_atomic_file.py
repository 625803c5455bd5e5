"""The one small-file persistence path (S2): every file/.bak corruption combination."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from broker.storage import atomic_file

MAGIC = b"TEST"


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "zeroed":
        path.write_bytes(b"\0" * len(data))
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "bitflip":
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes([data[mid] ^ 1]) + data[mid + 1 :])
    elif how == "missing":
        path.unlink()


def test_roundtrip_keeps_previous_as_bak(tmp_path: Path) -> None:
    """A second persist keeps the first version as .bak with a lower generation."""
    p = str(tmp_path / "f")
    assert atomic_file.persist(p, MAGIC, 1, b"one") == 1
    assert atomic_file.persist(p, MAGIC, 1, b"two") == 2
    loaded = atomic_file.load(p, MAGIC, 1)
    assert loaded is not None and loaded.payload == b"two" and loaded.generation == 2
    bak = atomic_file.decode(Path(p + ".bak").read_bytes(), MAGIC, 1)
    assert bak.payload == b"one"


@pytest.mark.parametrize(
    ("main_state", "bak_state"),
    list(itertools.product(["ok", "truncated", "zeroed", "garbage", "bitflip", "missing"], repeat=2)),
)
def test_load_picks_valid_copy_or_none(tmp_path: Path, main_state: str, bak_state: str) -> None:
    """Any combination of damage: load returns the newest valid copy, quarantines the rest."""
    p = tmp_path / "f"
    atomic_file.persist(str(p), MAGIC, 1, b"old")
    atomic_file.persist(str(p), MAGIC, 1, b"new")
    if main_state != "ok":
        _corrupt(p, main_state)
    if bak_state != "ok":
        _corrupt(Path(str(p) + ".bak"), bak_state)
    loaded = atomic_file.load(str(p), MAGIC, 1)
    if main_state == "ok":
        assert loaded is not None and loaded.payload == b"new"
    elif bak_state == "ok":
        assert loaded is not None and loaded.payload == b"old"
    else:
        assert loaded is None
    for state, path in ((main_state, p), (bak_state, Path(str(p) + ".bak"))):
        if state not in ("ok", "missing"):
            assert not path.exists() and Path(str(path) + ".broken").exists()


def test_invalid_main_never_rotated_over_good_bak(tmp_path: Path) -> None:
    """RocketMQ #9705: persisting over a corrupt NAME must keep the good .bak intact."""
    p = tmp_path / "f"
    atomic_file.persist(str(p), MAGIC, 1, b"v1")
    atomic_file.persist(str(p), MAGIC, 1, b"v2")  # .bak = v1
    _corrupt(p, "garbage")
    atomic_file.persist(str(p), MAGIC, 1, b"v3")
    assert atomic_file.decode(Path(str(p) + ".bak").read_bytes(), MAGIC, 1).payload == b"v1"
    loaded = atomic_file.load(str(p), MAGIC, 1)
    assert loaded is not None and loaded.payload == b"v3" and loaded.generation == 2
    assert Path(str(p) + ".broken").exists()


def test_wrong_magic_and_version_rejected(tmp_path: Path) -> None:
    """A file of another kind or a newer format version is not silently accepted."""
    data = atomic_file.encode(MAGIC, 2, 1, b"x")
    with pytest.raises(atomic_file.InvalidFile, match="version"):
        atomic_file.decode(data, MAGIC, 1)
    with pytest.raises(atomic_file.InvalidFile, match="magic"):
        atomic_file.decode(data, b"OTHR", 2)


def test_leftover_tmp_is_ignored(tmp_path: Path) -> None:
    """A crash before the rename leaves NAME.tmp, which load ignores."""
    p = tmp_path / "f"
    atomic_file.persist(str(p), MAGIC, 1, b"good")
    Path(str(p) + ".tmp").write_bytes(b"half-written")
    loaded = atomic_file.load(str(p), MAGIC, 1)
    assert loaded is not None and loaded.payload == b"good"
