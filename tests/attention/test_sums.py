"""The blocked attention's merge and row sums: the Triton kernels (through Triton's interpreter,
in a subprocess) against the torch path, which the CPU tests of the fused path already check
against the oracle; fp16 / fp32 inputs (the interpreter's bf16 is unreliable), rows without
bulk keys (-inf), repeated source rows; the split key gradients' slot sums and row adds,
read dense or strided, with missing (-1) copies."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_ROOT = pathlib.Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import torch
from megatron.context_parallel.attention import sums

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

    # Split key gradients [2, M, G, d], dense or a strided view of interleaved rows, read into
    # [G, 2d] slot rows; the reference interleaves them by indexing alone.
    m, groups, d, slots = 13, 3, 8, 17
    dense = torch.randn(2, m, groups, d, generator=g).to(dtype)
    rows = torch.randn(m, groups, 2 * d, generator=g).to(dtype)
    strided = rows.view(m, groups, 2, d).permute(2, 0, 1, 3)
    for keys, slot_rows in ((dense, torch.cat([dense[0], dense[1]], -1)), (strided, rows)):
        torch.testing.assert_close(sums.interleave(keys), slot_rows, rtol=0, atol=0)
        for count in (1, 2, 3):
            copies = torch.randint(-1, m, (count, slots), generator=g)
            want = torch.zeros(slots, groups, 2 * d)
            for row in copies:
                picked = slot_rows[row.clamp(min=0)].float()
                want += torch.where((row >= 0)[:, None, None], picked, 0)
            sums._use_triton = lambda *t: True
            got = sums.slot_sums(keys, copies)
            assert got.dtype == dtype
            torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)
            sums._use_triton = lambda *t: False
            torch.testing.assert_close(sums.slot_sums(keys, copies), got, rtol=0, atol=0)
        acc = torch.randn(20, groups, 2 * d, generator=g)
        dst = torch.randperm(20, generator=g)[:m]
        want = acc.clone()
        want[dst] += slot_rows.float()
        for triton_on in (True, False):
            got = acc.clone()
            sums._use_triton = lambda *t, on=triton_on: on
            sums.add_key_rows(got, dst, keys)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        # With source rows: a permuted subset of the key rows.
        src = torch.randperm(m, generator=g)[: m // 2 + 1]
        want = acc.clone()
        want[dst[: src.numel()]] += slot_rows[src].float()
        for triton_on in (True, False):
            got = acc.clone()
            sums._use_triton = lambda *t, on=triton_on: on
            sums.add_key_rows(got, dst[: src.numel()], keys, src)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
print("ok")
"""


def test_kernels_match_the_torch_path_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(_ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
