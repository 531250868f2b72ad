"""Attention of one CP rank's rows under any plan: the fused path against the cuDNN floor.

For each case (one rank's rows of a plan, all keys of the batch; bf16, 40 query heads, 8 KV
groups, head dim 128), side by side in one run:

* ``floor``: torch's SDPA with the cuDNN backend, causal over the whole sequence (each packed
  sequence for THD), times the rank's share of the causal work (for THD, summed over
  sequences): what a rank would pay if its rows cost exactly their share of the best kernel;
* ``ours``: ``fused_attention`` (run tables + cuDNN), including the compact-key gather that
  follows the CP all-gather; forward, and forward+backward;
* ``dense`` (S = 20,436 only, forward): today's dense computation (``[heads, rows, S]`` fp32
  scores), where it fits;
* ``flex``: FlexAttention (torch's Triton backend, default blocks) with a block mask built from
  the plan (rows sorted by position, keys in compact order), compiled once per case.

Reported: median ms (CUDA events, methods timed in turns by ``timing.time_round_robin``),
ratio to the floor, extra peak memory (``max_memory_allocated`` during the call minus what was
allocated before it, minus the output and, for forward+backward, the gradients of Q and K/V),
the max error against the dense fp32 computation on a slice of rows, the run tables' build
time (host, per batch) against one layer's forward+backward, the part of it left in the step
when the tables were built and staged ahead (``staged``: ``ContextParallelParams.prepare`` in a
data-loader thread leaves the device copy), and cuDNN graph builds over 20 batches of random
plans.

``--model`` adds the GPTModel row: 4 layers shaped like a 27B dense model (hidden 5,120, 40/8
heads, FFN 17,408), S = 20,436, the uneven plan's rank-0 rows run at CP 1 (a world-1 group,
rows permuted), forward+backward time and the share of attention in it (megatron-core needed),
and the tables' exposed cost: the step building them against the step reusing them, in turns
over ``--model-reps`` rounds (the host builds them while the GPU runs the layers before the
first attention; what the step does not hide shows here).

``--tables-only`` (CPU or GPU) times only the per-batch tables of every case, built by the C++
builders (``megatron.context_parallel._host``) and by the torch-op reference in turns, each
including the copy to the device: the host cost a micro-batch pays before its first layer.

Named cases (``--named`` runs them all at every size; ``--cases`` picks any case, default or
named, by a part of its name, e.g. ``--cases packed_cut,block_shuffled_64``), plans built
independently of the tables' tuning (issue 44), each the heaviest rank's rows (the most visible
query-key pairs), seeds fixed: ``zigzag_cp2``; ``packed_cut_1seq_cp4`` (one sequence cut at 11
random points, the pieces dealt to CP 4 in turn); ``packed_cut_13seq_cp4`` (13 packed sequences
of random lengths, cut at 11 random points unrelated to their boundaries, dealt to CP 4);
``thd_13seq_cp2`` (THD of 13 random lengths, CP 2); ``block_shuffled_64_cp4`` (64-row blocks in
a random order dealt to CP 4); ``random_rows_cp2`` (every row dealt at random over CP 2).

``--tree`` adds the GRPO trees (``--tree-batches``, default prompt 4,096 + 8 x 1,024 and prompt
16,384 + 16 x 512) at CP 1: every row, the tables ``ContextParallelParams.for_plan(plan, None,
device, tree=tree).runs`` (``TreeTables``; their time includes ``for_plan``), the floor cuDNN's
causal SDPA over one sequence of the tree's length per visible pair, times the tree's visible
pairs.

Usage: python benchmarks/attention/bench_attention.py [--sizes 20436,131072] [--reps 5]
                                                      [--no-flex] [--model [--model-reps 8]]
                                                      [--out DIR]
       python benchmarks/attention/bench_attention.py --named [--tree] [--cases NAME,...]
                                                      [--no-flex]
       python benchmarks/attention/bench_attention.py --tables-only [--sizes ...] [--reps 20]
                                                      [--named] [--tree]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import time

import torch

_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))  # timing and floor, the shared helpers

from floor import causal_sdpa_calls, tree_visible_pairs  # noqa: E402
from timing import GiB, extra_peak_bytes, samples_ms, time_ms, time_round_robin  # noqa: E402

from megatron.context_parallel import ContextParallelPlan  # noqa: E402
from megatron.context_parallel.attention import cudnn as _attention_cudnn  # noqa: E402
from megatron.context_parallel.attention.blocks import (  # noqa: E402
    AttentionBlocks,
    build_attention_tables,
)
from megatron.context_parallel.attention.fused import fused_attention, stage_backward  # noqa: E402
from megatron.context_parallel.attention.runs import AttentionRuns  # noqa: E402

HEADS, GROUPS, DIM = 40, 8, 128
# (label, AttentionRuns.build keywords, shared keys in the backward) for --variants.
VARIANTS = (
    ("fine", {"shape_buckets": 16}, True),
    ("longest", {"longest_first": True}, True),
    ("fine+longest", {"shape_buckets": 16, "longest_first": True}, True),
    ("copies", {}, False),
)
# Blocked-layout settings, for --block-variants.
# Other groups: larger ones mean fewer backward level calls, and on run plans a group is a range
# of one run, its diagonal a square the backward runs at the floor with the diagonal top-left,
# its bulk an unmasked prefix. Other span budgets: smaller ones bound the diagonal calls' span
# buffers (query, output and their gradients over the span rows) at the cost of more calls.
BLOCK_VARIANTS = (
    ("groups-256", {"layout": "blocks", "group_rows": 256}, True),
    ("groups-1024", {"layout": "blocks", "group_rows": 1024}, True),
    ("groups-4096", {"layout": "blocks", "group_rows": 4096}, True),
    ("span-4096", {"layout": "blocks", "span_budget": 4096}, True),
    ("span-8192", {"layout": "blocks", "span_budget": 8192}, True),
    ("span-16384", {"layout": "blocks", "span_budget": 16384}, True),
    ("span-32768", {"layout": "blocks", "span_budget": 32768}, True),
)
# Kernel settings, for --kernel-variants (each timed and its extra memory measured): the
# backward of causal calls unsplit or split at a lower margin, every causal diagonal
# bottom-right (what the split backward and the top-left alignment replace), and the
# backward's calls not cut into windows or cut at other workspace budgets, and the blocked
# layout's level calls under the whole budget rather than their own.
KERNEL_VARIANTS = (
    ("no-split", {}, {"split_backward": False}),
    ("split-1.05", {}, {"split_margin": 1.05}),
    ("bottom-right", {}, {"square_top_left": False}),
    ("no-windows", {}, {"backward_workspace": None, "level_workspace": None}),
    ("workspace-512MiB", {}, {"backward_workspace": 1 << 29}),
    ("workspace-1GiB", {}, {"backward_workspace": 1 << 30}),
    ("workspace-2GiB", {}, {"backward_workspace": 1 << 31}),
    ("levels-768MiB", {}, {"level_workspace": None}),
)


def kernel_variants(names):
    """The ``KERNEL_VARIANTS`` that ``--kernel-variants`` names (None: none; "all")."""
    if not names:
        return ()
    if names == "all":
        return KERNEL_VARIANTS
    known = {v[0]: v for v in KERNEL_VARIANTS}
    unknown = set(names.split(",")) - set(known)
    if unknown:
        raise SystemExit(f"unknown kernel variants {sorted(unknown)}; known: {sorted(known)}")
    return tuple(known[n] for n in names.split(","))


THD_LENGTHS = (512, 6000, 1200, 3400, 2000, 4100, 700, 2524)  # sums to 20,436


# --- cases -----------------------------------------------------------------------------------


def _uneven(seq_len):
    """The report's shape: rank 0 holds three runs, 42% of the positions (8,659 of 20,436)."""
    cuts = [0, int(0.0979 * seq_len), int(0.2936 * seq_len), int(0.4404 * seq_len)]
    cuts += [int(0.8210 * seq_len), seq_len]
    ranks = [[], []]
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        ranks[i % 2].append(torch.arange(a, b))
    return ContextParallelPlan.from_rank_positions([torch.cat(r) for r in ranks], seq_len)


def _random_share(seq_len, cp, seed=0):
    owner = torch.randint(0, cp, (seq_len,), generator=torch.Generator().manual_seed(seed))
    ranks = [torch.nonzero(owner == r).flatten() for r in range(cp)]
    return ContextParallelPlan.from_rank_positions(ranks, seq_len)


def _thd(scale, cp):
    lengths = [max(8 * cp, int(n * scale) // (2 * cp) * (2 * cp)) for n in THD_LENGTHS]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return ContextParallelPlan.thd(torch.tensor(cu), cp), tuple(cu)


def cases(seq_len):
    """(name, plan, rank, cu_seqlens) of the benchmark at ``seq_len``."""
    if seq_len <= 32768:
        thd, cu = _thd(seq_len / 20436, 2)
        return [
            ("zigzag CP2 r0", ContextParallelPlan.zigzag(seq_len, 2), 0, None),
            ("contiguous CP4 r3", ContextParallelPlan.contiguous(seq_len, 4), 3, None),
            ("uneven 3 runs CP2 r0", _uneven(seq_len), 0, None),
            ("THD 8 seqs CP2 r0", thd, 0, cu),
            ("random half CP2 r0", _random_share(seq_len, 2), 0, None),
        ]
    thd, cu = _thd(seq_len / 20436, 4)
    return [
        ("zigzag CP4 r0", ContextParallelPlan.zigzag(seq_len, 4), 0, None),
        ("zigzag CP8 r0", ContextParallelPlan.zigzag(seq_len, 8), 0, None),
        ("contiguous CP8 r7", ContextParallelPlan.contiguous(seq_len, 8), 7, None),
        ("uneven 3 runs r0", _uneven(seq_len), 0, None),
        ("THD 8 seqs CP4 r0", thd, 0, cu),
        ("random quarter CP4 r0", _random_share(seq_len, 4), 0, None),
    ]


def _sequence(seq_len, cu):
    if cu is None:
        return torch.zeros(seq_len, dtype=torch.int64)
    lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def causal_share(plan, rank, cu):
    """Per sequence ``(length, share)``: the rank's part of that sequence's causal work."""
    cuts = cu if cu is not None else (0, plan.seq_len)
    pos = plan.local_positions(rank)
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        mine = pos[(pos >= a) & (pos < b)] - a + 1
        total = (b - a) * (b - a + 1) / 2
        out.append((b - a, float(mine.sum()) / total if total else 0.0))
    return out


# --- named cases (issue 44) and GRPO trees ---------------------------------------------------
# Plans built independently of the tables' tuning, each at any size (``--sizes``), one rank's rows
# (the heaviest: the most visible query-key pairs), deterministic seeds. Pieces and blocks keep
# source order within a rank.

PACKED_CUTS, PACKED_SEQUENCES, THD_SEQUENCES, SHUFFLED_BLOCK = 11, 13, 13, 64
GRPO_TREES = "4096+8x1024,16384+16x512"  # prompt + completions x length, for --tree


def _dealt(seq_len, bounds, cp):
    """The pieces between ``bounds`` dealt to the ranks in turn (piece i to rank i % cp)."""
    ranks = [[] for _ in range(cp)]
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        ranks[i % cp].append(torch.arange(a, b))
    ranks = [torch.cat(r) if r else torch.zeros(0, dtype=torch.int64) for r in ranks]
    return ContextParallelPlan.from_rank_positions(ranks, seq_len)


def _packed_cut(seq_len, sequences, cp, seed):
    """``sequences`` packed sequences of random lengths (one: no ``cu_seqlens``), cut at
    ``PACKED_CUTS`` random points unrelated to their boundaries, the pieces dealt to ``cp``."""
    rng = random.Random(seed)
    cu = None
    if sequences > 1:
        cu = (0, *sorted(rng.sample(range(1, seq_len), sequences - 1)), seq_len)
    cuts = sorted(rng.sample(range(1, seq_len), PACKED_CUTS))
    return _dealt(seq_len, [0, *cuts, seq_len], cp), cu


def _thd_random(seq_len, sequences, cp, seed):
    """THD (``ContextParallelPlan.thd``) of ``sequences`` random lengths, multiples of 2 cp."""
    unit = 2 * cp
    if seq_len % unit:
        raise ValueError(f"THD at CP {cp} needs S divisible by {unit}, got {seq_len}")
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, seq_len // unit), sequences - 1))
    cu = (0, *(unit * c for c in cuts), seq_len)
    return ContextParallelPlan.thd(torch.tensor(cu), cp), cu


def _block_shuffled(seq_len, block, cp, seed):
    """``block``-row blocks in a random order dealt to ``cp`` in turn (rows sorted per rank)."""
    g = torch.Generator().manual_seed(seed)
    owner = torch.empty(-(-seq_len // block), dtype=torch.int64)
    owner[torch.randperm(owner.numel(), generator=g)] = torch.arange(owner.numel()) % cp
    owner = owner.repeat_interleave(block)[:seq_len]
    ranks = [torch.nonzero(owner == r).flatten() for r in range(cp)]
    return ContextParallelPlan.from_rank_positions(ranks, seq_len), None


# name -> seq_len -> (plan, cu_seqlens or None); selected by --named or --cases (substrings).
NAMED_CASES = {
    "zigzag_cp2": lambda s: (ContextParallelPlan.zigzag(s, 2), None),
    "packed_cut_1seq_cp4": lambda s: _packed_cut(s, 1, 4, seed=4401),
    "packed_cut_13seq_cp4": lambda s: _packed_cut(s, PACKED_SEQUENCES, 4, seed=4402),
    "thd_13seq_cp2": lambda s: _thd_random(s, THD_SEQUENCES, 2, seed=4403),
    "block_shuffled_64_cp4": lambda s: _block_shuffled(s, SHUFFLED_BLOCK, 4, seed=4404),
    "random_rows_cp2": lambda s: (_random_share(s, 2, seed=4405), None),
}


def visible_pairs(plan, rank, cu):
    """Query-key pairs rank ``rank``'s rows see: causal within each packed sequence."""
    pos = plan.local_positions(rank)
    starts = torch.tensor(cu[:-1]) if cu is not None else torch.zeros(1, dtype=torch.int64)
    return int((pos - starts[_sequence(plan.seq_len, cu)[pos]] + 1).sum())


def heaviest_rank(plan, cu):
    """The rank with the most visible query-key pairs (the lowest such rank)."""
    return max(range(plan.cp_size), key=lambda r: (visible_pairs(plan, r, cu), -r))


def named_cases(seq_len, names):
    """(name, plan, rank, cu_seqlens) of the named cases ``names`` at ``seq_len``."""
    out = []
    for key in names:
        plan, cu = NAMED_CASES[key](seq_len)
        rank = heaviest_rank(plan, cu)
        out.append((f"{key} r{rank}", plan, rank, cu))
    return out


def selected_cases(seq_len, wanted=(), named=False, tree=False):
    """The cases at ``seq_len``: those whose name contains one of ``wanted`` (default and named
    cases), every named case with ``named``; with neither (nor ``tree``) the default cases."""
    if wanted:
        chosen = [c for c in cases(seq_len) if any(w in c[0] for w in wanted)]
        keys = [k for k in NAMED_CASES if named or any(w in k for w in wanted)]
    else:
        chosen = [] if named or tree else cases(seq_len)
        keys = list(NAMED_CASES) if named else []
    return chosen + named_cases(seq_len, keys)


def tree_cases(batches=GRPO_TREES):
    """(name, PrefixTree) of GRPO groups ``"P+GxC,..."``: the prompt a root, each of the ``G``
    completions of ``C`` tokens its child."""
    from megatron.context_parallel import PrefixTree

    out = []
    for item in batches.split(","):
        prompt, rest = item.strip().split("+")
        group, completion = (int(x) for x in rest.split("x"))
        tree = PrefixTree([-1] + [0] * group, [int(prompt)] + [completion] * group)
        out.append((f"grpo_{item.strip()} CP1", tree))
    return out


def tree_tables(plan, tree, device):
    """The tree's tables as a micro-batch gets them: ``ContextParallelParams.for_plan(...,
    tree=tree).runs`` (``TreeTables``), copied to ``device``."""
    from megatron.context_parallel.params import ContextParallelParams

    runs = ContextParallelParams.for_plan(plan, None, device=device, tree=tree).runs
    runs.on(device)
    return runs


def tree_share(tree):
    """(seq_len, share): the tree's visible pairs over one causal sequence of ``seq_len``'s."""
    pairs = tree_visible_pairs(tree)
    return tree.seq_len, pairs / (tree.seq_len * (tree.seq_len + 1) / 2)


# GPU milliseconds each timed call of the floor and of ours starts behind (--lead-ms): the host
# queues the call's launches while the GPU spins, as a training step's host runs ahead of the
# layers before, so the times are the GPU's alone (0: the host's launch gaps count too).
LEAD_MS = [0.0]


# --- memory ----------------------------------------------------------------------------------


def extra_peak(fn, kept_bytes):
    """GiB allocated at the peak of ``fn()`` beyond what existed before and ``kept_bytes``."""
    return extra_peak_bytes(fn, torch.device("cuda", torch.cuda.current_device()), kept_bytes) / GiB


# --- the methods -----------------------------------------------------------------------------


def _sdpa_times(n, reps, device):
    """(fwd ms, fwd+bwd ms, extra GiB fwd+bwd) of cuDNN causal SDPA over one sequence of ``n``
    tokens."""
    fwd, both, grads, kept = causal_sdpa_calls(n, HEADS, GROUPS, DIM, torch.bfloat16, device)
    t = time_round_robin({"fwd": fwd, "both": both}, device, reps, 1, lead_ms=LEAD_MS[0])
    # The floor's own extra memory, counted as ours is: beyond its inputs, output and gradients.
    return t["fwd"], t["both"], extra_peak(grads, kept)


def sdpa_floor(lengths, reps, device):
    """{length: (fwd ms, fwd+bwd ms, extra GiB fwd+bwd)} of cuDNN causal SDPA over one sequence
    of each length (its extra memory as ``extra_peak`` counts ours)."""
    return {n: _sdpa_times(n, reps, device) for n in sorted(set(lengths))}


def staged_ahead(make, backward: bool = False):
    """``(stage, ahead)``: ``stage()`` builds fresh tables ``make()`` and stages them (``stage``,
    as ``ContextParallelParams.prepare`` does in a data-loader thread; with ``backward`` also
    the backward's parts and windows for these heads and head dim, as ``prepare(heads=,
    head_dim=)`` does), ``ahead["tables"]`` the latest; pass ``stage`` as a timing ``before`` so
    that each timed call finds a prepared batch. Called once here, so ``ahead`` holds tables
    from the start."""
    ahead = {}

    def stage():
        ahead["tables"] = make()
        ahead["tables"].stage()
        if backward:
            stage_backward(ahead["tables"], HEADS, DIM)

    stage()
    return stage, ahead


def staged_on_ms(make, device, reps: int) -> float:
    """Median ms of ``on(device)`` (synchronised) of tables ``make()`` built and staged ahead,
    untimed: what a prepared batch's tables leave the step, their copy to the device."""
    stage, ahead = staged_ahead(make)
    ahead["tables"].on(device)  # warm-up (time_ms's own would skip ``before``)
    return time_ms(lambda: ahead["tables"].on(device), device, reps, 0, clock="host", before=stage)


class Case:
    """Inputs of one rank's rows: query [n, H, d], K/V slots [cp * max_count, G, 2d]."""

    def __init__(self, plan, rank, cu, device, layout="auto", **build):
        self.plan, self.rank, self.cu = plan, rank, cu
        g = torch.Generator(device=device).manual_seed(plan.seq_len + rank)
        n = plan.counts[rank]
        self.positions = plan.local_positions(rank).to(device)
        self.query = torch.randn(n, HEADS, DIM, device=device, generator=g).bfloat16()
        kv_full = torch.randn(plan.seq_len, GROUPS, 2 * DIM, device=device, generator=g)
        kv_full = kv_full.bfloat16()
        slots = plan.slot_positions(device)
        self.kv_full = kv_full
        self.kv_slots = kv_full[slots.clamp(min=0)] * (slots >= 0)[:, None, None]
        self.grad = torch.randn(n, HEADS, DIM, device=device, generator=g).bfloat16()
        self.sequence = _sequence(plan.seq_len, cu)

        # Timed on a warm process (the first build of a process pays torch's warm-up), as a
        # training loop builds them: once per micro-batch, before its first layer. The median
        # of five: one build is at the mercy of the host (a lone second build read 2-17 ms for
        # the same zigzag tables on an H100 machine's host).
        def tables():
            if layout == "auto" and not build:
                self.runs = build_attention_tables(plan, rank, self.sequence)
            elif layout == "blocks":
                self.runs = AttentionBlocks.build(plan, rank, self.sequence, **build)
            else:
                self.runs = AttentionRuns.build(plan, rank, self.sequence, **build)
            self.runs.on(device)

        self.build_ms = time_ms(tables, device, 5, 1, clock="host")
        self.step_ms = None
        if layout == "auto" and not build:
            self.step_ms = staged_on_ms(
                lambda: build_attention_tables(plan, rank, self.sequence), device, 5
            )

    def ours(self, backward, shared=True, kernel=None):
        """``fused_attention`` of the case on ``kernel`` (default: cuDNN with
        ``shared_keys_in_backward=shared``; the library's default reads shared key ranges, the
        "copies" variant turns it off)."""
        if kernel is None:
            # ``shared``: the shared-keys flag, or CudnnOptions fields (the kernel variants).
            fields = shared if isinstance(shared, dict) else {"shared_keys_in_backward": shared}
            kernel = _attention_cudnn.CudnnKernel(_attention_cudnn.CudnnOptions(**fields))
        q = self.query.detach().requires_grad_(backward)
        kv = self.kv_slots.detach().requires_grad_(backward)
        out = fused_attention(q, kv, self.runs, DIM**-0.5, kernel=kernel)
        if backward:
            out.backward(self.grad)
            return out, q.grad, kv.grad
        return out

    def dense_rows(self, rows):
        """fp32 dense attention (today's path) of local rows ``rows`` (a slice)."""
        pos = self.positions[rows]
        q = self.query[rows].float()
        k = self.kv_full[..., :DIM].float().repeat_interleave(HEADS // GROUPS, dim=1)
        v = self.kv_full[..., DIM:].float().repeat_interleave(HEADS // GROUPS, dim=1)
        seq = self.sequence.to(q.device)
        keys = torch.arange(self.plan.seq_len, device=q.device)
        allowed = (seq[None, :] == seq[pos][:, None]) & (keys[None, :] <= pos[:, None])
        scores = torch.einsum("nhd,shd->hns", q, k) * DIM**-0.5
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v)

    def dense_forward(self):
        """Today's dense path: fp32 scores of every local row against every slot."""
        n = self.query.shape[0]
        slots = self.plan.slot_positions(self.query.device)
        seq = self.sequence.to(self.query.device)
        allowed = (slots[None, :] >= 0) & (slots[None, :] <= self.positions[:, None])
        allowed &= seq[slots.clamp(min=0)][None, :] == seq[self.positions][:, None]
        k = self.kv_slots[..., :DIM].repeat_interleave(HEADS // GROUPS, dim=1)
        v = self.kv_slots[..., DIM:].repeat_interleave(HEADS // GROUPS, dim=1)
        scores = torch.einsum("nhd,shd->hns", self.query, k).float() * DIM**-0.5
        scores = scores.masked_fill(~allowed[None], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).bfloat16()
        return torch.einsum("hns,shd->nhd", probs, v).reshape(n, HEADS * DIM)

    def flex(self):
        """(fwd, fwd+bwd) callables of FlexAttention with a block mask from the plan."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        device = self.query.device
        order = torch.argsort(self.positions)
        pos = self.positions[order]
        seq = self.sequence.to(device)
        q = self.query[order].transpose(0, 1)[None].contiguous()  # [1, H, n, d]
        kv = self.kv_full.transpose(0, 1)[None]
        k, v = kv[..., :DIM].contiguous(), kv[..., DIM:].contiguous()
        q_pos, q_seq = pos, seq[pos]

        def mask(b, h, qi, ki):
            return (seq[ki] == q_seq[qi]) & (ki <= q_pos[qi])

        block = create_block_mask(mask, None, None, q.shape[2], k.shape[2], device=device)
        compiled = torch.compile(flex_attention, dynamic=False)
        do = torch.randn_like(q)

        def fwd(qq=q, kk=k, vv=v):
            return compiled(qq, kk, vv, block_mask=block, enable_gqa=True)

        def both():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            fwd(qq, kk, vv).backward(do)

        return fwd, both


class TreeCase(Case):
    """A ``PrefixTree`` batch at CP 1 (every row, all keys): the tables are ``tree_tables``
    (``TreeTables``), the masks the tree's (``PrefixTree.visible``)."""

    def __init__(self, tree, device):
        super().__init__(ContextParallelPlan.contiguous(tree.seq_len, 1), 0, None, device)
        self.tree = tree

        def tables():
            self.runs = tree_tables(self.plan, tree, device)

        self.build_ms = time_ms(tables, device, 5, 1, clock="host")

    def _attend(self, q, k, v, allowed):
        """fp32 ``[n, H, d]`` of queries ``q`` over keys ``k`` / values ``v`` (``[S, H, d]``)."""
        scores = torch.einsum("nhd,shd->hns", q.float(), k.float()) * DIM**-0.5
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v.float())

    def dense_rows(self, rows):
        pos = self.positions[rows]
        k = self.kv_full[..., :DIM].repeat_interleave(HEADS // GROUPS, dim=1)
        v = self.kv_full[..., DIM:].repeat_interleave(HEADS // GROUPS, dim=1)
        keys = torch.arange(self.plan.seq_len, device=pos.device)
        return self._attend(self.query[rows], k, v, self.tree.visible(pos, keys))

    def dense_forward(self):
        slots = self.plan.slot_positions(self.query.device)
        k = self.kv_slots[..., :DIM].repeat_interleave(HEADS // GROUPS, dim=1)
        v = self.kv_slots[..., DIM:].repeat_interleave(HEADS // GROUPS, dim=1)
        allowed = self.tree.visible(self.positions, slots)
        scores = torch.einsum("nhd,shd->hns", self.query, k).float() * DIM**-0.5
        scores = scores.masked_fill(~allowed[None], torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).bfloat16()
        return torch.einsum("hns,shd->nhd", probs, v).reshape(-1, HEADS * DIM)

    def flex(self):
        """(fwd, fwd+bwd) of FlexAttention, its block mask read from the tree's dense mask."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        device = self.query.device
        n = self.plan.seq_len
        positions = torch.arange(n, device=device)
        visible = self.tree.visible(positions, positions)  # [S, S] bool; rows are positions
        q = self.query.transpose(0, 1)[None].contiguous()
        kv = self.kv_full.transpose(0, 1)[None]
        k, v = kv[..., :DIM].contiguous(), kv[..., DIM:].contiguous()

        def mask(b, h, qi, ki):
            return visible[qi, ki]

        block = create_block_mask(mask, None, None, n, n, device=device)
        compiled = torch.compile(flex_attention, dynamic=False)
        do = torch.randn_like(q)

        def fwd(qq=q, kk=k, vv=v):
            return compiled(qq, kk, vv, block_mask=block, enable_gqa=True)

        def both():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            fwd(qq, kk, vv).backward(do)

        return fwd, both


def bench_case(
    name, plan, rank, cu, floor, reps, device, with_flex, with_dense, variants=(),
    compare_layouts=False, case=None, shares=None,
):  # fmt: skip
    """One row of the table; ``case`` / ``shares`` (per floor length, the share of its causal
    work) default to the plan's ``Case`` and ``causal_share``."""
    # Each case sizes its backward graphs' workspace for itself, not for an earlier case's
    # largest batch (a process keeps the largest it has seen; see cudnn._LARGEST_TOTALS).
    _attention_cudnn.reset_graphs()
    case = Case(plan, rank, cu, device) if case is None else case
    shares = causal_share(plan, rank, cu) if shares is None else shares
    floor_f = sum(floor[n][0] * s for n, s in shares)
    floor_b = sum(floor[n][1] * s for n, s in shares)
    fns = {"ours fwd": lambda: case.ours(False), "ours fwd+bwd": lambda: case.ours(True)}
    n = case.query.shape[0]
    row_bytes = HEADS * DIM * 2
    kept_f = n * row_bytes
    kept_b = 2 * n * row_bytes + case.kv_slots.numel() * 2
    # The case's memory first, warm: a variant's larger batch would raise the row totals that
    # later backward graphs are sized for (cudnn._LARGEST_TOTALS), and so their workspace.
    case.ours(True)
    mem_f = extra_peak(lambda: case.ours(False), kept_f)
    mem_b = extra_peak(lambda: case.ours(True), kept_b)
    if with_flex:
        try:
            flex_f, flex_b = case.flex()
            fns["flex fwd"], fns["flex fwd+bwd"] = flex_f, flex_b
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"  flex skipped: {type(exc).__name__}: {str(exc)[:200]}")
    if compare_layouts:
        # The layout the choice did not take, timed beside it.
        other = "runs" if isinstance(case.runs, AttentionBlocks) else "blocks"
        variants = tuple(variants) + ((other, {"layout": other}, True),)
    out_of_memory, variant_memory = set(), {}
    for label, build, shared in variants:
        try:
            other = Case(plan, rank, cu, device, **build)
            other.ours(True, shared)  # a layout that cannot fit is a result, not an abort
        except torch.OutOfMemoryError:
            out_of_memory.add(label)
            other = None
            torch.cuda.empty_cache()
            continue
        fns[f"{label} fwd"] = lambda c=other, sh=shared: c.ours(False, sh)
        fns[f"{label} fwd+bwd"] = lambda c=other, sh=shared: c.ours(True, sh)
        # A variant's memory on graphs of its own (the workspace follows the row totals its
        # graphs were built for; see cudnn._LARGEST_TOTALS).
        _attention_cudnn.reset_graphs()
        try:
            other.ours(True, shared)
            variant_memory[label] = extra_peak(lambda c=other, sh=shared: c.ours(True, sh), kept_b)
        except torch.OutOfMemoryError:
            variant_memory[label] = "OOM"
            torch.cuda.empty_cache()
    t = time_round_robin(fns, device, reps, 1, lead_ms=LEAD_MS[0])
    rows = slice(max(0, n - 256), n)
    with torch.no_grad():
        got = case.ours(False)[rows].float()
    err = (got - case.dense_rows(rows)).abs().max().item()
    row = {
        "case": name,
        "S": plan.seq_len,
        "rows": n,
        "tables": case.runs.describe(),
        "floor fwd ms": floor_f,
        "floor fwd+bwd ms": floor_b,
        "ours fwd ms": t["ours fwd"],
        "ours fwd+bwd ms": t["ours fwd+bwd"],
        "ours fwd x": t["ours fwd"] / floor_f,
        "ours fwd+bwd x": t["ours fwd+bwd"] / floor_b,
        "extra GiB fwd": mem_f,
        "extra GiB fwd+bwd": mem_b,
        # The whole-sequence floor's (each sequence's, THD: the largest): its backward's own
        # workspace, what cuDNN needs beyond Q/K/V/O and their gradients.
        "floor extra GiB fwd+bwd": max(floor[m][2] for m, _ in shares),
        "max err vs fp32": err,
        "tables ms": case.build_ms,
        "tables % of fwd+bwd": 100 * case.build_ms / t["ours fwd+bwd"],
        "staged tables ms": case.step_ms,
        "staged % of fwd+bwd": (
            None if case.step_ms is None else (100 * case.step_ms / t["ours fwd+bwd"])
        ),
    }
    for label, *_ in variants:
        if label in out_of_memory:
            row[f"{label} fwd x"] = row[f"{label} fwd+bwd x"] = "OOM"
            continue
        row[f"{label} fwd x"] = t[f"{label} fwd"] / floor_f
        row[f"{label} fwd+bwd x"] = t[f"{label} fwd+bwd"] / floor_b
        if label in variant_memory:
            row[f"{label} extra GiB"] = variant_memory[label]
    if "flex fwd" in t:
        row["flex fwd x"] = t["flex fwd"] / floor_f
        row["flex fwd+bwd x"] = t["flex fwd+bwd"] / floor_b
    if with_dense:
        try:
            row["dense fwd x"] = time_ms(case.dense_forward, device, 1, 0) / floor_f
            row["dense extra GiB"] = extra_peak(case.dense_forward, kept_f)
        except torch.OutOfMemoryError:
            row["dense fwd x"] = "OOM"
        torch.cuda.empty_cache()
    return row


def _random_uneven_plan(seq_len, rng):
    cuts = sorted(rng.sample(range(1, seq_len), rng.randint(2, 7)))
    bounds = [0] + cuts + [seq_len]
    ranks = [[], []]
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        ranks[(i + rng.randint(0, 1)) % 2].append(torch.arange(a, b))
    ranks = [torch.cat(r) if r else torch.zeros(0, dtype=torch.int64) for r in ranks]
    return ContextParallelPlan.from_rank_positions(ranks, seq_len)


def graph_builds_over_random_plans(seq_len, device, batches=20, seed=1):
    """cuDNN graph builds over ``batches`` random uneven plans, then over ``batches`` more (new
    random plans): the second count shows the buckets filling up. Also the worst table build."""
    rng = random.Random(seed)
    counts, worst = [], 0.0
    start = time.perf_counter()
    for _ in range(2):
        before = _attention_cudnn.graph_builds()
        for _ in range(batches):
            plan = _random_uneven_plan(seq_len, rng)
            case = Case(plan, 0 if plan.counts[0] else 1, None, device)
            worst = max(worst, case.build_ms)
            case.ours(True)
        counts.append(_attention_cudnn.graph_builds() - before)
    torch.cuda.synchronize()
    return {
        "batches": batches,
        "graph builds, first batches": counts[0],
        "graph builds, next batches": counts[1],
        "worst tables ms": worst,
        "seconds": time.perf_counter() - start,
    }


def profile_case(plan, rank, cu, device, path, layout="auto", case=None):
    """Kernel times of one forward+backward (torch.profiler), the top rows printed and saved,
    with the call's wall time and the GPU's busy time (host-bound when they differ); ``case``
    a prebuilt ``Case`` (a tree's) instead of one from the plan."""
    from torch.profiler import ProfilerActivity, profile

    case = Case(plan, rank, cu, device, layout=layout) if case is None else case
    for _ in range(2):
        case.ours(True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (wall,) = samples_ms(lambda: case.ours(True), device, 1, 0, clock="host")
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e3
    table = events.table(sort_by="self_cuda_time_total", row_limit=24, max_name_column_width=60)
    head = f"{case.runs.describe()}: wall {wall:.2f} ms (profiled), GPU busy {gpu:.2f} ms\n"
    with open(path, "w") as f:
        f.write(head + table)
    print(head + table)


def model_row(device, reps):
    """4 layers of a 27B-shaped dense GPTModel at CP 1 on the uneven plan's rank-0 rows."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.context_parallel import get_gpt_layer_with_context_parallel_spec
    from megatron.context_parallel.models.forward import context_parallel_forward

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    ps.initialize_model_parallel()
    mrandom.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=4,
        hidden_size=5120,
        ffn_hidden_size=17408,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
    )
    model = GPTModel(
        config,
        get_gpt_layer_with_context_parallel_spec(normalization="RMSNorm"),
        vocab_size=151936,
        max_sequence_length=32768,
        position_embedding_type="rope",
    ).to(device)
    seq_len = 20436
    full = _uneven(seq_len)
    rows = full.local_positions(0)
    rows = rows[torch.randperm(rows.numel(), generator=torch.Generator().manual_seed(0))]
    plan = ContextParallelPlan.from_rank_positions([rows], seq_len)
    ids = torch.randint(0, 151936, (seq_len,), device=device)
    labels = torch.randint(0, 151936, (seq_len,), device=device)

    def step():
        out = context_parallel_forward(
            model, ids, labels, plan=plan, fields="target_logprobs", cp_group=None
        )
        out.target_logprobs.sum().backward()

    import megatron.context_parallel.params as attention

    fresh = attention.build_attention_tables
    kept = {}

    def reused(plan, rank, sequence, padding_rows=0):
        # The same tables object every step: what a step costs without building them.
        key = (id(plan), rank)
        if key not in kept:
            kept[key] = fresh(plan, rank, sequence, padding_rows=padding_rows)
        return kept[key]

    def step_reusing_tables():
        attention.build_attention_tables = reused
        try:
            step()
        finally:
            attention.build_attention_tables = fresh

    # The tables' exposed cost: a step building them against one reusing them, per round (both
    # in every round, in turns), so that the step's drift between rounds cancels.
    times, ratios = time_round_robin(
        {"model": step, "model, tables reused": step_reusing_tables},
        device,
        reps,
        1,
        unit="model, tables reused",
    )
    model_ms = times["model"]
    exposed_ms = (ratios["model"] - 1) * times["model, tables reused"]
    case = Case(plan, 0, None, device)
    attn_ms = time_round_robin({"attn": lambda: case.ours(True)}, device, reps, 1)["attn"]
    return {
        "model fwd+bwd ms": model_ms,
        "model fwd+bwd ms, tables reused": times["model, tables reused"],
        "tables ms (host, per micro-batch)": case.build_ms,
        "tables exposed ms (step building them / step reusing them - 1, median over rounds)": (
            exposed_ms
        ),
        "rounds": reps,
        "attention fwd+bwd ms (one layer)": attn_ms,
        "attention share": 4 * attn_ms / model_ms,
        "tables exposed / one layer's attention fwd+bwd": exposed_ms / attn_ms,
        "rows": int(rows.numel()),
    }


def tables_only(sizes, reps, device, select=cases, trees=()):
    """Per case (``select(seq_len)``, then the ``(name, PrefixTree)`` of ``trees`` at CP 1): ms
    to build this rank's tables and copy them to ``device`` (best of ``reps`` rounds, the two
    builders in turns), C++ and torch ops, and (plans only) the copy alone of C++ tables built
    and staged ahead (``stage``, as ``ContextParallelParams.prepare`` does); Markdown rows."""
    from megatron.context_parallel import _extension

    native_ops = _extension.host_tables()
    if native_ops is None:
        raise SystemExit("the C++ table builders are not built (pip install -e . builds them)")

    def build(make, native):
        _extension.host_tables = (lambda: native_ops) if native else (lambda: None)
        built = []

        def call():
            built[:] = [make()]
            built[0].on(device)

        try:
            (ms,) = samples_ms(call, device, 1, 0, clock="host")
            return ms, built[0]
        finally:
            _extension.host_tables = loader

    def staged_on(make):
        _extension.host_tables = lambda: native_ops
        try:
            return staged_on_ms(make, device, 1)
        finally:
            _extension.host_tables = loader

    loader = _extension.host_tables
    lines = [
        "| case | S | layout | C++ ms | torch ops ms | torch ops / C++ | C++ staged ahead: on ms |",
        "|---|---|---|---|---|---|---|",
    ]

    def makers():
        for seq_len in sizes:
            for name, plan, rank, cu in select(seq_len):
                sequence = _sequence(plan.seq_len, cu)
                yield name, seq_len, lambda p=plan, r=rank, s=sequence: build_attention_tables(
                    p, r, s
                ), False
        for name, tree in trees:
            plan = ContextParallelPlan.contiguous(tree.seq_len, 1)
            yield name, tree.seq_len, lambda p=plan, t=tree: tree_tables(p, t, device), True

    for name, seq_len, make, is_tree in makers():
        best = {True: float("inf"), False: float("inf"), "staged": float("inf")}
        for _ in range(reps + 2):  # two warm-up rounds
            for native in (True, False):
                ms, tables = build(make, native)
                best[native] = min(best[native], ms)
            if not is_tree:  # a tree's maker copies its tables already
                best["staged"] = min(best["staged"], staged_on(make))
        layout = type(tables).__name__.replace("Attention", "").lower()
        staged = "-" if is_tree else f"{best['staged']:.3f}"
        lines.append(
            f"| {name} | {seq_len} | {layout} | {best[True]:.3f} | {best[False]:.2f} | "
            f"{best[False] / best[True]:.1f} | {staged} |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines)


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20436,131072")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--lead-ms",
        type=float,
        default=0.0,
        help="time the floor and ours behind this much GPU spinning (the GPU's time alone)",
    )
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--flex-long", action="store_true", help="FlexAttention at S > 32k too")
    parser.add_argument("--model", action="store_true")
    parser.add_argument(
        "--model-reps", type=int, default=8, help="rounds of the GPTModel row (both steps each)"
    )
    parser.add_argument("--profile", action="store_true", help="kernel tables of the cases")
    parser.add_argument("--profile-cases", type=int, default=2, help="how many cases to profile")
    parser.add_argument("--profile-layout", default="blocks", help="also profile this layout")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="also time other table settings: exact shapes, longest entries first, shared keys",
    )
    parser.add_argument(
        "--compare-layouts",
        action="store_true",
        help="also time the table layout (runs / blocks) that the choice did not take",
    )
    parser.add_argument(
        "--cases",
        default="",
        help="only cases whose name contains one of these (default and named cases), e.g. "
        "packed_cut,block_shuffled_64",
    )
    parser.add_argument(
        "--named", action="store_true", help=f"every named case: {', '.join(NAMED_CASES)}"
    )
    parser.add_argument(
        "--tree", action="store_true", help="the GRPO tree cases at CP 1 (TreeTables)"
    )
    parser.add_argument("--tree-batches", default=GRPO_TREES, help="the trees, 'P+GxC,...'")
    parser.add_argument("--block-variants", action="store_true", help="other blocked settings")
    parser.add_argument(
        "--kernel-variants",
        nargs="?",
        const="all",
        help="the cuDNN kernel's split, alignment and backward windows changed: all, or some of "
        + ", ".join(v[0] for v in KERNEL_VARIANTS),
    )
    parser.add_argument("--no-graph-builds", action="store_true")
    parser.add_argument("--tables-only", action="store_true", help="only the per-batch tables")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    LEAD_MS[0] = args.lead_ms
    wanted = [c for c in args.cases.split(",") if c]
    trees = tree_cases(args.tree_batches) if args.tree else []

    def select(seq_len):
        return selected_cases(seq_len, wanted, args.named, args.tree)

    if args.tables_only:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"tables on {device} (host: {os.cpu_count()} cores, torch {torch.__version__})")
        sizes = [int(s) for s in args.sizes.split(",")]
        print(tables_only(sizes, args.reps, device, select, trees))
        return
    device = torch.device("cuda")
    results = {"rows": [], "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for seq_len in (int(s) for s in args.sizes.split(",")):
        plans = select(seq_len)
        if not plans:
            continue
        lengths = [n for _, p, r, cu in plans for n, _ in causal_share(p, r, cu)]
        floor = sdpa_floor(lengths, args.reps, device)
        results[f"floor {seq_len}"] = {str(k): v for k, v in floor.items()}
        for name, plan, rank, cu in plans:
            long = seq_len > 32768
            row = bench_case(
                name,
                plan,
                rank,
                cu,
                floor,
                args.reps if not long else max(2, args.reps // 2),
                device,
                with_flex=not args.no_flex and (not long or args.flex_long),
                with_dense=not long,
                variants=(VARIANTS if args.variants else ())
                + (BLOCK_VARIANTS if args.block_variants else ())
                + kernel_variants(args.kernel_variants),
                compare_layouts=args.compare_layouts,
            )
            results["rows"].append(row)
            print(json.dumps({k: _fmt(v) for k, v in row.items()}), flush=True)
    for name, tree in trees:
        # The floor of a tree: cuDNN causal SDPA over one sequence of S, per visible pair.
        case = TreeCase(tree, device)
        floor = sdpa_floor([tree.seq_len], args.reps, device)
        results[f"floor {name}"] = {str(k): v for k, v in floor.items()}
        row = bench_case(
            name,
            case.plan,
            0,
            None,
            floor,
            args.reps,
            device,
            with_flex=not args.no_flex,
            with_dense=tree.seq_len <= 32768,
            case=case,
            shares=[tree_share(tree)],
        )
        results["rows"].append(row)
        print(json.dumps({k: _fmt(v) for k, v in row.items()}), flush=True)
    results["workspace bytes"] = _attention_cudnn.workspace_bytes()
    if args.profile:
        # The profiled cases: the selected ones (named cases included) at the first size.
        chosen = select(int(args.sizes.split(",")[0]))
        for i, (name, plan, rank, cu) in enumerate(chosen[: args.profile_cases]):
            for layout in dict.fromkeys(("auto", args.profile_layout)):
                print("== profile:", name, layout)
                out = os.path.join(args.out, f"profile_{i}_{layout}.txt")
                profile_case(plan, rank, cu, device, out, layout)
        for i, (name, tree) in enumerate(trees):
            print("== profile:", name)
            case = TreeCase(tree, device)
            profile_case(
                None, 0, None, device, os.path.join(args.out, f"profile_tree_{i}.txt"), case=case
            )
    if not args.no_graph_builds:
        results["graph builds"] = graph_builds_over_random_plans(20436, device)
        print(json.dumps(results["graph builds"]), flush=True)
    if args.model:
        results["model"] = model_row(device, args.model_reps)
        print(json.dumps(results["model"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    cols = ["case", "S", "rows", "ours fwd x", "ours fwd+bwd x", "flex fwd x", "flex fwd+bwd x"]
    cols += ["dense fwd x", "extra GiB fwd", "extra GiB fwd+bwd", "floor extra GiB fwd+bwd"]
    cols += ["max err vs fp32", "tables ms"]
    cols += ["tables % of fwd+bwd", "staged tables ms", "staged % of fwd+bwd"]
    if args.compare_layouts:
        cols += ["tables", "runs fwd x", "runs fwd+bwd x", "blocks fwd x", "blocks fwd+bwd x"]
    if args.block_variants:
        cols += [f"{v[0]} {m}" for v in BLOCK_VARIANTS for m in ("fwd+bwd x", "extra GiB")]
    if args.kernel_variants:
        chosen = kernel_variants(args.kernel_variants)
        cols += [f"{v[0]} {m}" for v in chosen for m in ("fwd+bwd x", "extra GiB")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in results["rows"]:
        lines.append("| " + " | ".join(_fmt(row.get(c, "-")) for c in cols) + " |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench_attention.md"), "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
