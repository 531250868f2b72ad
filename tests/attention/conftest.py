"""The attention tests' shared guard: the gradient sums' contract holds in every test here."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def require_distinct_sum_rows(monkeypatch):
    """Make ``sums.add_rows`` / ``sums.add_key_rows`` raise on a repeated destination row.

    On the CPU they add with ``index_add_``, which sums repeats; their CUDA passes add without
    atomics, so a repeat there keeps one term (a wrong gradient only a GPU would show). With
    this on for every attention test, the CPU catches a caller that breaks the contract.
    """
    from megatron.context_parallel.attention import sums

    def checked(fn):
        def wrapper(acc, dst, *args, **kwargs):
            assert dst.unique().numel() == dst.numel(), f"{fn.__name__}: a destination repeats"
            return fn(acc, dst, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(sums, "add_rows", checked(sums.add_rows))
    monkeypatch.setattr(sums, "add_key_rows", checked(sums.add_key_rows))
