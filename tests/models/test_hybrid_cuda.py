"""A HybridModel under CP on CUDA (the head's fused kernels) against the same run on the CPU.

The tiny dense hybrid (``*-*-``, fp32) runs at CP 1 and at CP 2 (two gloo ranks sharing the
GPU, spawned: CUDA does not survive a fork) with an uneven shuffled plan, once with CPU
tensors and once with CUDA tensors. Hidden states come from torch's fp32 matmuls on both
(TF32 off, torch's default); the log-probs on CUDA from the fused vocab kernels, whose fp32
accumulation differs from IEEE adds in the last bits (README, "Performance").
"""

from __future__ import annotations

import _megatron_cpu as mc
import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from megatron.context_parallel import ContextParallelPlan, context_parallel_forward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SEQ_LEN = 40


def _run(rank, world_size, device):
    mc.init_parallel(1, world_size)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, mc.TINY["vocab_size"], (SEQ_LEN,), generator=g)
    labels = torch.randint(0, mc.TINY["vocab_size"], (SEQ_LEN,), generator=g)
    order = torch.randperm(SEQ_LEN, generator=g)
    shards = [order] if world_size == 1 else [order[:26], order[26:]]
    plan = ContextParallelPlan.from_rank_positions(shards, SEQ_LEN, (0, 15, 40))
    model = mc.build_tiny_gpt(pattern="*-*-").to(device)
    out = context_parallel_forward(
        model,
        ids.to(device),
        labels.to(device),
        plan=plan,
        fields=("hidden_states", "target_logprobs"),
    )
    weights = torch.randn(SEQ_LEN, generator=g).to(device)
    ((out.target_logprobs * weights).sum() + out.hidden_states.square().mean()).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.detach().cpu()
        dist.all_reduce(grad)
        grads[name] = grad.numpy()
    # numpy arrays: they pickle by value (tensors would go through shared memory whose
    # sender may have exited before the parent reads them).
    return {
        "hidden": out.hidden_states.detach().cpu().numpy(),
        "target": out.target_logprobs.detach().cpu().numpy(),
        "grads": grads,
    }


def test_hybrid_cp2_cuda_matches_cpu_and_cp1():
    results = {
        (cp, device): run_distributed(_run, cp, device, start_method="spawn", timeout=300)[0]
        for cp in (1, 2)
        for device in ("cpu", "cuda")
    }
    reference = results[(1, "cpu")]
    for key, result in results.items():
        for field, atol in (("hidden", 1e-4), ("target", 1e-3)):
            error = abs(result[field] - reference[field]).max()
            assert error <= atol, (key, field, float(error))
        for name, grad in reference["grads"].items():
            error = ((result["grads"][name] - grad) ** 2).sum() ** 0.5 / (
                (grad**2).sum() ** 0.5 + 1e-12
            )
            assert error < 1e-3, (key, name, float(error))
