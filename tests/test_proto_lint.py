"""buf lint on proto/tidemark.proto: STANDARD naming and a comment on every element, with the
exceptions buf.yaml documents (docs/api.md). buf comes from the npm registry (tools/buf, pinned by
its lockfile; the package ships the binary), installed here with npm ci if missing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.aptutil import require_tool

pytestmark = pytest.mark.xdist_group("node")  # make test's workers: npm ci in the shared tools/

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools" / "buf"


def test_buf_lint_passes() -> None:
    npm = require_tool("npm", "npm")
    buf = TOOLS / "node_modules" / ".bin" / "buf"
    if not buf.exists():
        r = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--prefer-offline"], cwd=TOOLS, capture_output=True,
                           text=True, timeout=600, check=False)
        assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(buf), "lint"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout[-4000:] + r.stderr[-2000:]
