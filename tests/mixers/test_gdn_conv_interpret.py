"""The gathered GDN convolution's Triton kernels on CPU, through Triton's interpreter.

``_gdn_conv.gathered_causal_conv`` reads source rows through an index and writes their gradient
back through it. Here, in a subprocess with ``TRITON_INTERPRET=1`` (chosen when the kernels are
launched): random packed sequences (single-row and empty ones, rows crossing the 64-row tiles),
random permutations, kernel widths 2-4, with and without bias and activation, fp32 and fp16,
and no rows at all, against the plain-torch convolution (``gdn._causal_depthwise_conv``) on the
rows put in source order by indexing: output, the columns passed through, and the gradients of
the received rows, the weight and the bias.
"""

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
import torch.nn.functional as F
from megatron.context_parallel.mixers.gdn_conv import gathered_causal_conv
from megatron.context_parallel.mixers.gdn import _causal_depthwise_conv

gen = torch.Generator().manual_seed(0)
cases = [
    # rows, conv columns, row width, kernel, sequence lengths, activation, bias, dtype
    (150, 40, 47, 4, [3, 67, 1, 79], "silu", True, torch.float32),
    (64, 33, 33, 4, [64], None, False, torch.float32),
    (5, 8, 10, 3, [1, 1, 3], "silu", False, torch.float32),
    (130, 20, 26, 4, [130], "swish", True, torch.float16),
    (70, 9, 12, 2, [0, 35, 0, 35], "silu", True, torch.float32),
    (0, 8, 10, 4, [], "silu", True, torch.float32),
]
for n, c, width, k, lengths, act, has_bias, dtype in cases:
    x = torch.randn(n, width, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(c, k, generator=gen).requires_grad_()
    b = torch.randn(c, generator=gen).requires_grad_() if has_bias else None
    to_source = torch.randperm(n, generator=gen)
    from_source = torch.empty_like(to_source)
    from_source[to_source] = torch.arange(n)
    offsets = torch.cat([torch.arange(m) for m in lengths]) if lengths else torch.zeros(0).long()
    y, rest = gathered_causal_conv(x, w, b, to_source, from_source, offsets, c, act)
    src = x[to_source]
    ref = _causal_depthwise_conv(src[:, :c].float(), w, b, offsets)
    ref = (F.silu(ref) if act else ref).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert y.shape == ref.shape and y.dtype == dtype and rest.dtype == dtype
    assert torch.equal(rest, src[:, c:])
    leaves = [x, w] + ([b] if has_bias else [])
    gy = torch.randn(y.shape, generator=gen).to(dtype)
    gr = torch.randn(rest.shape, generator=gen).to(dtype)
    got = torch.autograd.grad((y, rest), leaves, (gy, gr))
    exp = torch.autograd.grad((ref, src[:, c:]), leaves, (gy, gr))
    for name, a, e in zip(("y", "dx", "dw", "db"), (y,) + got, (ref,) + exp):
        assert a.shape == e.shape, name
        if e.numel():
            scale = max(1.0, e.float().abs().max().item())
            err = (a.float() - e.float()).abs().max().item()
            assert err <= 10 * tol * scale, (n, name, err)
    print("ok", n, c, width, k, act, dtype)
"""


def test_gathered_convolution_matches_torch_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{_ROOT}{os.pathsep}{_ROOT / 'tests'}")
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.count("ok") == 6
