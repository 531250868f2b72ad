"""How long cuDNN takes to build the fused attention's graphs, and whether its dynamic shapes
and kernel cache (``is_dynamic_shape_enabled`` + ``create_kernel_cache``, passed as
``CudnnOptions.graph_options``) make a new bucketed shape cheap; outputs must equal those of
graphs built without them.

Run on a GPU with nvidia-cudnn-frontend: ``python benchmarks/probes/probe_cudnn_builds.py``.
"""

from __future__ import annotations

import pathlib
import random
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))

from bench_attention import _random_uneven_plan  # noqa: E402
from timing import samples_ms  # noqa: E402

from megatron.context_parallel.attention import cudnn as attention_cudnn  # noqa: E402
from megatron.context_parallel.attention.fused import fused_attention  # noqa: E402
from megatron.context_parallel.attention.runs import AttentionRuns  # noqa: E402

H, G, D, S = 40, 8, 128, 20436


def run(plans, options):
    attention_cudnn.reset_graphs()
    kernel = attention_cudnn.CudnnKernel(
        attention_cudnn.CudnnOptions(graph_options=tuple(options.items()))
    )
    outs, builds, seconds = [], [], []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for plan in plans:
        rank = 0 if plan.counts[0] else 1
        runs = AttentionRuns.build(plan, rank, torch.zeros(S, dtype=torch.int64))
        q = torch.randn(plan.counts[rank], H, D, device="cuda", generator=gen).bfloat16()
        kv = torch.randn(runs.slots, G, 2 * D, device="cuda", generator=gen).bfloat16()
        q.requires_grad_()
        kv.requires_grad_()
        before = attention_cudnn.graph_builds()
        got = []

        def call(q=q, kv=kv, runs=runs, got=got):
            got.append(fused_attention(q, kv, runs, D**-0.5, kernel=kernel))
            got[0].backward(torch.ones_like(got[0]))

        (ms,) = samples_ms(call, "cuda", 1, 0, clock="host")
        seconds.append(ms / 1e3)
        builds.append(attention_cudnn.graph_builds() - before)
        outs.append((got[0].float(), q.grad.float(), kv.grad.float()))
    return outs, builds, seconds


def main():
    import cudnn

    rng = random.Random(3)
    plans = [_random_uneven_plan(S, rng) for _ in range(12)]
    ref, b0, s0 = run(plans, {})
    print("plain graphs: builds", b0, "first-call seconds", [round(s, 3) for s in s0])
    try:
        options = {"is_dynamic_shape_enabled": True, "kernel_cache": cudnn.create_kernel_cache()}
        got, b1, s1 = run(plans, options)
    except Exception as exc:  # noqa: BLE001 - the probe reports what cuDNN says
        print("dynamic shapes + kernel cache failed:", type(exc).__name__, str(exc)[:400])
        return
    print("dynamic + cache: builds", b1, "first-call seconds", [round(s, 3) for s in s1])
    worst = max((a - b).abs().max().item() for r, g in zip(ref, got) for a, b in zip(r, g))
    print("max |difference| against plain graphs:", worst)


if __name__ == "__main__":
    main()
