"""The fused attention path's run tables on the CPU, with a dense stand-in for the kernel.

``ReferenceKernel`` (tests/_attention_ref.py) computes each entry as the cuDNN kernel does, so these
tests check everything of the fused path except cuDNN itself (tests/attention/test_fused_cuda.py
does that on a GPU): the decomposition into bottom-right causal entries, dummy rows, the query span
buffer, the backward's key copies and the sum of their gradients, compact keys when some positions
are owned by nobody, empty ranks, and the reduce-scatter of dK / dV over a CP group. The oracle
(``oracle_attention``) is written from source positions alone.
"""

from __future__ import annotations

import dataclasses
import itertools
from unittest import mock

import pytest
import torch
from _attention_ref import (
    REFERENCE_KERNELS,
    FreedBuffersReferenceKernel,
    FreedBuffersWindowedReferenceKernel,
    ReferenceKernel,
    SharedKeysReferenceKernel,
    SplitSharedKeysReferenceKernel,
    WindowedReferenceKernel,
    WindowedSplitSharedKeysReferenceKernel,
    backward_keeping,
    oracle_attention,
)
from _dist import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.context_parallel import ContextParallelPlan, _extension
from megatron.context_parallel.attention import cudnn
from megatron.context_parallel.attention import runs as attention_runs
from megatron.context_parallel.attention.blocks import (
    AttentionBlocks,
    _balanced_budget,
    _greedy_calls,
    build_attention_tables,
    choose_layout,
)
from megatron.context_parallel.attention.fused import (
    _call_backward,
    _windows_tile,
    fused_attention,
)
from megatron.context_parallel.attention.kernel import AttentionKernel
from megatron.context_parallel.attention.runs import AttentionRuns, CompactKeys, _bucket
from megatron.context_parallel.attention.settings import (
    AttentionSettings,
    attention_settings,
    current_attention_settings,
)
from megatron.context_parallel.comm.mappings import gather_padded_from_context_parallel_region


def _sequence(seq_len, cu):
    if cu is None:
        return torch.zeros(seq_len, dtype=torch.int64)
    lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def _runs(plan, rank, cu=None, **kw):
    padding = 1 if plan.counts[rank] == 0 else 0
    return AttentionRuns.build(plan, rank, _sequence(plan.seq_len, cu), padding_rows=padding, **kw)


def _slots(full, plan):
    """The padded all-gather buffer of ``full`` [S, ...] built from the plan's positions."""
    out = full.new_zeros((plan.cp_size * plan.max_count,) + tuple(full.shape[1:]))
    for r in range(plan.cp_size):
        pos = plan.local_positions(r)
        out[r * plan.max_count : r * plan.max_count + pos.numel()] = full[pos]
    return out


def _check_rank(
    plan, rank, cu, heads, groups, dim, seed, merge_gap=64, kernel=ReferenceKernel, tables=None
):
    g = torch.Generator().manual_seed(seed)
    seq_len = plan.seq_len
    q_full = torch.randn(seq_len, heads, dim, generator=g, dtype=torch.float64)
    kv_full = torch.randn(seq_len, groups, 2 * dim, generator=g, dtype=torch.float64)
    weight = torch.randn(seq_len, heads, dim, generator=g, dtype=torch.float64)
    runs = (
        tables
        if tables is not None
        else (_runs(plan, rank, cu, merge_gap=merge_gap, longest_first=seed % 2 == 1))
    )
    pos = plan.local_positions(rank)
    sequence = _sequence(seq_len, cu)
    owned = plan.owned_mask()
    scale = dim**-0.5

    query = q_full[pos].clone()
    if runs.rows > pos.numel():
        query = torch.cat([query, torch.randn(1, heads, dim, generator=g, dtype=query.dtype)])
    query.requires_grad_()
    kv_slots = _slots(kv_full, plan).requires_grad_()
    out = fused_attention(query, kv_slots, runs, scale, kernel=kernel)
    w = weight[pos]
    if runs.rows > pos.numel():
        w = torch.cat([w, torch.ones(1, heads, dim, dtype=w.dtype)])
    (out * w).sum().backward()

    q_ref = q_full[pos].clone().requires_grad_()
    kv_ref = kv_full.clone().requires_grad_()
    expected = oracle_attention(
        q_ref, kv_ref[..., :dim], kv_ref[..., dim:], pos, sequence, owned, scale
    )
    (expected * weight[pos]).sum().backward()

    n = pos.numel()
    torch.testing.assert_close(out[:n], expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(query.grad[:n], q_ref.grad, rtol=1e-10, atol=1e-10)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))  # an empty rank's padding row
    assert torch.equal(query.grad[n:], torch.zeros_like(query.grad[n:]))
    torch.testing.assert_close(kv_slots.grad, _slots(kv_ref.grad, plan), rtol=1e-10, atol=1e-10)
    return runs


def _drawn_plan(seed, cp, seq_len, packed, unowned):
    """A random plan (and cu_seqlens when ``packed``) from the test's drawn numbers."""
    torch.manual_seed(seed)
    cu = None
    if packed:
        cuts = sorted(torch.randint(0, seq_len + 1, (3,)).tolist())
        cu = tuple([0] + cuts + [seq_len])
    probs = torch.tensor([(1 - unowned) / cp] * cp + [unowned])
    plan = _random_plan(
        lambda n: torch.multinomial(probs, n, replacement=True) if n else torch.zeros(0).long(),
        seq_len,
        cp,
        unowned,
        cu,
    )
    return plan, cu


def _random_plan(draw_ints, seq_len, cp, unowned, cu):
    """Every position to a random rank (or to nobody with probability ``unowned``), each rank's
    rows in a random order."""
    owner = draw_ints(seq_len)
    ranks = []
    for r in range(cp):
        pos = torch.nonzero(owner == r).flatten()
        ranks.append(pos[torch.randperm(pos.numel())])
    if unowned == 0 and all(p.numel() == 0 for p in ranks):
        ranks[0] = torch.arange(seq_len)
    return ContextParallelPlan.from_rank_positions(ranks, seq_len, cu)


# A plan for ``_drawn_plan``: up to four ranks over up to 48 positions, packed or not.
PLAN_DRAWS = dict(
    seed=st.integers(0, 2**16),
    cp=st.integers(1, 4),
    seq_len=st.integers(1, 48),
    packed=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(
    **PLAN_DRAWS,
    unowned=st.sampled_from([0.0, 0.2]),
    gqa=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    merge_gap=st.sampled_from([1, 3, 64]),
    kernel=st.sampled_from(REFERENCE_KERNELS),
)
def test_random_plans_match_the_oracle(seed, cp, seq_len, packed, unowned, gqa, merge_gap, kernel):
    """Every kernel contract: key copies or shared key ranges, one backward call or the split
    one (prefix and diagonal calls)."""
    plan, cu = _drawn_plan(seed, cp, seq_len, packed, unowned)
    for rank in range(cp):
        _check_rank(plan, rank, cu, gqa[0], gqa[1], 4, seed + rank, merge_gap, kernel=kernel)


@pytest.mark.parametrize(
    "plan_kind", ["zigzag", "contiguous", "thd", "uneven", "single_rows", "empty_rank"]
)
def test_named_plans_match_the_oracle(plan_kind):
    cu = None
    if plan_kind == "zigzag":
        plan = ContextParallelPlan.zigzag(32, 2)
    elif plan_kind == "contiguous":
        plan = ContextParallelPlan.contiguous(30, 4)
    elif plan_kind == "thd":
        cu = (0, 8, 8, 24, 40)
        plan = ContextParallelPlan.thd(torch.tensor(cu), 2)
    elif plan_kind == "uneven":
        plan = ContextParallelPlan.from_rank_positions(
            [list(range(0, 9)) + list(range(20, 27)) + [33], list(range(9, 20)) + [27, 28]],
            34,
        )
    elif plan_kind == "single_rows":
        plan = ContextParallelPlan.from_rank_positions([list(range(0, 40, 2)), [1, 3, 7]], 40)
    else:
        plan = ContextParallelPlan.from_rank_positions([list(range(12)), []], 12)
    for rank in range(plan.cp_size):
        for kernel in REFERENCE_KERNELS:
            _check_rank(plan, rank, cu, 4, 2, 8, rank, kernel=kernel)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    cp=st.integers(1, 3),
    seq_len=st.integers(1, 60),
    packed=st.booleans(),
    unowned=st.sampled_from([0.0, 0.2]),
    group_rows=st.sampled_from([1, 2, 3, 5]),
    span_budget=st.sampled_from([None, 1, 7, 10**6]),
    kernel=st.sampled_from(REFERENCE_KERNELS),
)
def test_blocked_layout_matches_the_oracle(
    seed, cp, seq_len, packed, unowned, group_rows, span_budget, kernel
):
    """Groups, diagonal spans in several calls, the backward's levels and their fp32 sums, on
    random plans (small groups make many levels), under every kernel contract."""
    plan, cu = _drawn_plan(seed, cp, seq_len, packed, unowned)
    for rank in range(cp):
        if plan.counts[rank] == 0:
            with pytest.raises(ValueError, match="owns no positions"):
                AttentionBlocks.build(plan, rank, _sequence(seq_len, cu))
            continue
        blocks = AttentionBlocks.build(
            plan, rank, _sequence(seq_len, cu), group_rows=group_rows, span_budget=span_budget
        )
        _check_rank(plan, rank, cu, 4, 2, 4, seed + rank, kernel=kernel, tables=blocks)


def test_blocked_tables_and_the_layout_choice():
    seq_len = 4096
    # Rank 0: a random half of the positions, position 1 among them (rank 1 holds 0).
    perm = torch.randperm(seq_len - 2) + 2
    mine = torch.cat([torch.tensor([1]), perm[: seq_len // 2 - 1]])
    theirs = torch.cat([torch.tensor([0]), perm[seq_len // 2 - 1 :]])
    half = ContextParallelPlan.from_rank_positions([mine, theirs], seq_len)
    seq = torch.zeros(seq_len, dtype=torch.int64)
    blocks = AttentionBlocks.build(half, 0, seq, span_budget=10**6)
    assert blocks.groups == seq_len // 2 // 128 and len(blocks.diagonal) == 1
    assert blocks.order is not None  # rows in random order: sorted through a gather
    # 16 groups: the pieces j == i, then levels of 8, 4, 2 and 1 entries.
    assert [c.entries for c in blocks.levels] == [16, 8, 4, 2, 1]
    # Every level's entries share neither query rows nor keys.
    for call in blocks.levels:
        assert call.kv_source.unique().numel() == call.mat_rows
    assert choose_layout(_runs(half, 0), blocks) == "blocks"
    zig = ContextParallelPlan.zigzag(seq_len, 2)
    assert choose_layout(_runs(zig, 0), AttentionBlocks.build(zig, 0, seq)) == "runs"


@pytest.mark.parametrize(
    "kernel", [FreedBuffersReferenceKernel, FreedBuffersWindowedReferenceKernel]
)
def test_the_blocked_backward_frees_each_calls_buffers(kernel):
    """No diagonal call's span buffers and no call's gradients outlive it (names still bound
    kept the last diagonal's span alive through every level call): on a GPU one call's
    workspace on top of whatever is alive is the backward's peak."""
    seq_len = 512
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(seq_len, generator=g)
    shards = [perm[: seq_len // 2].sort().values, perm[seq_len // 2 :].sort().values]
    plan = ContextParallelPlan.from_rank_positions(shards, seq_len)
    seq = torch.zeros(seq_len, dtype=torch.int64)
    blocks = AttentionBlocks.build(plan, 0, seq, group_rows=16, span_budget=64)
    assert len(blocks.diagonal) > 2 and len(blocks.levels) > 2
    calls = backward_keeping(blocks, kernel())
    assert calls >= len(blocks.diagonal) + len(blocks.levels)


@pytest.mark.parametrize("native", [True, False], ids=["C++", "torch"])
def test_diagonal_spans_stay_within_the_ranks_rows_by_default(monkeypatch, native):
    """By default no diagonal call's span (its query buffer: the rank's rows and the dummies
    between them) holds more rows than the rank has, where a group allows it: the level calls'
    buffers cover the rank's rows, so a larger span would set the backward's peak; an explicit
    budget is taken as given."""
    if not native:
        monkeypatch.setattr(_extension, "host_tables", lambda: None)
    seq_len = 4096
    perm = torch.randperm(seq_len, generator=torch.Generator().manual_seed(5))
    plan = ContextParallelPlan.from_rank_positions(
        [perm[: seq_len // 4].sort().values, perm[seq_len // 4 :].sort().values], seq_len
    )
    seq = torch.zeros(seq_len, dtype=torch.int64)
    for rank in range(2):
        rows = plan.counts[rank]
        blocks = AttentionBlocks.build(plan, rank, seq, group_rows=16)
        spans = [call.query_rows for call, _, _ in blocks.diagonal]
        group_span = max(int(call.q_len.max()) for call, _, _ in blocks.diagonal)
        assert max(spans) <= max(rows, group_span), (rank, rows, spans)
        whole = AttentionBlocks.build(plan, rank, seq, group_rows=16, span_budget=10**6)
        assert len(whole.diagonal) == 1
        if rank == 0:  # 1,024 rows scattered over ~4,096 keys: the cap splits the span
            assert len(blocks.diagonal) > 1 and whole.diagonal[0][0].query_rows > rows
        # Balanced: the calls' spans differ by less than a group's, not a full call and a tail.
        assert max(spans) - min(spans) <= group_span, spans


@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=9), budget=st.integers(1, 40))
@settings(max_examples=300, deadline=None)
def test_diagonal_calls_are_balanced(sizes, budget):
    """The balanced budget packs consecutive groups in as many calls as a greedy fill under the
    budget, none larger than the budget, with the largest call as small as any split of the
    groups into that many consecutive calls allows (all splits enumerated)."""
    calls = _greedy_calls(sizes, budget)
    balanced = _balanced_budget(sizes, budget)
    assert balanced <= max(budget, 1) and _greedy_calls(sizes, balanced) == calls
    best = min(
        max(sum(sizes[a:b]) for a, b in zip((0,) + cut, cut + (len(sizes),)))
        for cut in itertools.combinations(range(1, len(sizes)), calls - 1)
    )
    packed = []
    for size in sizes:  # the greedy fill, as the builders make the calls
        if not packed or packed[-1] + size > balanced:
            packed.append(0)
        packed[-1] += size
    assert len(packed) == calls and max(packed) == best


@pytest.mark.parametrize("plan_kind", ["zigzag", "random half"])
def test_tables_are_built_on_one_intra_op_thread(monkeypatch, plan_kind):
    """Every host op of a batch's tables (the C++ builders' fills, the packing and the copy) runs
    on the calling thread alone, and the thread count comes back, also when a build raises."""
    seq_len = 4096
    if plan_kind == "zigzag":
        plan = ContextParallelPlan.zigzag(seq_len, 2)
    else:
        perm = torch.randperm(seq_len, generator=torch.Generator().manual_seed(0))
        plan = ContextParallelPlan.from_rank_positions(
            [perm[: seq_len // 2], perm[seq_len // 2 :]], seq_len
        )
    seq = torch.zeros(seq_len, dtype=torch.int64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        real = _extension.host_tables

        def spy():
            seen.append(torch.get_num_threads())
            return real()

        monkeypatch.setattr(_extension, "host_tables", spy)
        tables = build_attention_tables(plan, 0, seq)
        assert type(tables).__name__ == (
            "AttentionRuns" if plan_kind == "zigzag" else "AttentionBlocks"
        )
        tables.on("cpu")
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
        seen.clear()
        with attention_settings(serial_host_ops=False):
            build_attention_tables(plan, 0, seq)
        assert seen and set(seen) == {2}

        def broken():
            raise RuntimeError("builder failed")

        monkeypatch.setattr(_extension, "host_tables", broken)
        with pytest.raises(RuntimeError, match="builder failed"):
            build_attention_tables(plan, 0, seq)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_tables_of_the_report_layouts():
    zig = _runs(ContextParallelPlan.zigzag(512, 2), 0)
    assert zig.identity and zig.entries == 2 and zig.materialize
    # Longest entry first: the second run (keys 0 .. 511) before the first (keys 0 .. 127).
    assert zig.q_len.tolist() == [128, 128] and zig.kv_len.tolist() == [512, 128]
    assert zig.q_start.tolist() == [128, 0]
    assert zig.mat_rows == 640 and zig.compact_slots is not None
    # Closer than the merge gap, the two runs become one span (the middle as dummies).
    small = _runs(ContextParallelPlan.zigzag(64, 2), 0)
    assert not small.identity and small.entries == 1 and small.query_rows == 64

    last = _runs(ContextParallelPlan.contiguous(40, 4), 3)
    assert last.identity and last.entries == 1 and not last.materialize and last.keys_covered
    first = _runs(ContextParallelPlan.contiguous(40, 4), 0)
    assert not first.keys_covered  # keys 10..39 are attended by other ranks only
    assert ContextParallelPlan.contiguous(40, 4).slots_in_source_order
    assert first.compact_slots is None

    cu = (0, 256, 768, 1280)
    thd = _runs(ContextParallelPlan.thd(torch.tensor(cu), 2), 0, cu)
    assert thd.identity and thd.entries == 6 and thd.materialize
    # Rank 1 holds the two middle chunks of each sequence: one run each, keys not copied.
    middle = _runs(ContextParallelPlan.thd(torch.tensor(cu), 2), 1, cu)
    assert middle.identity and middle.entries == 3 and not middle.materialize

    # Alternating single positions: one span of dummies rather than 32 one-row entries.
    halves = ContextParallelPlan.from_rank_positions(
        [list(range(0, 64, 2)), list(range(1, 64, 2))], 64
    )
    half = _runs(halves, 0)
    assert not half.identity and half.entries == 1 and half.query_rows == 63
    singles = _runs(halves, 0, merge_gap=1)
    assert singles.entries == 32 and singles.identity and singles.materialize
    # Positions nobody owns have no keys: the even rows alone are one run of compact keys.
    alone = _runs(ContextParallelPlan.from_rank_positions([list(range(0, 64, 2))], 64), 0)
    assert alone.identity and alone.entries == 1 and alone.num_keys == 32

    # Permuted rows of one rank: runs by position, gathered into a span buffer.
    perm = _runs(ContextParallelPlan.from_rank_positions([torch.randperm(50)], 50), 0)
    assert not perm.identity and perm.entries == 1 and perm.query_rows == 50

    empty = _runs(ContextParallelPlan.from_rank_positions([list(range(5)), []], 5), 1)
    assert empty.entries == 0 and empty.rows == 1 and empty.identity


def test_buckets_bound_the_number_of_kernel_shapes():
    assert [_bucket(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    sizes = {_bucket(n, per_octave=8) for n in range(1000, 2001)}
    assert len(sizes) <= 9 and all(s >= 1000 for s in sizes)
    assert all(_bucket(n, 8) < 1.13 * n for n in range(64, 5000))


def test_shape_reuse_takes_the_least_larger_recorded_shape():
    shared = attention_runs._shared_shape
    with attention_runs.kernel_shapes() as shapes:
        with attention_settings(shape_reuse=1.0):
            assert shared(4, 1000, 3000) == (4, 1000, 3000)
            assert shared(4, 900, 2900) == (4, 900, 2900)  # off: every shape its own
        with attention_settings(shape_reuse=1.25):
            assert shared(4, 850, 2600) == (4, 900, 2900)  # the smaller of the two covering it
            assert shared(2, 850, 2600) == (2, 850, 2600)  # entries beyond 1.25x: recorded
            assert shared(1, 850, 2600) == (1, 850, 2600)
            assert shared(4, 700, 2600) == (4, 700, 2600)  # rows beyond 1.25x: recorded
            assert shared(8, 900, 2900) == (8, 900, 2900)  # a larger batch is never cut
        assert attention_runs.recorded_shapes() == shapes.recorded() == {
            (4, 1000, 3000), (4, 900, 2900), (2, 850, 2600), (1, 850, 2600), (4, 700, 2600),
            (8, 900, 2900),
        }  # fmt: skip
        # A shape once chosen stays: with (4, 860, 2610) recorded since, which would cover
        # (4, 850, 2600) with less padding, that shape keeps (4, 900, 2900), whose graphs it ran
        # on.
        with attention_settings(shape_reuse=1.0):
            assert shared(4, 860, 2610) == (4, 860, 2610)
        with attention_settings(shape_reuse=1.25):
            assert shared(4, 850, 2600) == (4, 900, 2900)
            assert shared(4, 855, 2600) == (4, 860, 2610)  # a new one takes the least padded
    assert (4, 855, 2600) not in attention_runs.recorded_shapes()  # the process's record is back


def test_kernels_meet_the_kernel_protocol():
    for kernel in (ReferenceKernel(), SharedKeysReferenceKernel(), cudnn.KERNEL):
        assert isinstance(kernel, AttentionKernel), kernel
    assert cudnn.KERNEL.shared_keys_in_backward
    copies = cudnn.CudnnKernel(cudnn.CudnnOptions(shared_keys_in_backward=False))
    assert not copies.shared_keys_in_backward and cudnn.KERNEL.shared_keys_in_backward
    assert not ReferenceKernel().shared_keys_in_backward
    assert not isinstance(object(), AttentionKernel)


def test_the_level_kernel_cuts_at_the_level_budget():
    """``CudnnKernel.for_levels``: the same options under the smaller of the two budgets."""
    whole = cudnn.CudnnKernel(cudnn.CudnnOptions(backward_workspace=3 << 28))
    levels = whole.for_levels()
    assert levels.backward_window_rows(40, 128) == (1 << 29) // (4 * 40 * 128)
    assert whole.backward_window_rows(40, 128) == (3 << 28) // (4 * 40 * 128)
    assert dataclasses.replace(levels.options, backward_workspace=3 << 28) == whole.options
    assert whole.for_levels() is levels  # one per options
    small = cudnn.CudnnKernel(cudnn.CudnnOptions(backward_workspace=1 << 20))
    assert small.for_levels() is small
    assert cudnn.CudnnKernel(cudnn.CudnnOptions(level_workspace=None)).for_levels().options == (
        cudnn.CudnnOptions(level_workspace=None)
    )
    unbounded = cudnn.CudnnKernel(cudnn.CudnnOptions(backward_workspace=None))
    assert unbounded.for_levels().backward_window_rows(8, 128) == (1 << 29) // (4 * 8 * 128)


@pytest.mark.parametrize("seed", range(4))
def test_the_blocked_level_calls_run_on_the_level_kernel(seed):
    """The level calls (and only they) run on ``kernel.for_levels()``: here one that cuts them
    into windows of 12 rows, while the kernel itself cuts nothing."""
    calls = {"whole": 0, "levels": []}

    class Levels(ReferenceKernel):
        window_rows = 12

        @classmethod
        def backward(cls, q, kv, o, do, stats, runs, *args, **kwargs):
            calls["levels"].append(runs.window)
            return super().backward(q, kv, o, do, stats, runs, *args, **kwargs)

    class Whole(ReferenceKernel):
        @classmethod
        def for_levels(cls):
            return Levels

        @classmethod
        def backward(cls, *args, **kwargs):
            calls["whole"] += 1
            return super().backward(*args, **kwargs)

    plan, cu = _drawn_plan(seed, 2, 40, True, 0.0)
    blocks = AttentionBlocks.build(plan, 0, _sequence(40, cu), group_rows=2)
    _check_rank(plan, 0, cu, 2, 1, 4, seed, kernel=Whole, tables=blocks)
    assert calls["whole"] == len(blocks.diagonal)
    windows = sum(len(c.backward_windows(12)) for c in blocks.levels)
    assert len(calls["levels"]) == windows > len(blocks.levels)


def test_attention_settings_are_scoped_and_checked():
    before = current_attention_settings()
    with attention_settings(backend="dense", shape_reuse=1.5) as inside:
        assert current_attention_settings() is inside
        assert inside.backend == "dense" and inside.shape_reuse == 1.5
        assert inside.shape_buckets == before.shape_buckets
    assert current_attention_settings() == before
    for bad in (dict(backend="flash"), dict(shape_reuse=0.5), dict(shape_buckets=0)):
        with pytest.raises(ValueError):
            with attention_settings(**bad):
                pass
        assert current_attention_settings() == before
    with pytest.raises(TypeError):
        with attention_settings(shape_reuse_factor=2.0):
            pass
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.backend = "dense"


def test_shape_reuse_bounds_the_shapes_of_random_plans():
    """Over random uneven plans the recorded shapes (one set of kernel graphs each) stop growing
    under the default policy (powers of two, reuse within 2x), unlike fine sizes without reuse,
    and every batch's tables cover its entries."""
    counts = {}
    default = AttentionSettings()
    for buckets, reuse in ((16, 1.0), (default.shape_buckets, default.shape_reuse)):
        policy = attention_settings(shape_buckets=buckets, shape_reuse=reuse)
        with policy, attention_runs.kernel_shapes() as shapes:
            g = torch.Generator().manual_seed(0)
            growth = []
            for _i in range(120):
                owner = torch.randint(0, 2, (4000 // 97,), generator=g).repeat_interleave(97)
                rows = torch.nonzero(owner == 0).flatten()
                plan = ContextParallelPlan.from_rank_positions(
                    [rows, torch.nonzero(owner == 1).flatten()], owner.numel()
                )
                if rows.numel() == 0:
                    continue
                runs = _runs(plan, 0, merge_gap=1)
                assert runs.entries <= runs.batch <= reuse * _bucket(runs.entries)
                assert int(runs.q_len.max()) <= runs.max_q
                assert int(runs.kv_len.max()) <= runs.max_kv
                growth.append(len(shapes.recorded()))
        counts[buckets] = growth
    fine, default = counts[16], counts[default.shape_buckets]
    assert default[-1] < fine[-1] / 2
    assert default[-1] == default[len(default) // 2]  # none in the second half


def _w_gathered(rank, world, seed):
    """CP ``world``: the padded all-gather, compact keys, fused path and reduce-scatter against
    the oracle summed over every rank's queries."""
    torch.manual_seed(seed)
    seq_len, heads, groups, dim = 37, 4, 2, 8
    owner = torch.randint(0, world, (seq_len,), generator=torch.Generator().manual_seed(seed))
    plan = ContextParallelPlan.from_rank_positions(
        [torch.nonzero(owner == r).flatten().flip(0) for r in range(world)], seq_len
    )
    g = torch.Generator().manual_seed(seed + 1)
    q_full = torch.randn(seq_len, heads, dim, generator=g, dtype=torch.float64)
    kv_full = torch.randn(seq_len, groups, 2 * dim, generator=g, dtype=torch.float64)
    weight = torch.randn(seq_len, heads, dim, generator=g, dtype=torch.float64)
    runs = _runs(plan, rank)
    pos = plan.local_positions(rank)
    query = q_full[pos].clone().requires_grad_()
    kv_local = kv_full[pos].clone().requires_grad_()
    group = torch.distributed.group.WORLD
    slots = gather_padded_from_context_parallel_region(kv_local, plan.max_count, group)
    out = fused_attention(query, slots, runs, dim**-0.5, kernel=ReferenceKernel)
    (out * weight[pos]).sum().backward()

    q_ref = q_full.clone().requires_grad_()
    kv_ref = kv_full.clone().requires_grad_()
    owned = plan.owned_mask()
    everyone = torch.arange(seq_len)
    sequence = torch.zeros(seq_len, dtype=torch.int64)
    expected = oracle_attention(
        q_ref, kv_ref[..., :dim], kv_ref[..., dim:], everyone, sequence, owned, dim**-0.5
    )
    (expected * weight).sum().backward()
    torch.testing.assert_close(out, expected[pos], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(query.grad, q_ref.grad[pos], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kv_local.grad, kv_ref.grad[pos], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("world", [2, 3])
def test_over_a_cp_group_matches_the_oracle(world):
    run_distributed(_w_gathered, world, 5)


def test_backward_graphs_are_sized_for_the_largest_totals_so_far(monkeypatch):
    """A new backward graph is built for the process's largest row totals so far (raised to the
    call's), so later batches of larger totals fit it; a recorded graph that holds a call serves
    it."""
    from megatron.context_parallel.attention import cudnn as kernel

    monkeypatch.setattr(kernel, "_TOTALS", {})
    monkeypatch.setattr(kernel, "_LARGEST_TOTALS", [0, 0])
    assert kernel.backward_totals("a", 100, 200) == ((100, 200), True)
    assert kernel.backward_totals("a", 90, 150) == ((100, 200), False)
    assert kernel.backward_totals("b", 50, 300) == ((100, 300), True)
    assert kernel.backward_totals("b", 100, 10) == ((100, 300), False)
    assert kernel.backward_totals("a", 100, 250) == ((100, 300), True)  # a's first is too small
    assert kernel.backward_totals("a", 60, 220) == ((100, 300), False)
    assert kernel.backward_totals("a", 60, 180) == ((100, 200), False)  # the smallest that holds
    # Under a cap of 300 rows (a window budget), a call within it gets no graph above it.
    monkeypatch.setattr(kernel, "_TOTALS", {})
    monkeypatch.setattr(kernel, "_LARGEST_TOTALS", [4000, 8000])  # a big call ran before
    assert kernel.backward_totals("c", 40, 60, 300) == ((40, 60), True)
    assert kernel.backward_totals("c", 30, 60, 300) == ((40, 60), False)
    assert kernel.backward_totals("c", 50, 60, None) == ((4000, 8000), True)
    assert kernel.backward_totals("c", 45, 60, 300) == ((45, 60), True)  # not the uncapped one
    # A call larger than the cap (an entry no window can cut) gets a graph of its own size.
    assert kernel.backward_totals("c", 200, 500, 300) == ((200, 500), True)


def test_the_causal_diagonal_of_a_call():
    """Top-left by default where every entry is square (the same mask), bottom-right where
    asked or any entry is not; none for an unmasked call."""
    from megatron.context_parallel.attention.cudnn import CudnnOptions, diagonal

    def call(q_len, kv_len, causal=True):
        q_len, kv_len = torch.tensor(q_len), torch.tensor(kv_len)
        q_start = torch.cumsum(q_len, 0) - q_len
        k_start = torch.cumsum(kv_len, 0) - kv_len
        return AttentionRuns.from_entries(
            q_start, q_len, k_start, kv_len,
            query_rows=int(q_len.sum()), num_keys=int(kv_len.sum()), causal=causal,
        )  # fmt: skip

    top_left = CudnnOptions()
    square, tall = call([5, 3], [5, 3]), call([5, 3], [9, 3])
    assert diagonal(square, CudnnOptions(square_top_left=False)) == "bottom_right"
    assert diagonal(square, top_left) == "top_left"
    assert diagonal(tall, top_left) == "bottom_right"
    assert diagonal(call([5, 3], [5, 3], causal=False), top_left) is None


def test_the_backward_split_partitions_each_entrys_keys():
    """Prefix (unmasked) and diagonal (square, causal) calls: the same query rows, each entry's
    keys and key-gradient rows cut at ``kv_len - q_len``; split only past the margin."""
    plan = ContextParallelPlan.zigzag(64, 2)
    runs = _runs(plan, 0, None, merge_gap=1)  # two entries (unmerged)
    prefix, diagonal = runs.backward_split()
    assert not prefix.causal and diagonal.causal
    assert torch.equal(diagonal.q_len, diagonal.kv_len)
    assert prefix.query_rows == diagonal.query_rows == runs.query_rows
    # Each key-gradient row of the whole call, written by exactly one of the two.
    written = torch.zeros(runs.mat_rows, dtype=torch.int64)
    for part in (prefix, diagonal):
        for m, k in zip(part.mat_start.tolist(), part.kv_len.tolist()):
            written[m : m + k] += 1
    whole = torch.zeros(runs.mat_rows, dtype=torch.int64)
    for m, k in zip(runs.mat_start.tolist(), runs.kv_len.tolist()):
        whole[m : m + k] += 1
    assert torch.equal(written, whole)
    # Zigzag rank 0: a first quarter (square) and a last quarter over the whole sequence:
    # rectangles 16 * 16 + 16 * 64 against 136 + 16 * 48 + 136 visible pairs, 1.23x.
    assert runs.backward_split(margin=1.2) is not None
    assert runs.backward_split(margin=1.25) is None
    square = _runs(ContextParallelPlan.contiguous(32, 1), 0, None)
    assert square.backward_split() is None


def _rows_written(call, offset=(0, 0)):
    """Each entry of ``call`` as ``(first query row, rows, first key, keys, first key-gradient
    row)`` in the coordinates of the buffers of the call it came from."""
    q_lo, m_lo = offset
    return [
        (q + q_lo, n, k, m, g + m_lo)
        for q, n, k, m, g in zip(
            call.q_start.tolist(), call.q_len.tolist(), call.k_start.tolist(),
            call.kv_len.tolist(), call.mat_start.tolist(),
        )
    ]  # fmt: skip


# A drawn plan and a window budget (query plus key-gradient rows).
WINDOW_DRAWS = dict(
    seed=st.integers(0, 2**16),
    cp=st.integers(1, 4),
    seq_len=st.integers(2, 96),
    packed=st.booleans(),
    max_rows=st.integers(1, 120),
)


@settings(max_examples=40, deadline=None)
@given(**WINDOW_DRAWS)
def test_backward_windows_cover_each_entry_once(seed, cp, seq_len, packed, max_rows):
    """Windows hold every entry of the call once, in the call's order, each within its
    window's rows; a window spans at most ``max_rows`` query plus key-gradient rows unless it
    holds one entry; ``rows_covered`` says whether its entries fill its query rows."""
    plan, cu = _drawn_plan(seed, cp, seq_len, packed, 0.0)
    for rank in range(cp):
        whole = _runs(plan, rank, cu, merge_gap=1)
        for call in (whole,) + tuple(whole.backward_split(margin=1.0) or ()):
            windows = call.backward_windows(max_rows)
            if call.query_rows + call.mat_rows <= max_rows:
                assert windows == (call,)
                continue
            if windows == (call,):  # one window, as wide as the buffers
                assert windows[0].window is None
                continue
            seen = []
            for w in windows:
                q_lo, q_hi, m_lo, m_hi = w.window
                assert w.query_rows == q_hi - q_lo and w.mat_rows == m_hi - m_lo
                assert w.entries == 1 or w.query_rows + w.mat_rows <= max_rows
                assert w.causal == call.causal and w.materialize == call.materialize
                assert (
                    int((w.q_start + w.q_len).max()) <= w.query_rows and int(w.q_start.min()) >= 0
                )
                assert int((w.mat_start + w.kv_len).max()) <= w.mat_rows
                assert int(w.mat_start.min()) >= 0
                assert w.rows_covered == (int(w.q_len.sum()) == w.query_rows)
                seen += _rows_written(w, (q_lo, m_lo))
            whole_entries = _rows_written(call)
            assert sorted(seen) == sorted(whole_entries)
            # The kernel's entry order (longest first) holds within each window.
            for w in windows:
                order = [whole_entries.index(e) for e in _rows_written(w, w.window[::2])]
                assert order == sorted(order)


def _fresh_buffers_read_nan():
    """``Tensor.new_empty`` filling floating buffers with NaN, for as long as it is entered."""
    real = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    return mock.patch.object(torch.Tensor, "new_empty", poisoned)


@settings(max_examples=60, deadline=None)
@given(
    **PLAN_DRAWS,
    unowned=st.sampled_from([0.0, 0.3]),
    blocked=st.booleans(),
    kernel=st.sampled_from([WindowedReferenceKernel, WindowedSplitSharedKeysReferenceKernel]),
)
def test_windows_write_the_query_gradient_in_place(
    seed, cp, seq_len, packed, unowned, blocked, kernel
):
    """The first call's windows write their rows of one query-gradient buffer (``dq_out``),
    under the run and the blocked layouts. Fresh buffers read NaN here, so a row of the
    gradient that no window wrote shows."""
    plan, cu = _drawn_plan(seed, cp, seq_len, packed, unowned)
    with _fresh_buffers_read_nan():
        for rank in range(cp):
            tables = None
            if blocked and plan.counts[rank]:
                tables = AttentionBlocks.build(plan, rank, _sequence(seq_len, cu), group_rows=2)
            _check_rank(
                plan, rank, cu, 2, 1, 4, seed + rank, merge_gap=1, kernel=kernel, tables=tables
            )


@pytest.mark.parametrize("seed", range(6))
def test_a_windowed_calls_query_gradient_is_zero_outside_its_entries(seed):
    """The blocked layout's level calls use some of the rank's rows: cut into windows, the
    rows between windows read zero, as the kernel's contract has it for one call, though the
    windows write into a fresh (here NaN) buffer."""
    plan, cu = _drawn_plan(seed, 2, 40, True, 0.0)
    blocks = AttentionBlocks.build(plan, 0, _sequence(40, cu), group_rows=2)
    g = torch.Generator().manual_seed(seed)
    n = blocks.rows
    q, o, do = (torch.randn(n, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    kv = torch.randn(blocks.slots, 1, 8, generator=g, dtype=torch.float64)
    stats = torch.randn(n, 2, generator=g, dtype=torch.float64)
    gaps = 0
    with _fresh_buffers_read_nan():
        for call in blocks.levels:
            cd = call.on(q.device)
            dq, _ = _call_backward(
                WindowedReferenceKernel(), q, kv, o, do, stats, call, cd, 0.5, False
            )
            outside = torch.ones(n, dtype=torch.bool)
            outside[cd.entry_rows()] = False
            assert torch.equal(dq[outside], torch.zeros_like(dq[outside]))
            assert not dq[~outside].isnan().any()
            windows = call.backward_windows(WindowedReferenceKernel.window_rows)
            gaps += windows[0].window is not None and not _windows_tile(windows, n)
    assert gaps  # some call's windows leave rows between them


@settings(max_examples=40, deadline=None)
@given(**WINDOW_DRAWS)
def test_the_split_backward_runs_its_diagonal_first(seed, cp, seq_len, packed, max_rows):
    """A split call's backward starts with its diagonal call, whose windows tile the query rows
    (every entry has a diagonal), so they write into an uninitialised buffer."""
    causal = []

    class Recording(SplitSharedKeysReferenceKernel):
        split_margin = 1.0
        window_rows = max_rows

        @classmethod
        def backward(cls, q, kv, o, do, stats, piece, *args, **kwargs):
            causal.append(piece.causal)
            return super().backward(q, kv, o, do, stats, piece, *args, **kwargs)

    plan, cu = _drawn_plan(seed, cp, seq_len, packed, 0.0)
    for rank in range(cp):
        runs = _runs(plan, rank, cu, merge_gap=1)
        split = runs.backward_split(margin=1.0)
        if split is None:
            continue
        causal.clear()
        _check_rank(plan, rank, cu, 2, 1, 4, seed, merge_gap=1, kernel=Recording, tables=runs)
        assert causal == sorted(causal, reverse=True) and causal[0] and not causal[-1]
        windows = split[1].backward_windows(max_rows)
        if runs.rows_covered and windows[0].window is not None:
            assert _windows_tile(windows, runs.query_rows)


def test_windows_tile_their_rows_without_gaps():
    def windows(*ranges):
        return [dataclasses.make_dataclass("W", ["window"])((lo, hi, 0, 0)) for lo, hi in ranges]

    assert _windows_tile(windows((0, 5), (5, 9)), 9)
    assert not _windows_tile(windows((0, 5), (6, 9)), 9)
    assert not _windows_tile(windows((1, 9)), 9)
    assert not _windows_tile(windows((0, 5)), 9)


def test_backward_windows_of_thd_hold_whole_sequences():
    """THD rank 0 at CP 2 (two runs of each of four sequences, their key-gradient rows laid out
    in query-row order): windows of 64 rows take each sequence's two entries together."""
    cu = (0, 16, 32, 48, 64)
    plan = ContextParallelPlan.thd(torch.tensor(cu), 2)
    runs = _runs(plan, 0, cu, merge_gap=1)
    assert runs.materialize and runs.entries == 8
    # Per sequence: 8 query rows; key rows 4 + 16 (the first and the last quarter).
    windows = runs.backward_windows(2 * (8 + 20))
    assert [w.entries for w in windows] == [4, 4]
    assert [w.window for w in windows] == [(0, 16, 0, 40), (16, 32, 40, 80)]
    assert all(w.rows_covered for w in windows)
    assert runs.backward_windows(runs.query_rows + runs.mat_rows) == (runs,)


# A drawn plan and the run tables' build options (shared with test_tables_native).
RUN_TABLE_DRAWS = dict(
    seed=st.integers(0, 2**16),
    cp=st.integers(1, 4),
    seq_len=st.integers(1, 80),
    packed=st.booleans(),
    unowned=st.sampled_from([0.0, 0.2]),
    merge_gap=st.sampled_from([1, 3, 64]),
    longest_first=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(**RUN_TABLE_DRAWS)
def test_key_sources_and_slot_copies_from_the_entries(
    seed, cp, seq_len, packed, unowned, merge_gap, longest_first
):
    """``kv_source`` and ``slot_copies`` (derived from the per-entry tables, on the host and
    by ``DeviceRuns``) against loops over the entries: each key-gradient row's key, and each
    slot's copies exactly the rows of its key, in rows 0, 1, ... of ``slot_copies``."""
    plan, cu = _drawn_plan(seed, cp, seq_len, packed, unowned)
    keys = CompactKeys(plan, _sequence(seq_len, cu))
    for rank in range(cp):
        padding = 1 if plan.counts[rank] == 0 else 0
        runs = AttentionRuns.build(
            plan, rank, _sequence(seq_len, cu), padding_rows=padding, merge_gap=merge_gap,
            longest_first=longest_first,
        )  # fmt: skip
        key_of_row = {}
        for e in range(runs.entries):
            for j in range(int(runs.kv_len[e])):
                row = int(runs.mat_start[e]) + j
                assert row not in key_of_row or not runs.materialize
                key_of_row[row] = int(runs.k_start[e]) + j
        if not runs.materialize:
            key_of_row = {k: k for k in range(runs.num_keys)}
            assert runs.kv_source is None
        else:
            expected = torch.full((runs.mat_rows,), -1, dtype=torch.int64)
            for row, key in key_of_row.items():
                expected[row] = key
            assert torch.equal(runs.kv_source, expected)
        dev = runs.on(torch.device("cpu"))
        assert "slot_copies" not in dev._offsets  # derived on first read, never copied
        if runs.slots_are_rows:
            assert runs.slot_copies is None and dev.slot_copies is None
            assert torch.equal(keys.slots, torch.arange(keys.count))
            continue
        copies = runs.slot_copies
        assert torch.equal(dev.slot_copies, copies)
        if runs.materialize:
            assert torch.equal(dev.kv_source, runs.kv_source)
        for slot in range(runs.slots):
            column = copies[:, slot].tolist()
            rows = [r for r in column if r >= 0]
            # Copies fill rows 0, 1, ... of the column: none after the first gap.
            assert column == rows + [-1] * (len(column) - len(rows))
            want = sorted(r for r, k in key_of_row.items() if int(keys.slots[k]) == slot)
            assert sorted(rows) == want


def test_the_split_calls_travel_with_the_call():
    """``on`` copies the split backward's per-entry tables in the call's one copy; they carry
    no row maps of their own (the backward reads the whole call's)."""
    runs = _runs(ContextParallelPlan.zigzag(64, 2), 0, None, merge_gap=1)
    prefix, diagonal = runs.backward_split()
    assert not prefix._device and not diagonal._device
    dev = runs.on(torch.device("cpu"))
    for part in (prefix, diagonal):
        pdev = part._device[torch.device("cpu")]
        assert pdev.span_source is None and pdev.entry_copy is None
        assert torch.equal(pdev.seq_len_q.flatten()[: part.entries], part.q_len.to(torch.int32))
        assert torch.equal(pdev.kv_rows.flatten()[: part.entries], part.k_start)
    assert torch.equal(dev.seq_len_kv.flatten()[: runs.entries], runs.kv_len.to(torch.int32))
