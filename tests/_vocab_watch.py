"""Watches which rows the forward's grouped top-k hands back for selection over every element.

Shared by the CUDA tests, the interpreter test and ``benchmarks/bench_head.py``. It wraps the
module's ``_reselect``, so it depends on that internal name and signature on purpose: the
re-selection call is ``_reselect(rows, weight, k, slots, keys=None)``.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def reselected_rows(vocab_ops):
    """Yields a list that collects, per forward call made inside the block, the number of rows
    selected again over every element (one entry per re-selection)."""
    counts = []
    real = vocab_ops._reselect

    def watch(hidden, weight, k, slots, keys=None):
        counts.append(hidden.shape[0])
        return real(hidden, weight, k, slots, keys)

    vocab_ops._reselect = watch
    try:
        yield counts
    finally:
        vocab_ops._reselect = real
