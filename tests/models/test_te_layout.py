"""The zigzag and THD plans are exactly the layouts of Megatron and TransformerEngine CP.

``TEDotProductAttention`` computes CP attention on fixed row layouts: Megatron's zigzag
(``get_batch_on_this_cp_rank``) for one sequence and TE's ``thd_get_partitioned_indices`` for
packed sequences. If ``ContextParallelPlan.zigzag`` / ``.thd`` give each rank exactly those rows,
``context_parallel_forward`` can hand the model's attention to TE for those plans.

CPU: megatron-core's own ``get_batch_on_this_cp_rank`` on a gloo CP group, and an independent
re-derivation of TE's THD split. GPU: TE's ``thd_get_partitioned_indices`` itself (skipped
where TransformerEngine or CUDA is absent).
"""

from __future__ import annotations

import _megatron_cpu as mc
import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from megatron.context_parallel.attention.rotary import rotary_at_positions
from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.models import forward as cp_model

CU_SEQLENS = [(0, 16, 24, 56), (0, 8), (0, 48, 64, 72, 112)]


def _zigzag_equals_megatron(rank, world_size):
    """Rows megatron's get_batch_on_this_cp_rank gives this rank, for CP = 2 and CP = world,
    are the zigzag plan's rows, and rotary rows at those positions are megatron's slice."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.utils import get_batch_on_this_cp_rank

    mc.cpu_current_device()
    groups = {world_size: dist.group.WORLD}
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world_size // 2)]
    groups[2] = pairs[rank // 2]
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    for cp, group in groups.items():
        for seq_len in (8 * cp, 24 * cp):
            table = rope.get_emb(seq_len)  # [S, 1, 1, D], megatron's full rotary table
            batch = {
                "tokens": torch.arange(seq_len)[None],
                "labels": torch.arange(seq_len)[None] * 10,
                "rope": table.transpose(0, 1),  # [1, S, 1, D]: sliced along dim 1 like tokens
                "cu_seqlens": None,
            }
            sliced = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
            mine = ContextParallelPlan.zigzag(seq_len, cp).local_positions(dist.get_rank(group))
            case = f"rank {rank}, CP {cp}, seq_len {seq_len}"
            assert torch.equal(sliced["tokens"][0], mine), case
            assert torch.equal(sliced["labels"][0], mine * 10), case
            # Rotary rows at source positions == megatron's CP-sliced rotary table.
            rotary = rotary_at_positions(rope, mine)
            assert torch.equal(rotary, sliced["rope"].transpose(0, 1)), case


def test_zigzag_equals_megatron_get_batch_on_this_cp_rank():
    run_distributed(_zigzag_equals_megatron, 4)


def _te_thd_reference(cu, cp, rank):
    """TE's THD split re-derived: each sequence cut in 2*cp chunks; rank r owns chunks r and
    2*cp-1-r; rows ascend (chunk r before its mirror, sequences in order)."""
    total = cu[-1]
    owner = torch.empty(total, dtype=torch.int64)
    for a, b in zip(cu[:-1], cu[1:]):
        chunk = (b - a) // (2 * cp)
        index = torch.arange(b - a) // max(chunk, 1)
        owner[a:b] = torch.where(index < cp, index, 2 * cp - 1 - index)
    return torch.nonzero(owner == rank).flatten()


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_equals_te_partitioned_indices_rederived(cp):
    for cu in CU_SEQLENS:
        plan = ContextParallelPlan.thd(cu, cp)
        for r in range(cp):
            assert torch.equal(plan.local_positions(r), _te_thd_reference(cu, cp, r)), (cu, cp, r)


def _check_te(plan, cu=None, positions=None):
    if positions is None:
        positions = cp_model.default_position_ids(plan.seq_len, cu)
    cp_model._check_plan_for_backend(
        cp_model._TE, "TEDotProductAttention", plan, cu, lambda: positions, True
    )


def test_te_backend_accepts_only_te_layouts():
    _check_te(ContextParallelPlan.zigzag(16, 2))
    _check_te(ContextParallelPlan.thd((0, 8, 24), 2), (0, 8, 24))
    with pytest.raises(ValueError, match="zigzag"):
        _check_te(ContextParallelPlan.contiguous(16, 2))
    with pytest.raises(ValueError, match="thd"):
        _check_te(cp_model.default_plan(10, 2, (0, 3, 10)), (0, 3, 10))
    uneven = ContextParallelPlan.from_rank_positions([[0, 1, 2], list(range(3, 16))])
    with pytest.raises(ValueError, match="zigzag"):
        _check_te(uneven)
    # The right layout with other position ids: megatron-core's rotary table would be wrong.
    with pytest.raises(ValueError, match="position ids"):
        _check_te(ContextParallelPlan.zigzag(16, 2), positions=torch.arange(16) + 3)


def test_te_thd_inputs_follow_megatron_thd_convention():
    cu = (0, 8, 24, 28)
    packed = cp_model._te_thd_params(cu, None, "cpu")
    assert packed.qkv_format == "thd"
    assert packed.cu_seqlens_q.dtype == torch.int32
    assert packed.cu_seqlens_q.tolist() == list(cu) == packed.cu_seqlens_kv.tolist()
    assert packed.cu_seqlens_q_padded.tolist() == list(cu)
    assert packed.max_seqlen_q == packed.max_seqlen_kv == 16


def _has_te_gpu():
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine_torch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _has_te_gpu(), reason="needs TransformerEngine and a CUDA device")
def test_thd_equals_transformer_engine_on_gpu():
    import transformer_engine_torch as tex

    for cu in CU_SEQLENS:
        cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
        for cp in (1, 2, 4):
            plan = ContextParallelPlan.thd(cu, cp)
            for r in range(cp):
                te = tex.thd_get_partitioned_indices(cu_t, cu[-1], cp, r)
                assert torch.equal(te.long().cpu(), plan.local_positions(r)), (cu, cp, r)
