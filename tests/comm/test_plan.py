"""ContextParallelPlan: constructors against independently derived layouts, and validation."""

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.context_parallel import ContextParallelPlan


def _zigzag_reference(seq_len, cp, rank):
    # Megatron's get_batch_on_this_cp_rank: view as [2*cp, chunk] and take rows r, 2cp-1-r.
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    return chunks[[rank, 2 * cp - 1 - rank]].flatten()


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zigzag_matches_megatron_layout(cp):
    seq_len = 2 * cp * 5
    plan = ContextParallelPlan.zigzag(seq_len, cp)
    assert plan.cp_size == cp and plan.seq_len == seq_len
    assert plan.counts == (seq_len // cp,) * cp
    for r in range(cp):
        assert torch.equal(plan.local_positions(r), _zigzag_reference(seq_len, cp, r))


@pytest.mark.parametrize("seq_len,cp", [(10, 3), (7, 4), (0, 2), (5, 5), (3, 4)])
def test_contiguous_matches_tensor_split(seq_len, cp):
    plan = ContextParallelPlan.contiguous(seq_len, cp)
    expected = torch.tensor_split(torch.arange(seq_len), cp)
    assert plan.counts == tuple(len(e) for e in expected)
    for r in range(cp):
        assert torch.equal(plan.local_positions(r), expected[r])


def test_thd_splits_each_sequence_like_te():
    cu = [0, 8, 8, 24, 40]
    cp = 2
    plan = ContextParallelPlan.thd(torch.tensor(cu, dtype=torch.int32), cp)
    assert plan.cu_seqlens == tuple(cu) and plan.seq_len == 40
    for r in range(cp):
        parts = []
        for start, end in zip(cu[:-1], cu[1:]):
            if end > start:
                parts.append(_zigzag_reference(end - start, cp, r) + start)
        assert torch.equal(plan.local_positions(r), torch.cat(parts))
    views = plan.split_sequences(torch.arange(40) * 10)
    assert [v.tolist() for v in views][1] == []
    assert torch.equal(views[2], torch.arange(8, 24) * 10)
    assert plan.sequence_lengths == (8, 0, 16, 16)


def test_from_rank_positions_uneven_empty_uncovered():
    plan = ContextParallelPlan.from_rank_positions(
        [[4, 0], torch.tensor([], dtype=torch.int64), torch.tensor([2], dtype=torch.int16)]
    )
    assert plan.seq_len == 5 and plan.counts == (2, 0, 1) and plan.max_count == 2
    assert plan.local_positions(1).dtype == torch.int64
    assert plan.slot_positions().tolist() == [4, 0, -1, -1, 2, -1]
    assert plan.row_source().tolist() == [1, -1, 4, -1, 0]
    assert plan.owned_mask().tolist() == [True, False, True, False, True]
    longer = ContextParallelPlan.from_rank_positions([[4, 0], [], [2]], seq_len=9)
    assert longer.seq_len == 9 and longer != plan
    assert ContextParallelPlan.from_rank_positions([[], []]).seq_len == 0


def test_slots_in_source_order_only_for_equal_contiguous_shards():
    assert ContextParallelPlan.contiguous(12, 3).slots_in_source_order
    assert ContextParallelPlan.contiguous(12, 1).slots_in_source_order
    assert not ContextParallelPlan.contiguous(13, 3).slots_in_source_order  # padding
    assert not ContextParallelPlan.zigzag(12, 3).slots_in_source_order
    assert not ContextParallelPlan.from_rank_positions([[1, 0], [2, 3]]).slots_in_source_order
    assert not ContextParallelPlan.from_rank_positions([[0, 1], [2, 3]], 5).slots_in_source_order


def test_from_rank_positions_keeps_cu_seqlens():
    plan = ContextParallelPlan.from_rank_positions([[0, 4], [1, 2, 3]], cu_seqlens=[0, 2, 5])
    assert plan.seq_len == 5 and plan.cu_seqlens == (0, 2, 5)
    assert [v.tolist() for v in plan.split_sequences(torch.arange(5))] == [[0, 1], [2, 3, 4]]
    with pytest.raises(ValueError, match="cu_seqlens ends at 5 but seq_len is 6"):
        ContextParallelPlan.from_rank_positions([[0, 4], [1, 2, 3]], 6, cu_seqlens=[0, 2, 5])


def test_plan_is_immutable_hashable_picklable():
    plan = ContextParallelPlan.zigzag(8, 2)
    with pytest.raises(AttributeError, match="immutable"):
        plan.seq_len = 3
    copy = pickle.loads(pickle.dumps(plan))
    assert copy == plan and hash(copy) == hash(plan)
    assert ContextParallelPlan.from_rank_positions([[0, 1, 6, 7], [2, 3, 4, 5]]) == plan
    assert ContextParallelPlan.contiguous(8, 2) != plan
    # A returned CPU position tensor is a copy: editing it cannot corrupt the plan.
    plan.local_positions(0)[0] = 99
    assert plan.local_positions(0)[0] == 0
    assert "cp_size=2" in repr(plan)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(rank_positions=[[0, 1], [1, 2]]), r"position 1 is owned twice, by ranks \[0, 1\]"),
        (dict(rank_positions=[[0, 3, 3], [1]]), r"position 3 is owned twice, by rank 0"),
        (dict(rank_positions=[[0, -1]]), "rank 0 holds negative position -1"),
        (dict(rank_positions=[[0], [5]], seq_len=5), "rank 1 holds position 5 >= seq_len 5"),
        (dict(rank_positions=[torch.tensor([0.0, 1.0])]), "integer dtype, got torch.float32"),
        (dict(rank_positions=[[0, 1.5]]), "must hold integers, got float"),
        (dict(rank_positions=[[True, False]]), "must hold integers, got bool"),
        (dict(rank_positions=[torch.zeros(2, 2, dtype=torch.int64)]), "must be 1-D"),
        (dict(rank_positions=[]), "at least one rank"),
    ],
)
def test_invalid_rank_positions(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ContextParallelPlan.from_rank_positions(**kwargs)


def test_invalid_layouts():
    with pytest.raises(ValueError, match=r"divisible by 2\*cp_size=4, got seq_len=10"):
        ContextParallelPlan.zigzag(10, 2)
    with pytest.raises(ValueError, match="sequence 1 has length 6"):
        ContextParallelPlan.thd([0, 8, 14], 2)
    with pytest.raises(ValueError, match="must start at 0"):
        ContextParallelPlan.thd([1, 8], 2)
    with pytest.raises(ValueError, match="non-decreasing"):
        ContextParallelPlan.thd([0, 8, 4], 1)
    with pytest.raises(ValueError, match="cp_size must be a positive int"):
        ContextParallelPlan.contiguous(8, 0)
    with pytest.raises(ValueError, match="seq_dim 2 out of range"):
        ContextParallelPlan.zigzag(8, 2).split_sequences(torch.zeros(8), seq_dim=2)
    with pytest.raises(ValueError, match="needs size 8 along dim 0, got 7"):
        ContextParallelPlan.zigzag(8, 2).split_sequences(torch.zeros(7))
    with pytest.raises(ValueError, match="rank 2 out of range"):
        ContextParallelPlan.zigzag(8, 2).local_positions(2)


@st.composite
def random_plans(draw):
    cp = draw(st.integers(1, 5))
    seq_len = draw(st.integers(0, 40))
    perm = draw(st.permutations(list(range(seq_len))))
    owned = draw(st.integers(0, seq_len))
    owner = draw(st.lists(st.integers(0, cp - 1), min_size=owned, max_size=owned))
    ranks = [[p for p, o in zip(perm[:owned], owner) if o == r] for r in range(cp)]
    return ranks, seq_len


@settings(max_examples=60, deadline=None)
@given(random_plans())
def test_index_tensors_are_consistent(case):
    ranks, seq_len = case
    plan = ContextParallelPlan.from_rank_positions(ranks, seq_len=seq_len)
    slots = plan.slot_positions()
    source = plan.row_source()
    assert slots.numel() == plan.cp_size * plan.max_count and source.numel() == seq_len
    for r, positions in enumerate(ranks):
        assert plan.local_positions(r).tolist() == positions
        for i, p in enumerate(positions):
            assert slots[r * plan.max_count + i] == p
            assert source[p] == r * plan.max_count + i
    owned = {p for positions in ranks for p in positions}
    assert [p for p in range(seq_len) if source[p] < 0] == sorted(set(range(seq_len)) - owned)
