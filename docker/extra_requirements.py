"""Prints the requirements of extras of an installed distribution, one a line.

``docker/install.sh --extras attention`` installs the package itself with ``--no-deps`` (the
base environment holds its dependencies), which also drops its extras' requirements; it then
reads them from the installed metadata with this script, so setup.py's ``extras_require`` stays
the one place that names them.

Usage: python docker/extra_requirements.py DISTRIBUTION EXTRA[,EXTRA...]
Exits 2, naming the extras that exist, when one is unknown.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from typing import List

_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_requirements(distribution: str, extras: List[str]) -> List[str]:
    """The requirement strings (markers dropped) that ``extras`` of ``distribution`` add."""
    meta = importlib.metadata.metadata(distribution)
    known = {_normalise(e) for e in meta.get_all("Provides-Extra") or []}
    wanted = {_normalise(e) for e in extras}
    unknown = sorted(wanted - known)
    if unknown:
        raise ValueError(
            f"{distribution} has no extra {', '.join(unknown)} (it has: "
            f"{', '.join(sorted(known)) or 'none'})"
        )
    out = []
    for line in importlib.metadata.requires(distribution) or []:
        requirement, _, marker = line.partition(";")
        match = _EXTRA.search(marker)
        if match and _normalise(match.group(1)) in wanted:
            out.append(requirement.strip())
    return out


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        lines = extra_requirements(argv[0], [e for e in argv[1].split(",") if e])
    except ValueError as exc:
        print(f"extra_requirements.py: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
