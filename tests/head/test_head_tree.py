"""Tests of the head's tree outputs: ``[S, K]`` labels, ``fork_positions`` and ``samples()``.

Distributed checks run in one forked 4-rank gloo pool (CPU, fp32) that builds its own TP x CP
grids: CP 1, 2, 3 (an empty middle rank), 4 (an empty rank), and TP 2 x CP 2, every plan with
shuffled rows. References are independent single-device fp64 torch on the full sequence:
``log_softmax(h @ W.T)`` gathered per label column, and for ``samples()`` the flat next-token
log-probs of each root-to-leaf path, read straight from the path's token ids.

Inputs are small dyadic rationals (as in ``test_output.py``), so logits are exact whatever the
summation order: gathered data must match bit for bit, computed log-probs within fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import DistributedPool

from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.head.output import ForwardOutput, compute_forward_output
from megatron.context_parallel.tree import PrefixTree

H, V = 16, 48
TOL = dict(atol=2e-5, rtol=2e-5)

# A forest: segment 0 forks three ways, segments 1 and 6 two ways; K = 3, S = 40.
PARENTS = (-1, 0, 0, 0, 1, 1, -1, 6, 6, 2)
LENGTHS = (5, 4, 3, 2, 3, 4, 6, 3, 4, 6)


def _tree() -> PrefixTree:
    return PrefixTree(PARENTS, LENGTHS)


def _make_case(seed: int, tree: PrefixTree, extra_ignored: bool = True) -> dict:
    """Hidden [S, H], weight [V, H], token ids, the tree's [S, K] labels, loss coefficients."""
    S = tree.seq_len
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-8, 9, (S, H), generator=g).float() / 8
    weight = torch.randint(-1024, 1025, (V, H), generator=g).float() / 1024
    ids = torch.randint(0, V, (S,), generator=g)
    labels = tree.labels(ids)
    if extra_ignored:
        # Some ignored targets inside segments and at a fork (column 0 of the first fork).
        labels[1, 0] = -100
        labels[12, 0] = -100
        labels[int(tree.fork_positions()[0]), 0] = -100
    return dict(
        hidden=hidden,
        weight=weight,
        ids=ids,
        labels=labels,
        c_target=torch.randn(S, labels.shape[1], generator=g),
        c_top=torch.randn(S, 4, generator=g),
    )


def _reference(case: dict):
    """fp64 target log-probs [S, K] (0 where -100) and the gradients of the all-column loss."""
    h = case["hidden"].double().requires_grad_(True)
    w = case["weight"].double().requires_grad_(True)
    logp = torch.log_softmax(h @ w.t(), dim=-1)
    labels = case["labels"]
    target = logp.gather(1, labels.clamp(min=0))
    target = torch.where(labels == -100, 0.0, target)
    gh, gw = torch.autograd.grad((target * case["c_target"].double()).sum(), [h, w])
    return target.float().detach(), gh.float(), gw.float()


def _plan(S: int, cp: int, seed: int, empty: int = -1) -> ContextParallelPlan:
    """A random plan of shuffled rows over ``cp`` ranks, rank ``empty`` owning nothing."""
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(seed))
    owners = [r for r in range(cp) if r != empty]
    cuts = torch.linspace(0, S, len(owners) + 1).round().long().tolist()
    pieces = {r: perm[cuts[i] : cuts[i + 1]] for i, r in enumerate(owners)}
    return ContextParallelPlan.from_rank_positions([pieces.get(r, perm[:0]) for r in range(cp)], S)


# ---------------------------------------------------------------------------------------------
# One configuration on the calling rank.


def _local_inputs(case, plan, cp_group, tp_group):
    cp_rank, tp_rank = dist.get_rank(cp_group), dist.get_rank(tp_group)
    tp_size = dist.get_world_size(tp_group)
    positions = plan.local_positions(cp_rank)
    shard = V // tp_size
    vocab_rows = slice(tp_rank * shard, (tp_rank + 1) * shard)
    h_local = case["hidden"][positions].clone().requires_grad_(True)
    w_local = case["weight"][vocab_rows].clone().requires_grad_(True)
    return h_local, w_local, positions, vocab_rows


def _check_config(tag: str, plan, cp_group, tp_group, case, tree) -> None:
    """[S, K] values and all-column gradients vs the reference; fork sources agree exactly."""
    h_local, w_local, positions, vocab_rows = _local_inputs(case, plan, cp_group, tp_group)
    kw = dict(cp_group=cp_group, tp_group=tp_group, chunk_size=3)
    out = compute_forward_output(
        h_local,
        w_local,
        plan,
        labels=case["labels"],
        fork_positions=tree.fork_positions(),
        fields=("target_logprobs", "top_k"),
        top_k=4,
        **kw,
    )
    want, want_h, want_w = _reference(case)
    owned = plan.owned_mask()[:, None]
    want = torch.where(owned, want, 0.0)
    got = out.target_logprobs
    assert got.dtype == torch.float32 and got.shape == case["labels"].shape, tag
    torch.testing.assert_close(got, want, **TOL, msg=tag)
    ignored = case["labels"] == -100
    assert torch.equal(got[ignored], torch.zeros(int(ignored.sum()))), tag
    assert out.top_k.logprobs.shape == (tree.seq_len, 4), tag  # one distribution per row

    loss = (got * case["c_target"]).sum()
    gh, gw = torch.autograd.grad(loss, [h_local, w_local])
    gw = gw.clone()
    dist.all_reduce(gw, group=cp_group)  # what Megatron's DDP does over DP x CP
    torch.testing.assert_close(gh, want_h[positions], **TOL, msg=f"{tag} hidden grad")
    torch.testing.assert_close(gw, want_w[vocab_rows], **TOL, msg=f"{tag} weight grad")

    # fork_positions derived from the labels, or taken from the tree: the same numbers.
    for variant in (dict(), dict(tree=tree)):
        other = compute_forward_output(
            h_local.detach(),
            w_local.detach(),
            plan,
            labels=case["labels"],
            fields="target_logprobs",
            **variant,
            **kw,
        )
        assert torch.equal(other.target_logprobs, got.detach()), (tag, variant)
        assert other.tree is variant.get("tree"), tag


# ---------------------------------------------------------------------------------------------
# Distributed cases (every rank runs the case; groups built once per worker, same order).

_GROUPS: dict = {}


def _groups(rank: int) -> dict:
    if not _GROUPS:
        world = dist.new_group([0, 1, 2, 3])
        singles = [dist.new_group([r]) for r in range(4)]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        triple = dist.new_group([0, 1, 2])
        cp2 = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _GROUPS.update(
            world=world,
            me=singles[rank],
            pair=pairs[rank // 2],  # CP 2 (TP 1) on {0, 1} and {2, 3}; also TP 2's group
            triple=triple if rank < 3 else None,
            cp2=cp2[rank % 2],  # TP 2 x CP 2: tp_rank = rank % 2, cp_rank = rank // 2
        )
    return _GROUPS


def _case_cp1(rank, world_size):
    g, tree = _groups(rank), _tree()
    case = _make_case(rank, tree)
    _check_config("cp1", _plan(tree.seq_len, 1, rank), g["me"], g["me"], case, tree)


def _case_cp2(rank, world_size):
    g, tree = _groups(rank), _tree()
    case = _make_case(10 + rank // 2, tree)
    _check_config("cp2", _plan(tree.seq_len, 2, 5), g["pair"], g["me"], case, tree)


def _case_cp3_empty_rank(rank, world_size):
    g, tree = _groups(rank), _tree()
    if rank < 3:
        case = _make_case(20, tree)
        plan = _plan(tree.seq_len, 3, 6, empty=1)
        _check_config("cp3-empty", plan, g["triple"], g["me"], case, tree)


def _case_cp4_empty_rank(rank, world_size):
    g, tree = _groups(rank), _tree()
    case = _make_case(30, tree, extra_ignored=False)
    plan = _plan(tree.seq_len, 4, 7, empty=2)
    _check_config("cp4-empty", plan, g["world"], g["me"], case, tree)


def _case_tp2_cp2(rank, world_size, empty):
    g, tree = _groups(rank), _tree()
    case = _make_case(40, tree)
    plan = _plan(tree.seq_len, 2, 8, empty=1 if empty else -1)
    _check_config(f"tp2xcp2-empty{empty}", plan, g["cp2"], g["pair"], case, tree)


def _case_ranks_differ(rank, world_size, what):
    """One rank's call differs (K, or its fork positions): every rank raises, then goes on."""
    g, tree = _groups(rank), _tree()
    case = _make_case(50, tree)
    if what.startswith("tp2"):
        plan = _plan(tree.seq_len, 2, 9)
        cp_group, tp_group, odd = g["cp2"], g["pair"], rank == 3  # tp_rank 1 of cp_rank 1
    else:
        plan = _plan(tree.seq_len, 4, 9)
        cp_group, tp_group, odd = g["world"], g["me"], rank == 2
    h_local, w_local, _, _ = _local_inputs(case, plan, cp_group, tp_group)
    labels, forks = case["labels"], tree.fork_positions()
    if odd and what.endswith("K"):
        labels = labels[:, :2]
    if odd and what.endswith("forks"):
        forks = forks[1:]
    kw = dict(fields="target_logprobs", cp_group=cp_group, tp_group=tp_group)
    with pytest.raises(ValueError, match="differ"):
        compute_forward_output(h_local, w_local, plan, labels=labels, fork_positions=forks, **kw)
    # The groups are still in step afterwards.
    out = compute_forward_output(h_local, w_local, plan, labels=case["labels"], **kw)
    want = torch.where(plan.owned_mask()[:, None], _reference(case)[0], 0.0)
    torch.testing.assert_close(out.target_logprobs, want, **TOL)


# A hand tree for samples(): root 0 (3 rows) forks into 1 (2 rows) and 2 (2 rows); 1 forks into
# 3 (1 row) and 4 (2 rows); a second root 5 (3 rows) has no children. Paths (source positions):
#   leaf 2: 0 1 2 5 6        leaf 3: 0 1 2 3 4 7      leaf 4: 0 1 2 3 4 8 9      leaf 5: 10 11 12
HAND_PARENTS = (-1, 0, 0, 1, 1, -1)
HAND_LENGTHS = (3, 2, 2, 1, 2, 3)
HAND_PATHS = [[0, 1, 2, 5, 6], [0, 1, 2, 3, 4, 7], [0, 1, 2, 3, 4, 8, 9], [10, 11, 12]]


def _sample_reference(case: dict, coefficients):
    """Per path: fp64 flat next-token log-probs [L] (0 at the last row), and loss gradients."""
    h = case["hidden"].double().requires_grad_(True)
    w = case["weight"].double().requires_grad_(True)
    values, loss = [], 0.0
    for path, c in zip(HAND_PATHS, coefficients, strict=True):
        p = torch.tensor(path)
        logp = torch.log_softmax(h[p] @ w.t(), dim=-1)
        nxt = case["ids"][p][1:]
        lp = torch.cat([logp[:-1].gather(1, nxt[:, None]).squeeze(1), logp.new_zeros(1)])
        values.append(lp)
        loss = loss + (lp * c.double()).sum()
    gh, gw = torch.autograd.grad(loss, [h, w])
    return [v.float().detach() for v in values], gh.float(), gw.float()


def _case_samples(rank, world_size):
    g = _groups(rank)
    tree = PrefixTree(HAND_PARENTS, HAND_LENGTHS)
    assert [p.tolist() for p in tree.leaf_positions()] == HAND_PATHS
    case = _make_case(60, tree, extra_ignored=False)
    plan = _plan(tree.seq_len, 2, 11)
    h_local, w_local, positions, _ = _local_inputs(case, plan, g["pair"], g["me"])
    out = compute_forward_output(
        h_local,
        w_local,
        plan,
        labels=case["labels"],
        tree=tree,
        fields=("hidden_states", "target_logprobs", "top_k", "logits"),
        top_k=3,
        cp_group=g["pair"],
        tp_group=g["me"],
    )
    assert out.tree is tree
    samples = out.samples()
    assert len(samples) == len(HAND_PATHS)
    coefficients = [
        torch.randn(len(p), generator=torch.Generator().manual_seed(i))
        for i, p in enumerate(HAND_PATHS)
    ]
    want, want_h, want_w = _sample_reference(case, coefficients)
    logits = case["hidden"] @ case["weight"].t()
    top = torch.log_softmax(logits.double(), -1).topk(3)
    for sample, path, lp in zip(samples, HAND_PATHS, want, strict=True):
        assert isinstance(sample, ForwardOutput) and sample.tree is None
        assert torch.equal(sample.hidden_states, case["hidden"][path])
        assert torch.equal(sample.logits, logits[path])
        assert torch.equal(sample.top_k.tokens, top.indices[path])
        torch.testing.assert_close(sample.top_k.logprobs, top.values[path].float(), **TOL)
        assert sample.target_logprobs.shape == (len(path),)
        torch.testing.assert_close(sample.target_logprobs, lp, **TOL)
    loss = sum((s.target_logprobs * c).sum() for s, c in zip(samples, coefficients, strict=True))
    gh, gw = torch.autograd.grad(loss, [h_local, w_local])
    gw = gw.clone()
    dist.all_reduce(gw, group=g["pair"])
    torch.testing.assert_close(gh, want_h[positions], **TOL)
    torch.testing.assert_close(gw, want_w, **TOL)

    # [S] labels (column 0 only): samples read target_logprobs[path].
    flat = compute_forward_output(
        h_local.detach(),
        w_local.detach(),
        plan,
        labels=case["labels"][:, 0],
        tree=tree,
        fields="target_logprobs",
        cp_group=g["pair"],
        tp_group=g["me"],
    )
    for sample, path in zip(flat.samples(), HAND_PATHS, strict=True):
        assert torch.equal(sample.target_logprobs, flat.target_logprobs[path])

    # Rank-local logits cannot be split by source position.
    local = compute_forward_output(
        h_local.detach(),
        w_local.detach(),
        plan,
        tree=tree,
        fields="logits",
        gather_logits=False,
        cp_group=g["pair"],
        tp_group=g["me"],
    )
    with pytest.raises(ValueError, match="rank-local"):
        local.samples()


# ---------------------------------------------------------------------------------------------
# Tests.


@pytest.fixture(scope="module")
def pool():
    ranks = DistributedPool(4)
    yield ranks
    ranks.close()


def test_multi_target_cp1(pool):
    pool.run(_case_cp1)


def test_multi_target_cp2(pool):
    pool.run(_case_cp2)


def test_multi_target_cp3_empty_middle_rank(pool):
    pool.run(_case_cp3_empty_rank)


def test_multi_target_cp4_empty_rank(pool):
    pool.run(_case_cp4_empty_rank)


@pytest.mark.parametrize("empty", [False, True])
def test_multi_target_tp2_cp2(pool, empty):
    pool.run(_case_tp2_cp2, empty)


@pytest.mark.parametrize("what", ["cp4-K", "cp4-forks", "tp2-K", "tp2-forks"])
def test_ranks_that_differ_raise_on_every_rank(pool, what):
    pool.run(_case_ranks_differ, what)


def test_samples_per_path_match_reference(pool):
    pool.run(_case_samples)


def test_samples_without_tree_are_sequences():
    tree = _tree()
    case = _make_case(70, tree)
    plan = ContextParallelPlan.thd([0, 14, 40], 1)
    out = compute_forward_output(
        case["hidden"], case["weight"], plan, labels=case["labels"], fields="target_logprobs"
    )
    assert out.tree is None
    pieces = out.samples()
    assert [p.target_logprobs.shape for p in pieces] == [(14, 3), (26, 3)]
    assert torch.equal(pieces[1].target_logprobs, out.target_logprobs[14:])


def test_multi_target_single_rank_details():
    """No distributed job: K = 1, rows outside fork_positions, and bad input."""
    tree = _tree()
    case = _make_case(80, tree)
    S, labels = tree.seq_len, case["labels"]
    plan = ContextParallelPlan.contiguous(S, 1)
    h, w = case["hidden"], case["weight"]
    want = _reference(case)[0]

    one = compute_forward_output(h, w, plan, labels=labels[:, :1], fields="target_logprobs")
    assert one.target_logprobs.shape == (S, 1)
    torch.testing.assert_close(one.target_logprobs, want[:, :1], **TOL)

    # Columns >= 1 are computed at the given fork rows only, 0.0 elsewhere.
    forks = tree.fork_positions()
    some = compute_forward_output(
        h, w, plan, labels=labels, fork_positions=forks[:1], fields="target_logprobs"
    )
    expect = want.clone()
    expect[forks[1:], 1:] = 0.0
    torch.testing.assert_close(some.target_logprobs, expect, **TOL)

    # An empty fork list with K = 3: column 0 only.
    none = compute_forward_output(
        h, w, plan, labels=labels, fork_positions=[], fields="target_logprobs"
    )
    assert torch.equal(none.target_logprobs[:, 1:], torch.zeros(S, 2))

    for bad, match in (
        (forks.flip(0), "sorted"),
        (torch.tensor([S]), "lie in"),
        (torch.tensor([[1]]), "1-D"),
    ):
        with pytest.raises(ValueError, match=match):
            compute_forward_output(
                h, w, plan, labels=labels, fork_positions=bad, fields="target_logprobs"
            )
    with pytest.raises(ValueError, match="K >= 1"):
        compute_forward_output(h, w, plan, labels=labels[:, :0], fields="target_logprobs")
    with pytest.raises(ValueError, match="seq_len"):
        compute_forward_output(h, w, plan, tree=PrefixTree([-1], [S - 1]))
