"""The output head on CUDA tensors (the fused vocab ops) against the same head on the CPU.

The CPU path is exact fp32 on upcast inputs; the GPU's tensor cores accumulate the logits in
non-IEEE fp32 (``vocab_ops`` docstring: about 4e-5 on logits of magnitude 8 at H = 5,120), so
computed values compare within that, gradients within bf16 rounding, and data movement
(hidden states, top-k ids where the top-k values are clearly apart) exactly.

TP 2 x CP 2 runs as four gloo ranks sharing the GPU (spawned: CUDA does not survive a fork).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from megatron.context_parallel import ContextParallelPlan, compute_forward_output

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

S, H, V, K = 300, 256, 1000, 8


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(S, H, generator=g) / 4).bfloat16()
    weight = (torch.randn(V, H, generator=g) / 4).bfloat16()
    labels = torch.randint(0, V, (S,), generator=g)
    labels[::7] = -100
    c_target = torch.randn(S, generator=g)
    c_top = torch.randn(S, K, generator=g)
    return hidden, weight, labels, c_target, c_top


def _run(hidden, weight, labels, c_target, c_top, plan, cp_group, tp_group, rank_rows, vocab_rows):
    """Forward and backward of one rank on ``hidden.device``; outputs and grads on the CPU."""
    device = hidden.device
    h = hidden[rank_rows].clone().requires_grad_(True)
    w = weight[vocab_rows].clone().requires_grad_(True)
    out = compute_forward_output(
        h,
        w,
        plan,
        labels=labels.to(device),
        fields=("hidden_states", "target_logprobs", "top_k"),
        top_k=K,
        cp_group=cp_group,
        tp_group=tp_group,
    )
    loss = (out.target_logprobs * c_target.to(device)).sum()
    loss = loss + (out.top_k.logprobs * c_top.to(device)).sum()
    loss.backward()
    return {
        "hidden": out.hidden_states.detach().cpu(),
        "target": out.target_logprobs.detach().cpu(),
        "top_values": out.top_k.logprobs.detach().cpu(),
        "top_ids": out.top_k.tokens.cpu(),
        "grad_h": h.grad.float().cpu(),
        "grad_w": w.grad.float().cpu(),
    }


def _compare(gpu: dict, cpu: dict) -> None:
    assert torch.equal(gpu["hidden"], cpu["hidden"])
    torch.testing.assert_close(gpu["target"], cpu["target"], atol=2e-4, rtol=0)
    torch.testing.assert_close(gpu["top_values"], cpu["top_values"], atol=2e-4, rtol=0)
    values = cpu["top_values"]
    apart = torch.ones_like(values, dtype=torch.bool)
    apart[:, 1:] &= (values[:, :-1] - values[:, 1:]) > 1e-3
    apart[:, :-1] &= (values[:, :-1] - values[:, 1:]) > 1e-3
    assert torch.equal(gpu["top_ids"][apart], cpu["top_ids"][apart])
    for name in ("grad_h", "grad_w"):
        error = (gpu[name] - cpu[name]).norm() / cpu[name].norm()
        assert error < 1e-2, (name, float(error))


def test_single_rank_cuda_matches_cpu():
    hidden, weight, labels, c_target, c_top = _case()
    plan = ContextParallelPlan.contiguous(S, 1)
    rows, vocab = slice(None), slice(None)
    cpu = _run(hidden, weight, labels, c_target, c_top, plan, None, None, rows, vocab)
    gpu = _run(hidden.cuda(), weight.cuda(), labels, c_target, c_top, plan, None, None, rows, vocab)
    _compare(gpu, cpu)


def _tp2_cp2(rank, world_size, device):
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, cp_group = tp_groups[rank // 2], cp_groups[rank % 2]
    tp_rank, cp_rank = rank % 2, rank // 2
    hidden, weight, labels, c_target, c_top = _case(1)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(2))
    plan = ContextParallelPlan.from_rank_positions([perm[:170], perm[170:]], S)
    shard = V // 2
    if device == "cuda":
        hidden, weight = hidden.cuda(), weight.cuda()
    return _run(
        hidden,
        weight,
        labels,
        c_target,
        c_top,
        plan,
        cp_group,
        tp_group,
        plan.local_positions(cp_rank),
        slice(tp_rank * shard, (tp_rank + 1) * shard),
    )


def test_tp2_cp2_cuda_over_gloo_matches_cpu():
    cpu = run_distributed(_tp2_cp2, 4, "cpu", start_method="spawn", timeout=300)
    gpu = run_distributed(_tp2_cp2, 4, "cuda", start_method="spawn", timeout=300)
    for g, c in zip(gpu, cpu):
        _compare(g, c)
