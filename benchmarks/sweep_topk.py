"""Top-k forward configurations side by side (splits per row block, 128-wide tiles) on one GPU.

Times ``vocab_stats(..., k=20)`` and then the cuBLAS unit GEMM for each config, at N = 20,436,
H = 5,120, bf16, on a full vocabulary and a TP-4 shard; medians of 3 after one warm-up call.
Results: benchmarks/RESULTS.md. From the repository root:
``PYTHONPATH=$PWD python3 benchmarks/sweep_topk.py``.
"""

from __future__ import annotations

import torch
from bench_head import time_ms  # the script's folder is on sys.path; bench_head adds the root

from megatron.context_parallel import vocab_ops

CONFIGS = [
    {},
    {"splits": 2},
    {"splits": 3},
    {"splits": 6},
    {"splits": 8},
    {"BN": 128},
    {"BN": 128, "stages": 4},
    {"BN": 128, "splits": 4},
    {"BN": 128, "splits": 8},
]


def main():
    device = torch.device("cuda")
    slots = torch.cuda.get_device_properties(device).multi_processor_count
    base = vocab_ops.kernel_config("fwd_topk")
    for n, vocab in ((20436, 151936), (20436, 37984)):
        gen = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(n, 5120, device=device, generator=gen).to(torch.bfloat16)
        weight = torch.randn(vocab, 5120, device=device, generator=gen) * 2 / 5120**0.5
        weight = weight.to(torch.bfloat16)
        labels = torch.randint(0, vocab, (n,), device=device, generator=gen)
        for cfg in CONFIGS:
            vocab_ops.set_kernel_config("fwd_topk", **{**base, "splits": None, **cfg})
            ms = time_ms(
                lambda h=hidden, w=weight, t=labels: vocab_ops.vocab_stats(h, w, t, 20),
                device,
                3,
                1,
            )
            gemm = time_ms(lambda h=hidden, w=weight: h @ w.t(), device, 3, 1)
            splits = vocab_ops.forward_splits(n, vocab, 20, slots)
            print(
                f"{n}x{vocab} {cfg} splits={splits} ms={ms:.2f} gemm={gemm:.2f} "
                f"ratio={ms / gemm:.3f}",
                flush=True,
            )
        vocab_ops.set_kernel_config("fwd_topk", **base)


if __name__ == "__main__":
    main()
