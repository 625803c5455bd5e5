"""Offline tools and start-up on odd files (issue 35, finding 14): a FIFO or a symlink where a data-directory
file belongs, a sparse segment whose first length is 2^31, a segment full of damaged batches, a stray
segment name in non-ASCII digits. Real files, ``tidemark log verify``/``log quarantine`` and ``tidemark serve``
as separate processes; the CLI's address space bounded (a read of /dev/zero or a 2 GiB allocation fails there
instead of filling the machine), and the daemon's where it reads /dev/zero."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.logformat.scan import scan_past_damage
from broker.storage.segment import segment_name
from tests.procs import DaemonProcess
from tests.storeutil import create_topic, open_store, send

AS_BYTES = 1 << 30  # the address space of each process started here (the CLI needs < 512 MiB)
CLI_S = 10  # a command that has not answered by then is hanging
REFUSE_S = 10  # a serve that must refuse has exited by then


# the limit is set by the child itself before it becomes the command, never in a preexec_fn: that
# runs Python in a fork of this multi-threaded process, where gRPC's fork handlers (this process
# ran clients and servers) aborted the child in epoll_wait ("Bad file descriptor") before its exec
BOUNDED = (f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({AS_BYTES}, {AS_BYTES})); "
           "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BOUNDED, "-m", "broker.cli", *args], capture_output=True, text=True,
                          timeout=CLI_S, check=False)


class BoundedDaemon(DaemonProcess):
    """``tidemark serve`` with its address space bounded (set in the child before it becomes the daemon)."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", BOUNDED, *super().command()[1:]]


def _data_dir(tmp_path: Path) -> Path:
    """A data directory a real store wrote: topic t with two records, a timer snapshot, stopped cleanly."""
    d = tmp_path / "node"
    s = open_store(str(d))
    create_topic(s, "t")
    send(s, "t", [b"hello", b"world"])
    s.stop()
    return d


def _segment_path(d: Path) -> Path:
    return sorted((d / "log").glob("*.log"))[-1]


def _fifo_in_place_of(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _refused(d: Path, *, bounded: bool = False) -> str:
    """``tidemark serve`` on ``d`` exits 1 within REFUSE_S, its last line the one refusal, no traceback; that line.
    ``bounded``: in AS_BYTES of address space (only for a refusal before LMDB maps its 64 GiB)."""
    daemon = (BoundedDaemon if bounded else DaemonProcess)(str(d))
    t0 = time.monotonic()
    daemon.start(wait=False)
    try:
        code = daemon.wait_exit(REFUSE_S)
    finally:
        daemon.kill9()
    lines = [line for line in daemon.tail_log(100).splitlines() if line.strip()]
    assert code == 1, lines
    assert time.monotonic() - t0 < REFUSE_S
    assert not any("Traceback" in line for line in lines), lines
    assert [line for line in lines if line.startswith("tidemark:")] == [lines[-1]], lines
    return lines[-1]


def _startup_files(d: Path) -> dict[str, Path]:
    """Every file of ``d`` that start-up or ``log verify`` opens, by name (one of each kind)."""
    return {
        "identity": d / "identity",
        "epochs": d / "epochs",
        "consume_queue.ckpt": d / "checkpoints" / "consume_queue.ckpt",
        "producer_state.ckpt": d / "checkpoints" / "producer_state.ckpt",
        "segment": _segment_path(d),
        "next segment": d / "log" / segment_name(_segment_path(d).stat().st_size),
        "timer-log segment": sorted((d / "timer" / "log").glob("*.log"))[-1],
        "wheel snapshot": sorted((d / "timer" / "snapshots").glob("*.snap"))[-1],
        "queue file": sorted((d / "cq").glob("t.*/0.cq"))[-1],
        "LMDB data.mdb": d / "metadata" / "data.mdb",
        "LOCK": d / "LOCK",
    }


VERIFIED = ["identity", "epochs", "consume_queue.ckpt", "producer_state.ckpt", "segment", "next segment",
            "timer-log segment", "wheel snapshot", "queue file"]


@pytest.mark.parametrize("which", VERIFIED)
def test_log_verify_refuses_a_fifo_in_one_line(tmp_path: Path, which: str) -> None:
    """Finding 14, a FIFO as a segment or as identity (and every other file verify reads): ``log verify``
    answers at once, one line naming the file "not a regular file (a FIFO)", exit 1 (it hung in open)."""
    d = _data_dir(tmp_path)
    path = _startup_files(d)[which]
    _fifo_in_place_of(path)
    r = _cli("log", "verify", str(d))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines() == [f"{path}: not a regular file (a FIFO)",
                                     r.stdout.splitlines()[-1]], r.stdout
    assert r.stdout.splitlines()[-1].endswith(", 1 problems") and "Traceback" not in r.stderr


@pytest.mark.parametrize("which", ["identity", "epochs", "consume_queue.ckpt", "segment", "next segment",
                                   "timer-log segment", "wheel snapshot", "queue file", "LMDB data.mdb", "LOCK"])
def test_serve_refuses_a_fifo_in_one_line(tmp_path: Path, which: str) -> None:
    """Finding 14, a FIFO as a segment or as identity (and every other file start-up opens): ``serve`` exits 1
    at once with "refusing to start: <file>: not a regular file (a FIFO)" (it blocked in open, deaf to
    SIGTERM, or died with a traceback)."""
    d = _data_dir(tmp_path)
    path = _startup_files(d)[which]
    _fifo_in_place_of(path)
    assert _refused(d) == f"tidemark: refusing to start: {path}: not a regular file (a FIFO)"
    assert path.is_fifo()  # nothing renamed or removed


def test_serve_starts_past_a_fifo_as_instance_tmp(tmp_path: Path) -> None:
    """Finding 14, the instance file (local reads' token, rewritten at each start through ``instance.tmp``): a
    FIFO there is not written through (the start blocked in open before serving); the daemon serves and says so
    in one warning (local reads stay off until the file is written)."""
    d = _data_dir(tmp_path)
    os.mkfifo(d / "instance.tmp")
    daemon = DaemonProcess(str(d))
    try:
        daemon.start(timeout_s=REFUSE_S)
        assert "instance.tmp: not a regular file (a FIFO)" in daemon.tail_log(100)
    finally:
        daemon.kill9()


def test_identity_symlinked_to_dev_zero_is_refused(tmp_path: Path) -> None:
    """Finding 14, ``identity`` a symlink to /dev/zero: ``log verify`` names it "not a regular file (a symlink)"
    (it read until memory ran out: 8.4 GB), and ``serve`` refuses in one line."""
    d = _data_dir(tmp_path)
    (d / "identity").unlink()
    (d / "identity").symlink_to("/dev/zero")
    r = _cli("log", "verify", str(d))
    assert r.returncode == 1 and r.stdout.splitlines()[0] == f"{d / 'identity'}: not a regular file (a symlink)", (
        r.stdout + r.stderr[-2000:])
    assert _refused(d, bounded=True) == f"tidemark: refusing to start: {d / 'identity'}: not a regular file (a symlink)"


def test_a_symlink_to_a_valid_copy_inside_the_directory_is_refused_too(tmp_path: Path) -> None:
    """Finding 14, the rule chosen (docs/formats/README.md): a data-directory file is never a symlink, even to a
    valid copy of itself inside the directory."""
    d = _data_dir(tmp_path)
    (d / "identity").rename(d / "identity.real")
    (d / "identity").symlink_to("identity.real")
    assert _refused(d) == f"tidemark: refusing to start: {d / 'identity'}: not a regular file (a symlink)"


def test_log_quarantine_refuses_a_fifo_or_a_symlink_in_one_line_each(tmp_path: Path) -> None:
    """Finding 14 in ``log quarantine``: a FIFO, or a symlink to /dev/zero, named as a cut log range is named
    "not a regular file", never opened for reading nor followed (it was passed over as "not a cut log range")."""
    q = tmp_path / "node" / "quarantine"
    q.mkdir(parents=True)
    fifo = q / f"torn-{0:020d}-{10:020d}.broken"
    os.mkfifo(fifo)
    link = q / f"diverged-{10:020d}-{20:020d}.log"
    link.symlink_to("/dev/zero")
    r = _cli("log", "quarantine", str(tmp_path / "node"))
    assert r.returncode == 1 and r.stderr.splitlines() == [f"{link}: not a regular file (a symlink)",
                                                           f"{fifo}: not a regular file (a FIFO)"], r.stderr


def _sparse_range(path: Path, size: int, first_length: int) -> None:
    """A sparse file of ``size`` bytes (zeros but for the first batch length field)."""
    with open(path, "wb") as f:
        f.write(struct.pack("<I", first_length))
        f.truncate(size)


def test_a_huge_length_in_a_sparse_segment_is_not_allocated(tmp_path: Path) -> None:
    """Finding 14, a 2 GiB sparse segment whose first length is 2^31: ``log verify`` and ``log quarantine``
    check the batch's magic before reading 2 GiB (they allocated 2.1 GB first; here, in 1 GiB of address
    space, they died of MemoryError)."""
    size = 1 << 31
    d = tmp_path / "node"
    (d / "log").mkdir(parents=True)
    _sparse_range(d / "log" / segment_name(0), size, size)
    r = _cli("log", "verify", str(d))
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    problem, summary = r.stdout.splitlines()
    assert problem.startswith(f"{d / 'log' / segment_name(0)}: offset 0: bad batch magic/version 0x0/0")
    assert summary.endswith("1 segments, 0 batches, 0 queue files, 0 timer-log groups, 1 problems")

    (d / "quarantine").mkdir()
    torn = d / "quarantine" / f"torn-{0:020d}-{size:020d}.broken"
    _sparse_range(torn, size, size)
    r = _cli("log", "quarantine", str(d))
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    head, problem = r.stdout.splitlines()[:2]
    assert head == f"{torn}: torn, offsets [0, {size}), {size} bytes; 0 valid batches, 0 records"
    assert problem.startswith("  offset 0: invalid: bad batch magic/version 0x0/0")


BAD_BATCH = struct.pack("<I", 64) + b"\xab" * 60  # whole (its length fits) but no batch: bad magic


def test_the_damage_walk_reads_each_byte_once(tmp_path: Path) -> None:
    """Finding 14, repeated 64-byte invalid batches: the walk past damage reads the range once (it read a
    whole chunk again after each damaged batch: quadratic)."""
    path = tmp_path / "damaged.log"
    path.write_bytes(BAD_BATCH * 4096)  # 256 KiB
    read_bytes = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        def read(offset: int, length: int) -> bytes:
            nonlocal read_bytes
            data = os.pread(fd, length, offset)
            read_bytes += len(data)
            return data

        items = list(scan_past_damage(read, 0, path.stat().st_size, chunk_bytes=64 << 10, path=str(path)))
    finally:
        os.close(fd)
    assert read_bytes <= path.stat().st_size + (64 << 10)
    assert len(items) == 1  # the run, said once


def test_log_verify_and_quarantine_walk_16_mb_of_damage_in_linear_time(tmp_path: Path) -> None:
    """Finding 14, 16 MB of 64-byte invalid batches: ``log verify`` and ``log quarantine`` answer in seconds
    (67 s in the issue, 38 s here before), with one line for the run of damaged batches."""
    size = 16 << 20
    d = tmp_path / "node"
    (d / "log").mkdir(parents=True)
    (d / "quarantine").mkdir()
    seg = d / "log" / segment_name(0)
    seg.write_bytes(BAD_BATCH * (size // len(BAD_BATCH)))
    (d / "quarantine" / f"torn-{0:020d}-{size:020d}.broken").write_bytes(seg.read_bytes())
    r = _cli("log", "verify", str(d))
    assert r.returncode == 1
    assert r.stdout.splitlines()[0].endswith(f"; {size // 64 - 1} more damaged batches after it, up to offset {size}")
    assert r.stdout.splitlines()[1].endswith(", 1 problems")
    r = _cli("log", "quarantine", str(d))
    assert r.returncode == 0 and r.stdout.splitlines()[1].startswith("  offset 0: invalid: bad batch magic"), r.stdout


@pytest.mark.parametrize("name", ["١٢٣.log", "١٢٣٤٥٦٧٨٩٠١٢٣٤٥٦٧٨٩٠.log"])
def test_a_segment_name_in_non_ascii_digits_is_a_stray_name(tmp_path: Path, name: str) -> None:
    """Finding 14, a stray segment named in Arabic-Indic digits (``str.isdigit`` takes them): ``log verify``
    names it in one line (a traceback, or nothing), and ``serve`` starts, warns about it and leaves it alone
    (a traceback), as it does for any other name that is not a segment's."""
    d = _data_dir(tmp_path)
    stray = d / "log" / name
    stray.write_bytes(b"not a segment")
    r = _cli("log", "verify", str(d))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.splitlines()[0] == f"{stray}: not a segment name (20 ASCII digits and .log); not read"
    assert r.stdout.splitlines()[-1].endswith(", 1 problems")
    daemon = DaemonProcess(str(d))
    try:
        daemon.start(timeout_s=REFUSE_S)
        assert "log_file_ignored" in daemon.tail_log(100) and name in daemon.tail_log(100)
    finally:
        daemon.kill9()
    assert stray.read_bytes() == b"not a segment"
