"""Where a tree's attention time goes: each cuDNN call of ``TreeTables`` timed alone.

For each GRPO batch at CP 1 (one prompt of ``P``, ``G`` completions of ``C``), bf16, 40 / 8 heads
of 128: the own-segment causal call and each ancestor level call, forward and backward
separately (``cudnn.KERNEL`` directly, no gathers or sums), against the floor (cuDNN causal SDPA
over one sequence of ``S``, scaled per visible query-key pair, as ``bench_attention.py``). Also
the own part split into two calls (the prompt's entry alone, the completions' entries alone),
which tests whether the own call's shape (its entries times its longest entry's rows, both
rounded up to powers of two) costs time on top of the rows themselves. Calls whose causal
entries are all square run again with the diagonal aligned top-left (the same mask:
``CudnnOptions.square_top_left``), which asks whether the ragged causal backward's time is the
bottom-right alignment's.

Usage: python benchmarks/probes/probe_tree_calls.py [--batches 4096+8x1024,16384+16x512]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "attention"))

from bench_attention import DIM, GROUPS, HEADS, sdpa_floor  # noqa: E402
from floor import tree_visible_pairs  # noqa: E402
from timing import time_ms  # noqa: E402

from megatron.context_parallel import ContextParallelPlan, PrefixTree  # noqa: E402
from megatron.context_parallel.attention import cudnn as cudnn_kernel  # noqa: E402
from megatron.context_parallel.attention.runs import AttentionRuns  # noqa: E402
from megatron.context_parallel.attention.tree_tables import TreeTables  # noqa: E402

TOP_LEFT = cudnn_kernel.CudnnKernel(cudnn_kernel.CudnnOptions(square_top_left=True))
BOTTOM_RIGHT = cudnn_kernel.CudnnKernel(cudnn_kernel.CudnnOptions(square_top_left=False))


def _call_times(q, kv, runs, reps, kernel=cudnn_kernel.KERNEL):
    """(fwd ms, bwd ms) of one call's kernel alone."""
    dev, scale = runs.on(q.device), DIM**-0.5
    o, lse = kernel.forward(q, kv, runs, dev, scale, True)
    do = torch.randn_like(o)
    fwd = time_ms(lambda: kernel.forward(q, kv, runs, dev, scale, True), q.device, reps, 1)
    bwd = time_ms(
        lambda: kernel.backward(q, kv, o, do, lse, runs, dev, scale, False), q.device, reps, 1
    )
    return fwd, bwd


def _split_own(own: AttentionRuns, longest: int):
    """The own call's entries as two calls: those with more than ``longest`` keys, the rest."""
    out = []
    for keep in (own.kv_len > longest, own.kv_len <= longest):
        if bool(keep.any()):
            out.append(
                AttentionRuns.from_entries(
                    own.q_start[keep], own.q_len[keep], own.k_start[keep], own.kv_len[keep],
                    query_rows=own.query_rows, num_keys=own.num_keys, causal=True,
                )  # fmt: skip
            )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="4096+8x1024,16384+16x512")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    for item in args.batches.split(","):
        prompt, rest = item.split("+")
        group, completion = (int(x) for x in rest.split("x"))
        tree = PrefixTree([-1] + [0] * group, [int(prompt)] + [completion] * group)
        s = tree.seq_len
        tables = TreeTables.build(ContextParallelPlan.contiguous(s, 1), 0, tree)
        g = torch.Generator(device=device).manual_seed(s)
        q = torch.randn(s, HEADS, DIM, device=device, generator=g).bfloat16()
        kv = torch.randn(s, GROUPS, 2 * DIM, device=device, generator=g).bfloat16()
        pairs = tree_visible_pairs(tree)
        floor = sdpa_floor([s], args.reps, device)[s]
        share = pairs / (s * (s + 1) / 2)
        print(f"## {item}: S {s}, visible pairs {pairs}, floor fwd {floor[0] * share:.2f} ms, "
              f"fwd+bwd {floor[1] * share:.2f} ms (scaled)")  # fmt: skip
        print("| call | entries | rows | keys / entry (max) | shape (batch, max_q, max_kv) | "
              "pairs | fwd ms | bwd ms | fwd x floor | bwd x floor |")  # fmt: skip
        print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
        calls = [("own", tables.own, q)]
        rows = tables.level_rows
        calls += [
            (f"level {i}", c, q[r.to(device)]) for i, (c, r) in enumerate(zip(tables.levels, rows))
        ]
        calls += [
            (f"own split {i}", c, q) for i, c in enumerate(_split_own(tables.own, completion))
        ]
        per_pair_f = floor[0] * share / pairs
        per_pair_b = (floor[1] - floor[0]) * share / pairs
        for name, runs, qq in calls:
            qq = qq.contiguous()
            causal_pairs = (
                runs.q_len * (2 * runs.kv_len - runs.q_len + 1) // 2
                if runs.causal
                else runs.q_len * runs.kv_len
            )
            p = int(causal_pairs.sum())
            shape = (runs.batch, runs.max_q, runs.max_kv)
            kernels = [("", BOTTOM_RIGHT)]
            if cudnn_kernel.diagonal(runs, TOP_LEFT.options) == "top_left":
                kernels.append((", diagonal top-left", TOP_LEFT))
            for label, kernel in kernels:
                try:
                    f, b = _call_times(qq, kv, runs, args.reps, kernel)
                except Exception as e:  # noqa: BLE001 - a graph cuDNN refuses is a result here
                    print(f"| {name}{label} | {type(e).__name__}: {str(e)[:200]} |", flush=True)
                    continue
                print(f"| {name}{label} | {runs.entries} | {int(runs.q_len.sum())} | "
                      f"{int(runs.kv_len.max())} | {shape} | {p} | {f:.2f} | {b:.2f} | "
                      f"{f / (p * per_pair_f):.2f} | {b / (p * per_pair_b):.2f} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
