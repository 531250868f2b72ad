"""Watches which rows the forward's grouped top-k hands back for selection over every element.

Shared by the CUDA tests, the interpreter test and ``benchmarks/head/bench_head.py``. It wraps the
module's ``_reselect_into``, so it depends on that internal name and signature on purpose:
``_reselect_into(hidden, weight, redo, values, ids, k, slots, cfg)`` returns an int32 ``[1]``
device tensor, how many rows it selected again.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def reselected_rows(vocab_ops):
    """Yields a list that collects, per forward call made inside the block, the number of rows
    selected again over every element (one entry per call that had any). It is filled when the
    block exits: the counts stay on the device until then, so watching adds no host read."""
    counts = []
    pending = []
    real = vocab_ops._reselect_into

    def watch(*args):
        count = real(*args)
        pending.append(count)
        return count

    vocab_ops._reselect_into = watch
    try:
        yield counts
    finally:
        vocab_ops._reselect_into = real
        counts.extend(m for m in (int(c.item()) for c in pending) if m)
