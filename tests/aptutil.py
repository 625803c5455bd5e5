"""Tools some tests need from Debian packages: installed with apt-get when missing (as CI does)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence

import pytest

APT_LOCK = "/tmp/tidemark-tests-apt.lock"  # one install at a time across test workers (apt refuses a held lock)


@contextlib.contextmanager
def _apt_lock() -> Iterator[None]:
    """Held while this process runs apt-get: the test workers (pytest-xdist) each install what
    their tests need, and a second apt-get fails at once on the lock the first holds."""
    with open(APT_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def apt_install(packages: Sequence[str], present: Callable[[], bool]) -> None:
    """Install ``packages`` unless ``present()`` (checked again under the lock: another worker may
    have installed them meanwhile); the package lists are updated only when a first try fails."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    with _apt_lock():
        if present():
            return
        if subprocess.run(install, capture_output=True, env=env, timeout=900, check=False).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True, env=env, timeout=600)
            subprocess.run(install, check=True, capture_output=True, env=env, timeout=900)


def require_tool(binary: str, package: str) -> str:
    """The path of ``binary``, installing ``package`` first if needed; skips when apt cannot run here."""
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"{binary} is missing and apt-get cannot install {package} here (not root or no apt)")
    apt_install([package], lambda: shutil.which(binary) is not None)
    found = shutil.which(binary)
    assert found, f"apt-get installed {package} but {binary} is not on PATH"
    return found
