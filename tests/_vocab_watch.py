"""Watches which rows the forward's grouped top-k hands back for selection over every element.

Shared by the CUDA tests, the interpreter test and ``benchmarks/bench_head.py``. It wraps the
module's ``_reselect_into``, so it depends on that internal name and signature on purpose:
``_reselect_into(hidden, weight, redo, values, ids, k, slots, cfg)`` returns how many rows it
selected again.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def reselected_rows(vocab_ops):
    """Yields a list that collects, per forward call made inside the block, the number of rows
    selected again over every element (one entry per re-selection)."""
    counts = []
    real = vocab_ops._reselect_into

    def watch(*args):
        m = real(*args)
        if m:
            counts.append(m)
        return m

    vocab_ops._reselect_into = watch
    try:
        yield counts
    finally:
        vocab_ops._reselect_into = real
