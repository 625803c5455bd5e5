"""The README's quickstart runs as a newcomer pastes it: the shell block line by line through bash
(the ``serve ... &`` line as a real daemon), then the Python block, with only the port and the data
directory changed. The first screen stays a first screen: the README stays short."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.procs import ArgvDaemon, free_port

README = Path(__file__).resolve().parent.parent / "README.md"
README_LINES_MAX = 250


def _quickstart() -> tuple[list[str], str]:
    section = README.read_text().split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    shell = section.split("```sh\n", 1)[1].split("```", 1)[0]
    python = section.split("```python\n", 1)[1].split("```", 1)[0]
    return [line for line in shell.splitlines() if line.strip()], python


def test_the_quickstart_runs_as_written(tmp_path: Path) -> None:
    shell, python = _quickstart()
    port = free_port()
    bindir = str(Path(sys.executable).parent) + "/"

    def mapped(text: str) -> str:
        return (text.replace("127.0.0.1:7600", f"127.0.0.1:{port}").replace("/tmp/tidemark-quickstart", str(tmp_path / "qs"))
                .replace(".venv/bin/", bindir))

    serve, *commands = shell
    words = mapped(serve).split()
    assert words[0].endswith("/tidemark") and words[1] == "serve" and words[-1] == "&", serve
    node = ArgvDaemon(words[1:-1], str(tmp_path / "qs"), port)
    node.log_path = str(tmp_path / "node.log")
    node.start()
    try:
        outputs = []
        for line in commands:
            r = subprocess.run(["bash", "-c", mapped(line)], capture_output=True, text=True, timeout=60, check=False)
            assert r.returncode == 0, (line, r.stderr)
            outputs.append(r.stdout)
        consumed = next(out for line, out in zip(commands, outputs, strict=True) if " consume " in line)
        assert sorted(json.loads(m)["body"] for m in consumed.splitlines()) == ["hello", "world"]
        status = next(out for line, out in zip(commands, outputs, strict=True) if " status " in line)
        assert "master" in status
        shown = subprocess.run([sys.executable, "-c", mapped(python)], capture_output=True, text=True, timeout=60,
                               check=False, cwd=tmp_path)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.strip() == "[b'paid'] master"
    finally:
        assert node.stop() == 0, node.tail_log()


def test_the_readme_stays_a_first_page() -> None:
    """Under ~250 lines, and no table cell long enough to hold a run history."""
    lines = README.read_text().splitlines()
    assert len(lines) <= README_LINES_MAX, len(lines)
    cells = [cell for line in lines if line.startswith("|") for cell in line.split("|")]
    assert max(len(c) for c in cells) <= 200, max(cells, key=len)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(ch for ch in heading.strip().lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def test_links_between_the_docs_resolve() -> None:
    """Every relative link of the README and the docs names a file that exists, and an anchor in a
    Markdown file names one of its headings (the README's table points readers at them)."""
    root = README.parent
    pages = [README, root / "bench" / "README.md", root / "tests" / "chaos" / "README.md", *sorted((root / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                broken.append(f"{page.relative_to(root)}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                if anchor not in headings:
                    broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    assert not broken, broken
