"""Where the forward top-k's time goes (diagnostic, GPU): the kernel alone with k = 20, k = 1
(one pass per tile at most) and k = 0, other split counts, a flattened tile loop, and the exact
re-selection of 17 rows. Prints ms and GEMMs (cuBLAS ``hidden @ weight.T``) per variant.

    PYTHONPATH=$PWD python3 benchmarks/probe_topk.py
"""

import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_head import time_ms  # noqa: E402

from megatron.context_parallel import _vocab_triton, vocab_ops  # noqa: E402

dev = torch.device("cuda")
slots = vocab_ops._sm_count(dev)
gen = torch.Generator(device=dev).manual_seed(0)
base = vocab_ops.kernel_config("fwd_topk")


def launch(h, w, t, k, splits, **over):
    n = h.shape[0]
    kp = _vocab_triton._next_pow2(max(k, 2)) if k else 0
    part = torch.empty(splits, 4, n, device=dev)
    tv = torch.empty(splits, n, kp, device=dev)
    ti = torch.empty(splits, n, kp, device=dev, dtype=torch.int32)
    c = dict(base, **over)
    grouped = c.get("grouped", False)
    return lambda: _vocab_triton.launch_stats_fwd(h, w, t, k, part, tv, ti, splits, c, grouped)


def probe(n, vocab):
    h = torch.randn(n, 5120, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(vocab, 5120, device=dev, generator=gen) * 2 / 5120**0.5).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    gemm = time_ms(lambda: h @ w.t(), dev, 5, 1)
    res = {}
    res["fwd k=0"] = time_ms(lambda: vocab_ops.vocab_stats(h, w, t, 0), dev, 5, 1)
    res["top-20 full path (default)"] = time_ms(
        lambda: vocab_ops.vocab_stats(h, w, t, 20), dev, 5, 1
    )
    auto = vocab_ops.forward_splits(n, vocab, 20, slots)
    variants = [(20, auto, {}), (1, auto, {}), (20, auto, dict(flatten=True))]
    variants += [(20, sp, {}) for sp in (2, 9) if sp != auto]
    variants += [(0, auto, dict(grouped=False))]
    for k, splits, over in variants:
        key = f"launch k={k} splits={splits} {over}"
        try:
            res[key] = time_ms(launch(h, w, t, k, splits, **over), dev, 5, 1)
        except Exception as exc:  # noqa: BLE001
            res[key] = float("nan")
            print(key, type(exc).__name__, str(exc)[-300:])
    for rows in (17,):
        hs = h[:rows].contiguous()
        res[f"exact redo of {rows} rows"] = time_ms(
            lambda hs=hs: vocab_ops._stats_kernel(hs, w, None, 20, slots, False), dev, 5, 1
        )
    print(f"\n{n}x{vocab}: GEMM {gemm:.2f} ms, auto splits {auto}")
    for key, ms in res.items():
        print(f"| {key} | {ms:.2f} | {ms / gemm:.3f} |")


for n, vocab in [(20436, 37984), (20436, 151936)]:
    probe(n, vocab)
