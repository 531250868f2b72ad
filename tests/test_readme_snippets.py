"""The README's code is the code of examples/snippets/, and every snippet runs.

(a) Each ``examples/snippets/*.py`` runs as ``python examples/snippets/X.py`` in a fresh
process on the CPU (it starts its own two gloo ranks) and prints ``X: OK``. (b) Every ```python
block of README.md is, up to leading and trailing whitespace, the whole text of one snippet
file, so the README and the files cannot drift. (c) Every relative link of README.md and docs/
names a file of the checkout, and every ``#anchor`` into a Markdown file names one of its
headings.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = ROOT / "examples" / "snippets"
SNIPPET_FILES = sorted(p for p in SNIPPETS.glob("*.py") if not p.name.startswith("_"))
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_there_are_snippets():
    assert {p.stem for p in SNIPPET_FILES} >= {"gather", "forward", "schedules", "tree"}


@pytest.mark.slow
@pytest.mark.parametrize("path", SNIPPET_FILES, ids=lambda p: p.stem)
def test_snippet_runs(path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONWARNINGS"] = "ignore"
    result = subprocess.run(
        [sys.executable, str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # ~10 s on an idle 2-core CPU; generous for a loaded CI machine
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert re.search(rf"^{path.stem}: OK", result.stdout, re.MULTILINE), output[-4000:]


def test_readme_python_blocks_are_snippet_files():
    blocks = PYTHON_BLOCK.findall((ROOT / "README.md").read_text())
    assert blocks, "README.md has no python blocks"
    files = {p.read_text().strip(): p.name for p in SNIPPET_FILES}
    for block in blocks:
        assert block.strip() in files, (
            "a ```python block of README.md is not the text of any examples/snippets/ file; "
            "edit the file and paste it whole:\n" + block[:300]
        )


def _anchors(markdown: str) -> set:
    """GitHub's anchors of the headings of ``markdown``."""
    anchors = set()
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).lower().replace("`", ""))
            anchors.add(text.replace(" ", "-"))
    return anchors


def _doc_files():
    return [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted(ROOT.glob("docs/*.md"))]


@pytest.mark.parametrize("doc", _doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    problems = []
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.read_text()):
            problems.append(f"{target}: no heading with anchor #{anchor}")
    assert not problems, f"{doc.relative_to(ROOT)}:\n" + "\n".join(problems)
