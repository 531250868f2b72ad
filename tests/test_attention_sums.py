"""The blocked attention's merge and row sums: the Triton kernels (through Triton's interpreter,
in a subprocess) against the torch path, which the CPU tests of the fused path already check
against the oracle; fp16 / fp32 inputs (the interpreter's bf16 is unreliable), rows without
bulk keys (-inf), repeated source rows."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_ROOT = pathlib.Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import torch
from megatron.context_parallel import _attention_sums as sums

g = torch.Generator().manual_seed(0)
for dtype in (torch.float16, torch.float32):
    n, heads, d = 37, 3, 16
    o_b = torch.randn(n, heads, d, generator=g).to(dtype)
    o_d = torch.randn(n, heads, d, generator=g).to(dtype)
    lse_b = torch.randn(n, heads, generator=g) * 3
    lse_b[::5] = float("-inf")
    o_b[::5] = 0
    lse_d = torch.randn(n, heads, generator=g) * 3
    sums._use_triton = lambda *t: False
    want_o, want_lse = sums.merge(o_b, lse_b, o_d, lse_d)
    sums._use_triton = lambda *t: True
    got_o, got_lse = sums.merge(o_b, lse_b, o_d, lse_d)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_o.float(), want_o.float(), rtol=2e-3, atol=2e-3)

    acc = torch.randn(20, 2, 600, generator=g)
    dst = torch.randperm(20, generator=g)[:11]
    src = torch.randn(9, 2, 600, generator=g).to(dtype)
    src_rows = torch.randint(0, 9, (11,), generator=g)
    for rows in (src_rows, None):
        source = src if rows is not None else torch.randn(11, 2, 600, generator=g).to(dtype)
        want, got = acc.clone(), acc.clone()
        sums._use_triton = lambda *t: False
        sums.add_rows(want, dst, source, rows)
        sums._use_triton = lambda *t: True
        sums.add_rows(got, dst, source, rows)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
print("ok")
"""


def test_kernels_match_the_torch_path_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(_ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
