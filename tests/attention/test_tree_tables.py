"""The tree tables on CPU: the fused path under a ``PrefixTree`` equals an oracle from positions.

``ReferenceKernel`` computes each entry as the cuDNN kernel does (bottom-right causal or
unmasked blocks, backward against the given output and log-sum-exp), so these tests check
everything of the tree path but cuDNN itself: the own-segment run tables, the ancestor level
calls, the log-sum-exp merge and the gradient sums, for random trees and random plans (empty
ranks, shuffled rows, positions nobody owns). The oracle knows only positions: a local row sees
every owned key ``tree.visible`` allows it.
"""

from __future__ import annotations

import pytest
import torch
from _attention_ref import (
    REFERENCE_KERNELS,
    FreedBuffersReferenceKernel,
    FreedBuffersWindowedReferenceKernel,
    ReferenceKernel,
    backward_keeping,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.context_parallel import ContextParallelPlan, PrefixTree, tree_plan
from megatron.context_parallel.attention.fused import fused_attention
from megatron.context_parallel.attention.tree_tables import TreeTables


def _random_tree(g: torch.Generator, segments: int, max_len: int) -> PrefixTree:
    parents = [-1]
    for i in range(1, segments):
        root = bool(torch.rand(1, generator=g) < 0.2)
        parents.append(-1 if root else int(torch.randint(0, i, (1,), generator=g)))
    lengths = torch.randint(1, max_len + 1, (segments,), generator=g).tolist()
    return PrefixTree(parents=parents, lengths=lengths)


def _random_plan(g, seq_len: int, cp: int, unowned: bool, empty: bool) -> ContextParallelPlan:
    order = torch.randperm(seq_len, generator=g)
    if unowned:
        order = order[: max(1, seq_len - seq_len // 6)]
    cuts = sorted(torch.randint(0, order.numel() + 1, (cp - 1 - int(empty),), generator=g).tolist())
    bounds = [0] + cuts + [order.numel()]
    shards = [order[a:b].sort().values for a, b in zip(bounds[:-1], bounds[1:])]
    if empty:
        shards.insert(int(torch.randint(0, cp, (1,), generator=g)), order[:0])
    return ContextParallelPlan.from_rank_positions(shards, seq_len)


def _slots(full: torch.Tensor, plan: ContextParallelPlan) -> torch.Tensor:
    out = full.new_zeros((plan.cp_size * plan.max_count, *full.shape[1:]))
    slot = plan.slot_positions("cpu")
    out[slot >= 0] = full[slot[slot >= 0]]
    return out


def _oracle(query, kv, positions, tree, owned, scale, dim):
    heads, groups = query.shape[1], kv.shape[1]
    k = kv[..., :dim].repeat_interleave(heads // groups, dim=1)
    v = kv[..., dim:].repeat_interleave(heads // groups, dim=1)
    keys = torch.arange(kv.shape[0])
    allowed = tree.visible(positions, keys) & owned[None, :]
    scores = torch.einsum("nhd,shd->hns", query, k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v)


def _check(tree, plan, rank, heads=4, groups=2, dim=8, seed=0, kernel=ReferenceKernel):
    g = torch.Generator().manual_seed(seed)
    seq_len, scale = tree.seq_len, dim**-0.5
    q_full = torch.randn(seq_len, heads, dim, generator=g, dtype=torch.float64)
    kv_full = torch.randn(seq_len, groups, 2 * dim, generator=g, dtype=torch.float64)
    weight = torch.randn(seq_len, heads, dim, generator=g, dtype=torch.float64)
    pos = plan.local_positions(rank)
    padding = 1 if pos.numel() == 0 else 0
    tables = TreeTables.build(plan, rank, tree, padding_rows=padding)

    query = q_full[pos]
    w = weight[pos]
    if padding:
        query = torch.cat([query, torch.randn(1, heads, dim, generator=g, dtype=query.dtype)])
        w = torch.cat([w, torch.ones(1, heads, dim, dtype=w.dtype)])
    query = query.clone().requires_grad_()
    kv_slots = _slots(kv_full, plan).requires_grad_()
    out = fused_attention(query, kv_slots, tables, scale, kernel=kernel)
    (out * w).sum().backward()

    q_ref = q_full[pos].clone().requires_grad_()
    kv_ref = kv_full.clone().requires_grad_()
    expected = _oracle(q_ref, kv_ref, pos, tree, plan.owned_mask(), scale, dim)
    (expected * weight[pos]).sum().backward()

    n = pos.numel()
    torch.testing.assert_close(out[:n], expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(query.grad[:n], q_ref.grad, rtol=1e-10, atol=1e-10)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    torch.testing.assert_close(kv_slots.grad, _slots(kv_ref.grad, plan), rtol=1e-10, atol=1e-10)
    return tables


GRPO = PrefixTree(parents=(-1, 0, 0, 0, 0), lengths=(40, 9, 12, 1, 7))
DEEP = PrefixTree(parents=(-1, 0, 1, 1, 0, -1, -1, 6, 6, 2), lengths=(5, 3, 4, 1, 2, 6, 4, 1, 3, 2))


@pytest.mark.parametrize("tree", [GRPO, DEEP], ids=["grpo", "deep"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_named_trees_under_tree_plan_and_contiguous(tree, cp):
    for plan in (tree_plan(tree, cp, block=4), ContextParallelPlan.contiguous(tree.seq_len, cp)):
        for rank in range(cp):
            _check(tree, plan, rank, seed=cp * 10 + rank)


@pytest.mark.parametrize("seed", range(12))
def test_random_trees_and_plans(seed):
    g = torch.Generator().manual_seed(seed)
    tree = _random_tree(g, segments=int(torch.randint(1, 12, (1,), generator=g)), max_len=9)
    cp = int(torch.randint(1, 5, (1,), generator=g))
    plan = _random_plan(g, tree.seq_len, cp, unowned=seed % 3 == 0, empty=cp > 1 and seed % 2 == 0)
    kernel = REFERENCE_KERNELS[seed % len(REFERENCE_KERNELS)]
    for rank in range(cp):
        _check(tree, plan, rank, seed=seed, kernel=kernel, heads=4, groups=1 + seed % 2 * 3)


def test_levels_of_a_prompt_with_completions():
    """One ancestor call for a one-level tree, one entry per prompt; depth-3 trees take more."""
    plan = ContextParallelPlan.contiguous(GRPO.seq_len, 1)
    tables = TreeTables.build(plan, 0, GRPO)
    assert len(tables.levels) == 1 and tables.levels[0].entries == 1
    assert tables.levels[0].causal is False
    assert int(tables.levels[0].kv_len[0]) == 40 and int(tables.levels[0].q_len[0]) == 29
    deep = TreeTables.build(ContextParallelPlan.contiguous(DEEP.seq_len, 1), 0, DEEP)
    assert len(deep.levels) == 3
    assert "ancestor levels" in deep.describe()


def test_flat_forest_needs_no_ancestor_call():
    forest = PrefixTree(parents=(-1, -1, -1), lengths=(5, 7, 3))
    tables = _check(forest, ContextParallelPlan.contiguous(forest.seq_len, 2), 1)
    assert tables.levels == []


def test_a_segment_split_into_several_entries_sums_its_key_copies():
    """Segments long enough that a rank's runs of one segment stay separate entries (gaps over
    the merge gap): the own part copies their keys per entry and the backward adds each copy
    into its key once, in rounds without a repeated key (the GPU's sum has no atomics)."""
    tree = PrefixTree(parents=(-1,) + (0,) * 8, lengths=(700, 90, 130, 1, 77, 256, 64, 3, 40))
    plan = tree_plan(tree, 2)
    materialized = 0
    for rank in range(2):
        tables = _check(tree, plan, rank, heads=2, groups=1, dim=4, seed=rank)
        materialized += tables.own.materialize
        rounds = tables.on("cpu").own_rounds
        assert sum(dst.numel() for dst, _ in rounds) == tables.own.mat_rows
        assert len(rounds) > 1 or not tables.own.materialize
    assert materialized, "the case no longer splits a segment into several entries"


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), cp=st.integers(1, 4))
def test_random_trees_of_long_segments(seed, cp):
    """Segments of up to 300 rows, so that a rank's runs of one segment stay separate entries
    (gaps over the merge gap) under random plans as well as ``tree_plan``."""
    g = torch.Generator().manual_seed(seed)
    tree = _random_tree(g, segments=int(torch.randint(2, 7, (1,), generator=g)), max_len=300)
    plan = (
        tree_plan(tree, cp)
        if seed % 2
        else _random_plan(g, tree.seq_len, cp, unowned=False, empty=cp > 1 and seed % 3 == 0)
    )
    for rank in range(cp):
        _check(tree, plan, rank, heads=2, groups=1, dim=4, seed=seed)


@pytest.mark.parametrize(
    "kernel", [FreedBuffersReferenceKernel, FreedBuffersWindowedReferenceKernel]
)
def test_the_tree_backward_frees_each_calls_buffers(kernel):
    """The own part's gathered rows and gradients, and each level's, are freed before the next
    call (as in the blocked backward)."""
    plan = _random_plan(torch.Generator().manual_seed(7), DEEP.seq_len, 2, False, False)
    tables = TreeTables.build(plan, 0, DEEP)
    assert len(tables.levels) > 1 and not tables.own.identity
    assert backward_keeping(tables, kernel()) >= 1 + len(tables.levels)
