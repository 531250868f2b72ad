"""The fused attention's peak memory on the CPU, with a kernel that allocates what cuDNN's does.

``ShapeKernel`` computes nothing: its forward returns output and statistics buffers, and its
backward allocates, for the length of the call, the workspace cuDNN's GQA backward sizes by the
rows its buffers span (fp32 dQ for every query row, per-query-head dK / dV for every
key-gradient row at two bytes an element, ``CudnnOptions.exact_key_workspace``; the statistics
padded per entry, twice) before returning its gradients. The peak of one forward+backward is
read as ``bench_attention.py`` reads it on a GPU (``timing.extra_peak_bytes``: on the CPU the
profiler's allocation events), beyond the query, keys and their gradients, output and its
gradient. It models where the blocked and run layouts' peak lies (which buffers are alive
during which call) without a GPU; the GPU's own numbers are in RESULTS.md.

With ``--table-ops`` it counts instead the host ops a step spends on a batch's tables built and
staged ahead (``ContextParallelParams.prepare``): the top-level aten ops of ``on()`` and those
of the device tables the first forward+backward derives from them (``DeviceRuns`` /
``DeviceBlocks``: key sources, slot copies, entry rows; and, as cuDNN's calls derive them, the
ragged offsets and the statistics index), the first call's ops less a second call's on the same
tables. On a GPU each is a launch or a host-side tensor op of a few microseconds. Beside them,
the host ms of ``stage_backward`` (the backward's parts and windows cut and laid out for their
copy), which the first backward spends unless ``prepare(heads=, head_dim=)`` ran it ahead.

Usage: python benchmarks/probes/probe_backward_memory.py [--cases random_rows_cp2,...]
       [--size 20436] [--table-ops] [--trees 4096+8x1024,16384+16x512]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Tuple

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "attention"))

from bench_attention import DIM, GROUPS, HEADS, _sequence, named_cases, tree_cases  # noqa: E402
from timing import GiB, extra_peak_bytes  # noqa: E402

from megatron.context_parallel import ContextParallelPlan  # noqa: E402
from megatron.context_parallel.attention import cudnn as cudnn_kernel  # noqa: E402
from megatron.context_parallel.attention.blocks import build_attention_tables  # noqa: E402
from megatron.context_parallel.attention.fused import fused_attention, stage_backward  # noqa: E402
from megatron.context_parallel.attention.tree_tables import TreeTables  # noqa: E402


class ShapeKernel:
    """An ``AttentionKernel`` that allocates like cuDNN's and computes nothing."""

    shared_keys_in_backward = True
    split_backward = True
    split_margin = 1.10

    def __init__(self, cudnn=cudnn_kernel.KERNEL, window_shape=None):
        self.cudnn = cudnn  # whose window budgets it takes
        # (heads, dim) the windows are cut for, where the inputs are narrower (--table-ops).
        self.window_shape = window_shape

    def backward_window_rows(self, heads, dim):
        return self.cudnn.backward_window_rows(*(self.window_shape or (heads, dim)))

    def for_levels(self):
        return ShapeKernel(self.cudnn.for_levels(), self.window_shape)

    @staticmethod
    def key_gradients(kv, runs):
        return kv.new_zeros((2, runs.mat_rows, kv.shape[1], kv.shape[2] // 2))

    @staticmethod
    def forward(q, kv, runs, dev, scale, want_stats):
        heads, dim = q.shape[1], q.shape[2]
        kv_tok = kv.shape[1] * kv.shape[2]
        # The device tables cuDNN's forward derives (its ragged offsets), for --table-ops.
        dev.offsets("q_rows", heads * dim)
        dev.offsets("kv_rows", kv_tok)
        if want_stats:
            dev.offsets("q_rows", heads)
        stats = torch.zeros(q.shape[:2], dtype=torch.float32) if want_stats else None
        return torch.zeros_like(q), stats

    def backward(
        self, q, kv, o, do, stats, runs, dev, scale, deterministic, dkv_out=None, dq_out=None
    ):
        heads, dim = q.shape[1], q.shape[2]
        # The device tables cuDNN's backward derives (offsets, statistics index).
        dev.offsets("q_rows", heads * dim)
        dev.offsets("mat_rows", kv.shape[1] * dim)
        dev.offsets("kv_rows", kv.shape[1] * kv.shape[2])
        dev.stats_index(runs.max_q)
        rows = runs.total_q + runs.total_mat
        padded = runs.batch * runs.max_q * heads * 4
        workspace = torch.empty(rows * 4 * heads * dim + 2 * padded, dtype=torch.uint8)
        dq = torch.zeros_like(q) if dq_out is None else dq_out
        dkv = self.key_gradients(kv, runs) if dkv_out is None else dkv_out
        del workspace
        return dq, dkv


# Ops that only make a view (host metadata, no launch on a GPU).
VIEW_OPS = {
    "aten::" + name
    for name in (
        "view", "slice", "reshape", "alias", "as_strided", "split", "split_with_sizes", "select",
        "unsqueeze", "permute", "narrow", "expand", "detach", "detach_", "lift_fresh", "flatten",
        "unbind", "squeeze", "t", "transpose", "contiguous",
    )
}  # fmt: skip


def host_ops(fn) -> Tuple[int, int]:
    """``(all, not views)``: the top-level aten ops (not those inside another aten op) that
    ``fn()`` runs, and those of them that make more than a view (``VIEW_OPS``)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    top = [e.name for e in prof.events() if e.name.startswith("aten::") and (
        e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]  # fmt: skip
    return len(top), sum(1 for name in top if name not in VIEW_OPS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="random_rows_cp2,block_shuffled_64_cp4,zigzag_cp2")
    ap.add_argument("--size", type=int, default=20436)
    ap.add_argument("--table-ops", action="store_true", help="host ops of tables staged ahead")
    ap.add_argument(
        "--trees", default="", help="GRPO trees 'P+GxC,...' at CP 1 instead of the named cases"
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    cpu = torch.device("cpu")
    if args.trees:
        chosen = []
        for name, tree in tree_cases(args.trees):
            plan = ContextParallelPlan.contiguous(tree.seq_len, 1)
            chosen.append((name, functools.partial(TreeTables.build, plan, 0, tree), tree.seq_len))
    else:
        chosen = []
        for name, plan, rank, cu in named_cases(args.size, args.cases.split(",")):
            seq = _sequence(plan.seq_len, cu)
            chosen.append(
                (name, functools.partial(build_attention_tables, plan, rank, seq), args.size)
            )
    for name, make, size in chosen:

        # The windows are cut for the real heads and width either way (--table-ops counts ops
        # on narrow inputs: heads and width do not change them).
        kernel = ShapeKernel(window_shape=(HEADS, DIM))
        heads, groups, dim = (2, 1, 8) if args.table_ops else (HEADS, GROUPS, DIM)

        def staged(backward=False, make=make, kernel=kernel, shape=(heads, dim)):
            tables = make()
            tables.stage()
            if backward:  # as prepare(heads=, head_dim=), for the inputs' shape
                stage_backward(tables, *shape, kernel)
            return tables

        tables = staged()
        n = tables.rows
        query = torch.zeros(n, heads, dim, dtype=torch.bfloat16)
        kv = torch.zeros(tables.slots, groups, 2 * dim, dtype=torch.bfloat16)
        grad = torch.zeros(n, heads, dim, dtype=torch.bfloat16)

        def step(tables, query=query, kv=kv, grad=grad, kernel=kernel):
            q, k = query.detach().requires_grad_(), kv.detach().requires_grad_()
            fused_attention(q, k, tables, DIM**-0.5, kernel=kernel).backward(grad)

        if args.table_ops:
            cells = []
            for backward in (False, True):
                ahead = staged(backward)
                copy = host_ops(lambda ahead=ahead: ahead.on(cpu))
                run = functools.partial(step, ahead)
                first, again = host_ops(run), host_ops(run)
                cells.append(
                    f"on() {copy[0]} ({copy[1]}), the first layer's {first[0] - again[0]} "
                    f"({first[1] - again[1]})"
                )
            ms = []
            for _ in range(3):  # host ms of the backward's cuts and layout, on fresh tables
                fresh = staged()
                start = time.perf_counter()
                stage_backward(fresh, heads, dim, kernel)
                ms.append((time.perf_counter() - start) * 1e3)
            print(
                f"{name} S={size}: {tables.describe()}; host ops (not views) of tables "
                f"staged ahead: {cells[0]}; with the backward staged ahead: {cells[1]}; "
                f"stage_backward {sorted(ms)[1]:.2f} ms"
            )
            continue
        step = functools.partial(step, tables)
        step()
        kept = 2 * query.numel() * 2 + kv.numel() * 2  # output and its gradient, dK / dV
        peak = extra_peak_bytes(step, torch.device("cpu"), kept)
        print(f"{name} S={size}: {tables.describe()}; modelled extra {peak / GiB:.2f} GiB")


if __name__ == "__main__":
    main()
