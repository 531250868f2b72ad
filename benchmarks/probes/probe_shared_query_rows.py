"""Whether one cuDNN backward call whose entries share query rows beats the blocked level calls.

The blocked layout's bulk (group ``i`` of a sequence attends key pieces ``0..i`` unmasked) runs
its backward today as ``log2(groups) + 1`` calls, because one call must not hold two entries
with the same keys. Cut by key piece instead, entry ``j`` is piece ``j``'s keys against the
query rows of groups ``j..`` (one range of the sorted rows): the keys of entries are disjoint,
their query rows overlap. If the backward accumulates dQ by buffer row (fp32, atomically, as
flash-attention kernels do) and converts it once, one call gives the whole bulk's gradients.

Timed here: the one call against the level calls of the same bulk (bf16, 40 / 8 heads of 128,
random inputs; their sums included). On an H100 at 80 groups of 128 rows and pieces of 256 keys
(the random rows of CP 2 at S = 20,436) the one call took 25.5 ms against 16.3, presumably as
the backward's per-entry passes (``dO . O``, the statistics padded to the longest entry) run over
every entry's rows, ``groups / 2`` times the rows when entries overlap so. So the blocked
layout keeps its level calls; whether the overlapping query gradients add correctly was not
settled (the call is slower either way).

Usage: python benchmarks/probes/probe_shared_query_rows.py [--groups 80] [--group-rows 128]
       [--piece 256]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from timing import time_ms  # noqa: E402

from megatron.context_parallel.attention import cudnn as cudnn_kernel  # noqa: E402
from megatron.context_parallel.attention.runs import AttentionRuns  # noqa: E402

HEADS, GROUPS, DIM = 40, 8, 128


def _call(q_start, q_len, k_start, kv_len, rows, keys):
    return AttentionRuns.from_layout(
        q_start, q_len, k_start, kv_len, k_start, backward=False, query_rows=rows,
        mat_rows=keys, num_keys=keys, causal=False, span_source=None, local_to_span=None,
        rows_covered=False, shape_buckets=None,
    )  # fmt: skip


def _levels(groups, group_rows, piece):
    """The level calls of the same bulk (as ``AttentionBlocks`` cuts it): pairs ``j == i``,
    then by the highest differing bit."""
    calls = []
    i = torch.arange(groups)
    calls.append(
        (i * group_rows, torch.full_like(i, group_rows), i * piece, torch.full_like(i, piece))
    )
    level = 0
    while (1 << level) < groups:
        width = 1 << level
        qs, ql, ks, kl = [], [], [], []
        for block in range(0, groups, 2 * width):
            hi = min(block + 2 * width, groups)
            if block + width >= hi:
                continue
            qs.append((block + width) * group_rows)
            ql.append((hi - block - width) * group_rows)
            ks.append(block * piece)
            kl.append(width * piece)
        calls.append(tuple(torch.tensor(t) for t in (qs, ql, ks, kl)))
        level += 1
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=80)
    ap.add_argument("--group-rows", type=int, default=128)
    ap.add_argument("--piece", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    R, P = args.group_rows, args.piece
    _time(args.groups, R, P, dev, args.reps)


def _inputs(G, R, P, dev):
    n, keys = G * R, G * P
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(n, HEADS, DIM, device=dev, generator=g).bfloat16()
    kv = torch.randn(keys, GROUPS, 2 * DIM, device=dev, generator=g).bfloat16()
    do = torch.randn(n, HEADS, DIM, device=dev, generator=g).bfloat16()
    return n, keys, q, kv, do


def _one_call(G, R, P, n, keys, q, kv, o, do, stats, dev):
    j = torch.arange(G)
    pieces = _call(j * R, n - j * R, j * P, torch.full_like(j, P), n, keys)
    pd = pieces.on(dev)

    def run():
        out = torch.zeros((2, keys, GROUPS, DIM), dtype=q.dtype, device=dev)
        return cudnn_kernel.KERNEL.backward(
            q, kv, o, do, stats, pieces, pd, DIM**-0.5, False, dkv_out=out
        )

    return run


def _level_calls(G, R, P, n, keys, q, kv, o, do, stats, dev):
    level_calls = [_call(*t, n, keys) for t in _levels(G, R, P)]
    level_dev = [c.on(dev) for c in level_calls]

    def run():
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=dev)
        dkv_acc = torch.zeros((2, keys, GROUPS, DIM), dtype=torch.float32, device=dev)
        for c, cd in zip(level_calls, level_dev):
            out = torch.zeros((2, keys, GROUPS, DIM), dtype=q.dtype, device=dev)
            dq_c, dkv_c = cudnn_kernel.KERNEL.backward(
                q, kv, o, do, stats, c, cd, DIM**-0.5, False, dkv_out=out
            )
            dq_acc += dq_c
            dkv_acc += dkv_c
        return dq_acc, dkv_acc

    return run, len(level_calls)


def _time(G, R, P, dev, reps):
    n, keys, q, kv, do = _inputs(G, R, P, dev)
    o = torch.randn_like(q)
    stats = torch.randn(n, HEADS, device=dev).abs() + 20.0
    one = _one_call(G, R, P, n, keys, q, kv, o, do, stats, dev)
    levels, calls = _level_calls(G, R, P, n, keys, q, kv, o, do, stats, dev)
    t_one = time_ms(one, dev, reps, 3)
    t_lev = time_ms(levels, dev, reps, 3)
    pairs = sum(R * (i + 1) * P for i in range(G))
    print(
        f"groups {G} x {R} rows, pieces {P}: bulk pairs {pairs / 1e6:.1f} M; one call "
        f"{t_one:.3f} ms; {calls} level calls {t_lev:.3f} ms (sums included)"
    )


if __name__ == "__main__":
    main()
