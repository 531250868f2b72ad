"""Tree packing end to end: a tree-packed batch under any CP plan equals flat packing of its paths.

The bar is exact equivalence with flat packing: every root-to-leaf path of a ``PrefixTree``,
packed flat (one sequence per path) and run at CP 1, is the reference. The tree runs at CP 1, 2,
3 and 4 under random plans (an empty rank, shuffled rows) and the default ``tree_plan``; the
hidden states at every path position, every next-token log-prob (through ``samples()``), the
top-k and the parameter gradients of a loss on the leaf segments' tokens (each of which lies on
exactly one path, so both losses count it once) must agree within 1e-5 in fp32. The models are
a GPTModel from the package's layer spec and a HybridModel with ``G``, ``*`` and ``-`` layers.
"""

from __future__ import annotations

import time

import _megatron_cpu as mc
import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from megatron.context_parallel import (
    ContextParallelPlan,
    InputError,
    PrefixTree,
    context_parallel_forward,
    tree_plan,
)

TOP_K = 3
ATOL = 1e-5
GRAD_RTOL = 1e-5
FIELDS = ("hidden_states", "target_logprobs", "top_k")

# Depth 3 (0 -> 1 -> 2), several roots, one-token leaves (3, 7), a root without children (5),
# a fork with two children at two levels.
PARENTS = (-1, 0, 1, 1, 0, -1, -1, 6, 6)
LENGTHS = (5, 3, 4, 1, 2, 6, 4, 1, 3)
HYBRID = "G*-G*"


def _tree() -> PrefixTree:
    return PrefixTree(parents=PARENTS, lengths=LENGTHS)


def _batch(seed: int = 0):
    tree = _tree()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, mc.TINY["vocab_size"], (tree.seq_len,), generator=g)
    return tree, ids, tree.labels(ids)


def _plans(tree: PrefixTree, cp: int, seed: int):
    """Named plans of the tree at CP ``cp``: the default, shuffled rows with an empty rank."""
    plans = {"default": None, "tree_plan": tree_plan(tree, cp)}
    if cp > 1:
        g = torch.Generator().manual_seed(100 + seed)
        order = torch.randperm(tree.seq_len, generator=g)
        cuts = sorted(torch.randint(0, tree.seq_len + 1, (cp - 2,), generator=g).tolist())
        bounds = [0] + cuts + [tree.seq_len]
        shards = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        shards.insert(int(torch.randint(0, cp, (1,), generator=g)), order[:0])
        plans["shuffled_with_empty_rank"] = ContextParallelPlan.from_rank_positions(
            shards, tree.seq_len
        )
    return plans


def _leaf_rows(tree: PrefixTree) -> torch.Tensor:
    """Source positions of the leaf segments (each on exactly one path)."""
    segment = tree.segment_index()
    leaves = torch.tensor(tree.leaves())
    return torch.nonzero(torch.isin(segment, leaves))[:, 0]


def _weights(n: int, seed: int):
    g = torch.Generator().manual_seed(7_000 + seed)
    return torch.randn(n, mc.TINY["hidden_size"], generator=g), torch.randn(n, generator=g)


def _flat_reference(tree, ids, model_kw, seed):
    """Every path packed flat at CP 1: per-path fields and the gradients of the leaf loss."""
    paths = tree.leaf_positions()
    flat = torch.cat(paths)
    cu = [0]
    for path in paths:
        cu.append(cu[-1] + path.numel())
    flat_ids = ids[flat]
    flat_labels = torch.full_like(flat_ids, -100)
    for a, b in zip(cu[:-1], cu[1:]):
        flat_labels[a : b - 1] = flat_ids[a + 1 : b]
    model = mc.build_tiny_gpt(**model_kw)
    out = context_parallel_forward(
        model, flat_ids, flat_labels, cu_seqlens=cu, fields=FIELDS, top_k=TOP_K
    )
    # The leaf segments' rows of the flat packing, in the order of _leaf_rows (source order).
    leaf_rows = _leaf_rows(tree)
    where = {}
    for a, path in zip(cu[:-1], paths):
        for i, p in enumerate(path.tolist()):
            if p in set(leaf_rows.tolist()):
                where[p] = a + i
    flat_leaf = torch.tensor([where[p] for p in leaf_rows.tolist()])
    w_hidden, w_logprob = _weights(leaf_rows.numel(), seed)
    loss = (out.hidden_states[flat_leaf] * w_hidden).sum() + (
        out.target_logprobs[flat_leaf] * w_logprob
    ).sum()
    loss.backward()
    samples = [
        dict(
            hidden=out.hidden_states[a:b].detach(),
            logprobs=out.target_logprobs[a:b].detach(),
            top=out.top_k.logprobs[a:b].detach(),
            top_ids=out.top_k.tokens[a:b],
        )
        for a, b in zip(cu[:-1], cu[1:])
    ]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return samples, grads


def _tree_run(tree, ids, labels, plan, model_kw, seed):
    from megatron.core import parallel_state as ps

    model = mc.build_tiny_gpt(**model_kw)
    out = context_parallel_forward(
        model, ids, labels, tree=tree, plan=plan, fields=FIELDS, top_k=TOP_K
    )
    leaf_rows = _leaf_rows(tree)
    w_hidden, w_logprob = _weights(leaf_rows.numel(), seed)
    # Inside a leaf segment the next token is column 0.
    loss = (out.hidden_states[leaf_rows] * w_hidden).sum() + (
        out.target_logprobs[leaf_rows, 0] * w_logprob
    ).sum()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g, group=ps.get_context_parallel_group())
        grads[name] = g
    return out, grads


def _errors(out, samples, grads, ref_grads) -> dict:
    errors = {"hidden": 0.0, "logprobs": 0.0, "top_k": 0.0, "grads": 0.0}
    top_ids_equal = True
    for sample, ref in zip(out.samples(), samples, strict=True):
        errors["hidden"] = max(
            errors["hidden"], (sample.hidden_states - ref["hidden"]).abs().max().item()
        )
        errors["logprobs"] = max(
            errors["logprobs"], (sample.target_logprobs - ref["logprobs"]).abs().max().item()
        )
        errors["top_k"] = max(
            errors["top_k"], (sample.top_k.logprobs - ref["top"]).abs().max().item()
        )
        top_ids_equal &= bool(torch.equal(sample.top_k.tokens, ref["top_ids"]))
    for name, g in ref_grads.items():
        scale = 1.0 + g.abs().max().item()
        errors["grads"] = max(errors["grads"], (grads[name] - g).abs().max().item() / scale)
    errors["top_k_tokens_equal"] = top_ids_equal
    return errors


def _world(rank, world_size, model_kw, sizes):
    """Flat references at CP 1 (this rank alone), then the tree at each CP size in ``sizes``."""
    tree, ids, labels = _batch()
    mc.init_parallel(1, 1)
    samples, ref_grads = _flat_reference(tree, ids, model_kw, seed=0)
    results = {}
    for cp in sizes:
        if world_size % cp:
            continue
        mc.init_parallel(1, cp)
        for name, plan in _plans(tree, cp, seed=cp).items():
            out, grads = _tree_run(tree, ids, labels, plan, model_kw, seed=0)
            results[f"cp{cp}-{name}"] = _errors(out, samples, grads, ref_grads)
    return results


def _check(per_rank):
    failures = []
    for rank, results in enumerate(per_rank):
        for case, errors in results.items():
            for key, value in errors.items():
                limit = GRAD_RTOL if key == "grads" else ATOL
                ok = value if isinstance(value, bool) else value <= limit
                if not ok:
                    failures.append(f"rank {rank} {case}: {key} = {value}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gpt_tree_equals_flat_paths(world):
    # CP 1 runs in every world (each rank alone); CP = world covers 2, 3 and 4.
    _check(run_distributed(_world, world, {}, (1, world)))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_hybrid_gdn_tree_equals_flat_paths(world):
    pytest.importorskip("fla", reason="megatron-core builds GatedDeltaNet only with fla")
    _check(run_distributed(_world, world, {"pattern": HYBRID}, (1, world)))


def _bad_tree(rank, world_size):
    """One rank's tree does not fit the batch, or the ranks' trees differ: every rank raises."""
    mc.init_parallel(1, world_size)
    model = mc.build_tiny_gpt()
    tree, ids, labels = _batch()
    outcomes = []
    short = PrefixTree(parents=(-1, 0), lengths=(3, tree.seq_len - 4))
    other = PrefixTree(parents=(-1, 0, 0), lengths=(5, 10, tree.seq_len - 15))
    for bad in (short, other):
        mine = bad if rank == world_size - 1 else tree
        start = time.monotonic()
        try:
            context_parallel_forward(model, ids, tree=mine)
            outcomes.append(("no error", 0.0))
        except (ValueError, InputError) as exc:
            outcomes.append((type(exc).__name__, time.monotonic() - start))
    # A good call afterwards still runs.
    out = context_parallel_forward(model, ids, labels, tree=tree)
    outcomes.append((tuple(out.hidden_states.shape), 0.0))
    return outcomes


def test_bad_tree_raises_on_every_rank():
    for outcomes in run_distributed(_bad_tree, 3):
        for kind, seconds in outcomes[:2]:
            assert kind in ("ValueError", "InputError"), outcomes
            assert seconds < 10, outcomes
        assert outcomes[2][0] == (sum(LENGTHS), mc.TINY["hidden_size"])


def test_invalid_trees_name_the_segment():
    with pytest.raises(ValueError, match="segment 2"):
        PrefixTree(parents=(-1, 0, 3, 0), lengths=(2, 2, 2, 2))
    with pytest.raises(ValueError, match="segment 1"):
        PrefixTree(parents=(-1, 0), lengths=(2, 0))
