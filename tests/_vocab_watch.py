"""Watches which rows the forward's grouped top-k hands back for selection over every element.

Shared by the CUDA tests, the interpreter test and ``benchmarks/bench_head.py``. It wraps the
module's ``_reselect_queue``, so it depends on that internal name and signature on purpose:
``_reselect_queue(hidden, weight, redo, values, ids, k, slots, cfg)`` returns ``(count,
ahead)``, ``count`` an int32 ``[1]`` device tensor of how many rows it was given to select again
(both the plain and the deferred forward call it once per re-selection).
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def reselected_rows(vocab_ops):
    """Yields a list that collects, per forward call made inside the block, the number of rows
    selected again over every element (one entry per re-selection with any row; filled when the
    block exits, so that watching adds no host read inside it)."""
    counts = []
    pending = []
    real = vocab_ops._reselect_queue

    def watch(*args):
        count, ahead = real(*args)
        pending.append(count)
        return count, ahead

    vocab_ops._reselect_queue = watch
    try:
        yield counts
    finally:
        vocab_ops._reselect_queue = real
        counts.extend(m for m in (int(c.item()) for c in pending) if m)
