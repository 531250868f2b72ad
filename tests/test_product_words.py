"""No notebook words in the tracked files.

The product (code, docs, benchmark tables and logs) describes what the code does and what was
measured, not the working log that produced it: no numbered rounds ("Session 24", "round 3"),
no call letters ("call F"), and none of the words that only meant something in that log ("lent",
"carriable", "seed" as in "the seed report"). Random-number seeds are fine: ``seed=``,
``manual_seed``, ``--seed``, ``args.seed``, ``for seed in ...``, "random seed", "fixed seed".

The test lists the tracked files with ``git ls-files`` (skipped outside a git checkout) and fails
with ``file:line: text`` for every hit.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()

# Each banned form, with a name for the report. Case-insensitive except the call letter.
BANNED = [
    # Also inside names: attention_session24_call1.md.
    ("numbered session", re.compile(r"(?<![a-z])session ?\d+", re.IGNORECASE)),
    ("call letter", re.compile(r"\b(?i:call) [A-Z]\b")),
    ("numbered round", re.compile(r"\bround \d+", re.IGNORECASE)),
    ("lent", re.compile(r"\blent\b", re.IGNORECASE)),
    ("carriable", re.compile(r"\bcarriable\b", re.IGNORECASE)),
]

SEED = re.compile(r"\bseed\b", re.IGNORECASE)
# "the seed ..." and "seed's" always mean the report (write "the random seed" otherwise), unless
# the word is a name being assigned or called ("the seed = ...").
SEED_REPORT = re.compile(r"\bthe\s+seed\b(?!\s*[=(])|\bseed's\b", re.IGNORECASE)
# Uses of "seed" as a random-number seed: an identifier in code, or a seed of a generator in prose.
SEED_ALLOWED_BEFORE = re.compile(
    r"(?:--|\.|\bfor\s|\b(?:random|fixed|torch|numpy|rng|same|a|by|its|per)\s)$",
    re.IGNORECASE,
)
SEED_ALLOWED_AFTER = re.compile(r"^(?:\(|\s*[=:,)\]}%*+\-`\"']|\s+in\b)")


def _seed_hits(line: str) -> bool:
    """True when ``line`` uses "seed" in the banned sense (not a random-number seed)."""
    if SEED_REPORT.search(line):
        return True
    for m in SEED.finditer(line):
        before, after = line[: m.start()], line[m.end() :]
        if after.startswith("."):
            # seed.attr: a module or object named seed (e.g. the seed regression test), not a
            # number; "seed." ending a sentence is allowed below only after a seed-of-a-generator
            # word.
            if re.match(r"\.\w", after) or not SEED_ALLOWED_BEFORE.search(before):
                return True
            continue
        if SEED_ALLOWED_BEFORE.search(before) or SEED_ALLOWED_AFTER.match(after):
            continue
        return True
    return False


def _git(*args: str, cwd: Path) -> bytes:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, check=True, timeout=30
    ).stdout


def _tracked_files() -> tuple[Path, list[str]]:
    """The checkout's root (found from this file, whatever the cwd) and its tracked files."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    try:
        root = Path(_git("rev-parse", "--show-toplevel", cwd=HERE.parent).decode().strip())
        out = _git("ls-files", "-z", cwd=root)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        pytest.skip("not a git checkout")
    return root, [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def _text(path: Path) -> str | None:
    """The file's text, or None for binary files and files missing from the work tree."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def find_hits(root: Path, files: list[str]) -> list[str]:
    """``file:line: [what] text`` for each banned word in ``files`` (relative to ``root``)."""
    hits = []
    for rel in files:
        path = root / rel
        if path.resolve() == HERE:
            continue
        text = _text(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            names = [name for name, pattern in BANNED if pattern.search(line)]
            if _seed_hits(line):
                names.append("seed")
            if names:
                hits.append(f"{rel}:{number}: [{', '.join(names)}] {line.strip()[:160]}")
    return hits


@pytest.mark.parametrize(
    "line, banned",
    [
        ("Both ran in session 24, 2026-12-06", True),
        ("logs/gdn_session21_call4_h100.md", True),
        ("a sessionless run", False),
        ("session21 results", True),
        ("RESULTS.md 'Session 13', call F", True),
        ("Call G: fewer flagged rows", True),
        ("the k = 0 call 0.98-1.04", False),
        ("median of 7 rounds", False),
        ("round 3 of the sweep", True),
        ("machines that are not lent yet", True),
        ("not carriable", True),
        ("torch.manual_seed(0)", False),
        ("rng = random.Random(seed)", False),
        ("def _case(seed: int = 0):", False),
        ("for seed in range(4):", False),
        ("_check(plan, rank, seed + rank)", False),
        ("ids, labels = make_batch(seq_lens, args.seed, device)", False),
        ('{"seed": 3}', False),
        ("parser.add_argument('--seed', type=int)", False),
        ("builds the same model (fixed seed, CPU init)", False),
        ("the same ``seed`` gives the same model", False),
        ("A GPTModel whose weights depend only on ``args.seed``.", False),
        ("Uneven lengths, fixed by seed so every rank agrees.", False),
        ("seeded generators and seeds per rank", False),
        ("Regression test for the seed report.", True),
        ("(seed/000_51ba09fdc79fe587.txt)", True),
        ("the seed's probe hidden_states[1:][mask]", True),
        ("seed probe: output.hidden_states[1:][mask]", True),
        ("ids, labels = seed._batch()", True),
        ("help='seed shape at CP 4 only'", True),
    ],
)
def test_patterns(line, banned):
    got = any(p.search(line) for _, p in BANNED) or _seed_hits(line)
    assert got == banned, line


def test_no_notebook_words_in_tracked_files():
    hits = find_hits(*_tracked_files())
    assert not hits, "notebook words in tracked files:\n" + "\n".join(hits)
