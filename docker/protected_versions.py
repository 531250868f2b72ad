"""Prints ``name==version`` of the distributions an install must never replace, one a line.

torch, TransformerEngine (all its split distributions), apex and flash-attn come with the base
image, built together against its CUDA; reinstalling any of them from an index breaks the image.
``docker/install.sh`` prints this list before and after installing and fails if it changed.
Names are normalised (PEP 503) and sorted, so the output is stable.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

# Exact names, and prefixes that cover split distributions (transformer-engine-cu12, ...).
PROTECTED_NAMES = ("torch", "apex")
PROTECTED_PREFIXES = ("transformer-engine", "flash-attn", "flash-attention")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def protected_versions() -> list:
    """Sorted ``name==version`` strings of the installed protected distributions."""
    found = set()
    for dist in importlib.metadata.distributions():
        name = _normalise(dist.metadata["Name"] or "")
        if name in PROTECTED_NAMES or name.startswith(PROTECTED_PREFIXES):
            found.add(f"{name}=={dist.version}")
    return sorted(found)


def main() -> int:
    lines = protected_versions()
    print("\n".join(lines) if lines else "(none installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
