"""The fused tree attention on a GPU (cuDNN) against a float64 oracle from positions alone.

Trees of a prompt with completions and of depth 3, at CP 1, under the default ``tree_plan``,
contiguous blocks and shuffled rows with an empty rank, with the diagonal bottom-right and
(``CudnnOptions.square_top_left``) top-left on all-square calls; bf16 and fp16 compare by
relative error (norm of the difference over the norm of the reference), output and every
gradient.
"""

from __future__ import annotations

import pytest
import torch

from megatron.context_parallel import ContextParallelPlan, PrefixTree, tree_plan
from megatron.context_parallel.attention import cudnn as cudnn_kernel
from megatron.context_parallel.attention.fused import fused_attention
from megatron.context_parallel.attention.tree_tables import TreeTables

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cudnn_kernel.available(torch.device("cuda")),
        reason="needs a CUDA device and nvidia-cudnn-frontend",
    ),
]

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}

TREES = {
    "grpo": PrefixTree(parents=(-1,) + (0,) * 8, lengths=(700,) + (90, 130, 1, 77, 256, 64, 3, 40)),
    "deep": PrefixTree(
        parents=(-1, 0, 1, 1, 0, -1, -1, 6, 6, 2),
        lengths=(300, 120, 200, 1, 64, 150, 90, 1, 33, 70),
    ),
}


def _plans(tree: PrefixTree, g: torch.Generator):
    yield "contiguous_cp1", ContextParallelPlan.contiguous(tree.seq_len, 1)
    yield "tree_plan_cp2", tree_plan(tree, 2)
    yield "contiguous_cp3", ContextParallelPlan.contiguous(tree.seq_len, 3)
    perm = torch.randperm(tree.seq_len, generator=g)
    half = tree.seq_len // 2
    yield "shuffled_empty", ContextParallelPlan.from_rank_positions(
        [perm[:half].sort().values, [], perm[half:]], tree.seq_len
    )


def _slots(full, plan):
    out = full.new_zeros((plan.cp_size * plan.max_count,) + tuple(full.shape[1:]))
    slot = plan.slot_positions(full.device)
    out[slot >= 0] = full[slot[slot >= 0]]
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _oracle(query, kv, positions, tree, scale, dim):
    heads, groups = query.shape[1], kv.shape[1]
    k = kv[..., :dim].double().repeat_interleave(heads // groups, dim=1)
    v = kv[..., dim:].double().repeat_interleave(heads // groups, dim=1)
    allowed = tree.visible(positions, torch.arange(kv.shape[0], device=kv.device))
    scores = torch.einsum("nhd,shd->hns", query.double(), k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("top_left", [False, True], ids=["bottom_right", "square_top_left"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(TREES))
def test_tree_attention_matches_the_oracle(name, dtype, top_left):
    """``square_top_left``: calls whose causal entries are all square (the own part at CP 1)
    align the diagonal top-left, which must be the same mask."""
    tree = TREES[name]
    kernel = cudnn_kernel.CudnnKernel(cudnn_kernel.CudnnOptions(square_top_left=top_left))
    g = torch.Generator().manual_seed(0)
    heads, groups, dim = 8, 2, 64
    dev = torch.device("cuda")
    q_full = torch.randn(tree.seq_len, heads, dim, generator=g).to(dev, dtype)
    kv_full = torch.randn(tree.seq_len, groups, 2 * dim, generator=g).to(dev, dtype)
    weight = torch.randn(tree.seq_len, heads, dim, generator=g).to(dev, torch.float64)
    scale = dim**-0.5
    failures = []
    for plan_name, plan in _plans(tree, g):
        for rank in range(plan.cp_size):
            pos = plan.local_positions(rank).to(dev)
            if pos.numel() == 0:
                continue
            tables = TreeTables.build(plan, rank, tree)
            query = q_full[pos].clone().requires_grad_()
            kv_slots = _slots(kv_full, plan).requires_grad_()
            out = fused_attention(query, kv_slots, tables, scale, kernel=kernel)
            (out.double() * weight[pos]).sum().backward()
            q_ref = q_full[pos].double().requires_grad_()
            kv_ref = kv_full.double().requires_grad_()
            expected = _oracle(q_ref, kv_ref, pos, tree, scale, dim)
            (expected * weight[pos]).sum().backward()
            errors = {
                "out": _rel(out, expected),
                "dq": _rel(query.grad, q_ref.grad),
                "dkv": _rel(kv_slots.grad, _slots(kv_ref.grad, plan)),
            }
            for what, err in errors.items():
                if not err <= TOL[dtype]:
                    failures.append(f"{plan_name} rank {rank} {what}: {err:.2e}")
    assert not failures, "\n".join(failures)
