"""Tree packing on a GPU: a bf16 GPTModel through the fused tree attention equals flat packing.

The tree runs at CP 1 and CP 2 (gloo ranks sharing the GPU, spawned) under the default
``tree_plan`` and a shuffled plan; the reference is every root-to-leaf path packed flat at CP 1
(the fused run tables). Per-path hidden states and per-token log-probs (``samples()``), and the
parameter gradients of a loss on the leaf segments' tokens, compare by relative error.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_distributed

from megatron.context_parallel import ContextParallelPlan, PrefixTree
from megatron.context_parallel.attention import cudnn as cudnn_kernel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cudnn_kernel.available(torch.device("cuda")),
        reason="needs a CUDA device and nvidia-cudnn-frontend",
    ),
]

PARENTS = (-1, 0, 1, 1, 0, -1, -1, 6, 6)
LENGTHS = (20, 9, 12, 1, 6, 15, 11, 1, 8)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _worker(rank, world, flat: bool, shuffled: bool):
    import _megatron_cpu as mc
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    from megatron.context_parallel.models.forward import context_parallel_forward

    torch.cuda.set_device(0)
    ps.initialize_model_parallel(context_parallel_size=world)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    model = mc.build_tiny_gpt(num_query_groups=2).cuda().bfloat16()
    tree = PrefixTree(parents=PARENTS, lengths=LENGTHS)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.TINY["vocab_size"], (tree.seq_len,), generator=g)
    segment = tree.segment_index()
    leaf_rows = torch.nonzero(torch.isin(segment, torch.tensor(tree.leaves())))[:, 0]
    w = torch.randn(leaf_rows.numel(), mc.TINY["hidden_size"], generator=g).cuda()
    paths = tree.leaf_positions()
    if flat:
        flat_pos = torch.cat(paths)
        cu = [0]
        for p in paths:
            cu.append(cu[-1] + p.numel())
        flat_ids = ids[flat_pos]
        labels = torch.full_like(flat_ids, -100)
        for a, b in zip(cu[:-1], cu[1:]):
            labels[a : b - 1] = flat_ids[a + 1 : b]
        out = context_parallel_forward(
            model, flat_ids.cuda(), labels.cuda(), cu_seqlens=cu,
            fields=("hidden_states", "target_logprobs"),
        )  # fmt: skip
        hidden = [out.hidden_states[a:b] for a, b in zip(cu[:-1], cu[1:])]
        logp = [out.target_logprobs[a:b] for a, b in zip(cu[:-1], cu[1:])]
        leaf_set = set(leaf_rows.tolist())
        where = {}
        for a, p in zip(cu[:-1], paths):
            for i, pos in enumerate(p.tolist()):
                if pos in leaf_set:
                    where[pos] = a + i
        rows = torch.tensor([where[p] for p in leaf_rows.tolist()]).cuda()
        leaf_hidden, leaf_logp = out.hidden_states[rows], out.target_logprobs[rows]
    else:
        plan = None
        if shuffled and world > 1:
            perm = torch.randperm(tree.seq_len, generator=torch.Generator().manual_seed(5))
            plan = ContextParallelPlan.from_rank_positions(
                [perm[:30].sort().values, perm[30:]], tree.seq_len
            )
        out = context_parallel_forward(
            model, ids.cuda(), tree.labels(ids).cuda(), tree=tree, plan=plan,
            fields=("hidden_states", "target_logprobs"),
        )  # fmt: skip
        samples = out.samples()
        hidden = [s.hidden_states for s in samples]
        logp = [s.target_logprobs for s in samples]
        rows = leaf_rows.cuda()
        leaf_hidden, leaf_logp = out.hidden_states[rows], out.target_logprobs[rows, 0]
    loss = (leaf_hidden.float() * w).sum() + leaf_logp.float().sum()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.float().clone() if p.grad is not None else torch.zeros_like(p).float()
        torch.distributed.all_reduce(grad, group=ps.get_context_parallel_group())
        grads[name] = grad.cpu().numpy()
    return {
        "hidden": [h.detach().float().cpu().numpy() for h in hidden],
        "logp": [lp.detach().float().cpu().numpy() for lp in logp],
        "grads": grads,
    }


@pytest.mark.parametrize("world,shuffled", [(1, False), (2, False), (2, True)])
def test_tree_matches_flat_paths_on_a_gpu(world, shuffled):
    ref = run_distributed(_worker, 1, True, False, start_method="spawn", timeout=300)[0]
    got = run_distributed(_worker, world, False, shuffled, start_method="spawn", timeout=300)
    t = torch.from_numpy
    for out in got:
        for h, h_ref in zip(out["hidden"], ref["hidden"], strict=True):
            assert _rel(t(h), t(h_ref)) < 2e-2
        for lp, lp_ref in zip(out["logp"], ref["logp"], strict=True):
            assert _rel(t(lp), t(lp_ref)) < 2e-2
        for name, g in ref["grads"].items():
            assert _rel(t(out["grads"][name]), t(g)) < 5e-2, name
