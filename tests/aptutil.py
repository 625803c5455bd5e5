"""Tools some tests need from Debian packages: installed with apt-get when missing (as CI does)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def require_tool(binary: str, package: str) -> str:
    """The path of ``binary``, installing ``package`` first if needed; skips when apt cannot run here."""
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"{binary} is missing and apt-get cannot install {package} here (not root or no apt)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
    if subprocess.run(install, capture_output=True, env=env, timeout=900, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True, env=env, timeout=600)
        subprocess.run(install, check=True, capture_output=True, env=env, timeout=900)
    found = shutil.which(binary)
    assert found, f"apt-get installed {package} but {binary} is not on PATH"
    return found
