"""The Gated DeltaNet layer under a ``PrefixTree`` equals the same layer on each root-to-leaf path.

A tree packs sequences that share prefixes: every root-to-leaf path is one sequence. Run flat,
each path is one packed sequence at CP 1 (the layer's flat path, which ``test_gdn`` checks
against a plain-torch reference). Under the tree, at CP 1, 2 and 3 with random plans (shuffled
rows, one empty rank), the layer's output at every position must equal the flat output of every
path through it (within 1e-5): a segment's convolution continues from its ancestors' last
inputs and its recurrence from its parent's final state.

Gradients: the tree loss is a weighted sum of the outputs of the LEAF segments' rows only; the
flat loss sums, over the paths, the same weights on the same leaf rows (each leaf segment lies
on exactly one path, so each appears once in either loss). Both losses are then the same
function of the inputs and parameters, so the parameter gradients (summed over the CP group, as
Megatron's DDP does) equal the flat runs' gradients summed over paths, and each input row's
gradient equals the sum of its flat gradients over the paths through it. A loss over shared
rows would differ: the flat batch repeats a shared prefix once per path.

Also: trees with positions no rank owns are refused on every rank alike, and the layer builds
on CPU without ``_megatron_cpu``'s shim (megatron's ``GatedDeltaNet.__init__`` asks
``torch.cuda.current_device()``).
"""

from __future__ import annotations

import _megatron_cpu as mc
import pytest
import torch
from _dist import run_distributed

from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.tree import PrefixTree, tree_plan
from mixers.test_gdn import _config

pytest.importorskip("fla", reason="megatron-core builds GatedDeltaNet only with fla installed")

ATOL = 1e-5
HIDDEN = 32
# Key and value heads divide by 2 and 3; two value heads per key head (grouped values).
SHAPE = dict(key_heads=6, value_heads=12, key_dim=8, value_dim=6, kernel=4)

# Depth 3 and several roots: segment 1 (one token) is a short parent, so the kernel-1 = 3 tails
# of its children 2 and 3 reach into segment 0; segment 4 (one token) is at depth 3; root 6 has
# no children; root 7 is one token, so its descendants' tails are partly empty
# (zeros); 8 -> 9 is a chain of a one-token segment.
HAND = ((-1, 0, 1, 1, 2, 0, -1, -1, 7, 8, 7), (5, 1, 3, 2, 1, 4, 3, 1, 1, 4, 2))


def _random_tree(seed: int, segments: int = 9, longest: int = 5) -> PrefixTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1]
    for i in range(1, segments):
        root = bool(torch.rand(1, generator=g) < 0.25)
        parents.append(-1 if root else int(torch.randint(0, i, (1,), generator=g)))
    lengths = torch.randint(1, longest + 1, (segments,), generator=g).tolist()
    return PrefixTree(parents, lengths)


def _tree(name: str) -> PrefixTree:
    if name == "hand":
        return PrefixTree(*HAND)
    return _random_tree(int(name.split("-")[1]))


def _plan(tree: PrefixTree, cp: int, seed: int, kind: str = "random") -> ContextParallelPlan:
    """Every position owned once: ``tree_plan``'s, or shuffled rows with one empty rank."""
    if kind == "tree_plan":
        return tree_plan(tree, cp, block=4)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(tree.seq_len, generator=g)
    if cp == 1:
        return ContextParallelPlan.from_rank_positions([order], tree.seq_len)
    cuts = sorted(torch.randint(0, tree.seq_len + 1, (cp - 2,), generator=g).tolist())
    bounds = [0] + cuts + [tree.seq_len]
    shards = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    shards.insert(int(torch.randint(0, cp, (1,), generator=g)), order[:0])  # one empty rank
    return ContextParallelPlan.from_rank_positions(shards, tree.seq_len)


def build_layer(cp: int, shape: dict = SHAPE, dtype: torch.dtype = torch.float32, seed: int = 5):
    """The layer under test on the CPU, as megatron's local GDN layer spec builds it (fixed seed,
    CPU init), with non-trivial norm weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron.context_parallel.mixers.gdn import get_gated_delta_net_with_context_parallel_spec

    torch.manual_seed(seed)
    layer = build_module(
        get_gated_delta_net_with_context_parallel_spec(),
        _config(cp, shape, dtype),
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]),
    )
    with torch.no_grad():
        layer.out_norm.weight.uniform_(0.5, 1.5)
    return layer.cpu()  # with CUDA, megatron puts conv1d, A_log and dt_bias there


def tree_params(plan, group, tree, device="cpu"):
    """``ContextParallelParams`` of a tree batch."""
    from megatron.context_parallel.params import ContextParallelParams

    return ContextParallelParams.for_plan(plan, group, device=device, tree=tree)


def batch(seq_len: int, seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(seq_len, HIDDEN, generator=g), torch.randn(seq_len, HIDDEN, generator=g)


def leaf_rows(tree: PrefixTree) -> torch.Tensor:
    """bool ``[seq_len]``: the rows of leaf segments (the rows the losses weigh)."""
    leaves = torch.zeros(tree.num_segments, dtype=torch.bool)
    leaves[list(tree.leaves())] = True
    return leaves[tree.segment_index()]


def run_tree(layer, tree, plan, rank, group, x, weights, device="cpu", backward=True):
    """This rank's forward and backward under the tree: its rows' outputs and input gradients
    (plan order) and the parameter gradients summed over the CP group, on the CPU (without
    ``backward`` the outputs and two Nones)."""
    params = tree_params(plan, group, tree, device)
    positions = plan.local_positions(rank)
    local = x[positions].to(device)
    if params.padding_rows:
        local = torch.cat([local, local.new_zeros(params.padding_rows, HIDDEN)])
    local = local.unsqueeze(1).requires_grad_()
    out, bias = layer(local, None, packed_seq_params=params)
    assert bias is None
    rows = positions.numel()
    if not backward:
        return out[:rows, 0].detach().float().cpu(), None, None
    mask = leaf_rows(tree)[positions].unsqueeze(1).to(device)
    (out[:rows, 0] * weights[positions].to(device) * mask).sum().backward()
    grads = {}
    for name, p in layer.named_parameters():
        g = p.grad.float().cpu()
        if group is not None:
            torch.distributed.all_reduce(g, group=group)
        grads[name] = g
    layer.zero_grad(set_to_none=True)
    return out[:rows, 0].detach().float().cpu(), local.grad[:rows, 0].float().cpu(), grads


def run_paths(layer, tree, x, weights):
    """The same layer at CP 1 on each root-to-leaf path as one flat sequence (rows shuffled):
    per path its outputs in path order; the input gradients by position summed over paths; the
    parameter gradients summed over paths (loss: the leaf segment's rows of each path)."""
    from megatron.context_parallel.params import ContextParallelParams

    segment = tree.segment_index()
    outs, dx = [], torch.zeros_like(x)
    for leaf, path in zip(tree.leaves(), tree.leaf_positions()):
        n = path.numel()
        order = torch.randperm(n, generator=torch.Generator().manual_seed(n))
        plan = ContextParallelPlan.from_rank_positions([order], n)
        params = ContextParallelParams.for_plan(plan, None)
        rows = x[path][order].unsqueeze(1).requires_grad_()
        out, _ = layer(rows, None, packed_seq_params=params)
        mask = (segment[path] == leaf)[order].unsqueeze(1)
        (out[:, 0] * weights[path][order] * mask).sum().backward()
        inverse = torch.argsort(order)
        outs.append(out[:, 0].detach()[inverse])
        dx.index_add_(0, path, rows.grad[:, 0][inverse])
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    return outs, dx, grads


def compare(name, tree, positions, got, want, tol=ATOL):
    """Failures (strings): outputs at every path position this rank owns against each path's
    flat output there, input gradients, and parameter gradients relative to their scale."""
    out, dx, grads = got
    path_outs, path_dx, path_grads = want
    row_of = torch.full((tree.seq_len,), -1, dtype=torch.int64)
    row_of[positions] = torch.arange(positions.numel())
    errors = {"out": 0.0, "dx": 0.0}
    for path, flat in zip(tree.leaf_positions(), path_outs):
        mine = row_of[path] >= 0
        if mine.any():
            err = (out[row_of[path[mine]]] - flat[mine]).abs().max().item()
            errors["out"] = max(errors["out"], err)
    if positions.numel():
        errors["dx"] = (dx - path_dx[positions]).abs().max().item()
    for param, g in path_grads.items():
        scale = 1.0 + g.abs().max().item()
        errors[f"grad {param}"] = (grads[param] - g).abs().max().item() / scale
    return [f"{name} {what}: {err:.3g}" for what, err in errors.items() if not err <= tol]


def _world(rank, world_size, cases):
    from megatron.core import parallel_state as ps

    mc.init_parallel(1, world_size)
    group = ps.get_context_parallel_group()
    layer = build_layer(world_size)
    failures = []
    for tree_name, kind, seed in cases:
        tree = _tree(tree_name)
        plan = _plan(tree, world_size, seed, kind)
        x, weights = batch(tree.seq_len, seed)
        got = run_tree(layer, tree, plan, rank, group, x, weights)
        want = run_paths(layer, tree, x, weights)
        name = f"{tree_name} {kind} cp{world_size} rank {rank}"
        failures += compare(name, tree, plan.local_positions(rank), got, want)
    return failures


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_gdn_under_a_tree_equals_the_layer_on_each_root_to_leaf_path(cp):
    cases = [
        ("hand", "random", 1),
        ("random-7", "random", 2),
        ("random-8", "random", 3),
        ("hand", "tree_plan", 4),
    ]
    failures = sum(run_distributed(_world, cp, cases), [])
    assert not failures, "\n".join(failures)


def test_conv_tables_continue_each_segment_from_its_root_path():
    """The gathered convolution rows of the hand tree, written out: each segment's 3 tail
    inputs (oldest first, the zero row ``n`` where the path has fewer) then its own rows."""
    from megatron.context_parallel.mixers.gdn import TreeRows

    tree = PrefixTree(*HAND)
    n = tree.seq_len
    conv = TreeRows.build(tree, torch.device("cpu")).conv(3)
    tails = {
        0: [n, n, n],
        1: [2, 3, 4],
        2: [3, 4, 5],  # through the one-token parent 1 into segment 0
        3: [3, 4, 5],
        4: [6, 7, 8],
        5: [2, 3, 4],
        6: [n, n, n],
        7: [n, n, n],
        8: [n, n, 19],  # the one-token root 7, then nothing
        9: [n, 19, 20],
        10: [n, n, 19],
    }
    want = []
    for segment, tail in tails.items():
        start = tree.starts[segment]
        want += tail + list(range(start, start + tree.lengths[segment]))
    assert conv.index.tolist() == want
    assert torch.equal(conv.index[conv.keep], torch.arange(n))
    assert conv.packing.cu_seqlens_cpu.tolist()[-1] == len(want)


def _refusals(rank, world_size):
    """Every rank's message for a tree with positions no rank owns, and for a tree whose
    length is not the plan's."""
    from megatron.core import parallel_state as ps

    from megatron.context_parallel.params import ContextParallelParams

    mc.init_parallel(1, world_size)
    group = ps.get_context_parallel_group()
    layer = build_layer(world_size)
    tree = PrefixTree(*HAND)
    messages = []
    order = torch.randperm(tree.seq_len, generator=torch.Generator().manual_seed(0))[3:]
    for plan in (
        ContextParallelPlan.from_rank_positions(order.chunk(world_size), tree.seq_len),
        _plan(PrefixTree([-1, 0], [4, 3]), world_size, 0),
    ):
        if plan.seq_len == tree.seq_len:
            params = tree_params(plan, group, tree)
        else:  # the params refuse it too; the layer's own check, on params built around them
            params = ContextParallelParams.for_plan(plan, group)
            params.tree, params.source_segment = tree, tree.segment_index()
        local = torch.zeros(plan.counts[rank] + params.padding_rows, 1, HIDDEN)
        try:
            layer(local, None, packed_seq_params=params)
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_trees_with_unowned_positions_are_refused_on_every_rank():
    for unowned, short in run_distributed(_refusals, 2):
        assert unowned is not None and "3 of the 27 positions are owned by none" in unowned
        assert short is not None and "7 positions" in short and "seq_len 27" in short, short


def _built_without_shims(rank, world_size):
    """In a fresh process nothing has patched: build the layer (megatron's constructor asks
    ``torch.cuda.current_device()``) and run it under a tree at CP ``world_size`` against the
    flat paths; then a tiny HybridModel with GDN layers, forward and backward under a tree. The
    device query is left as it was."""
    from megatron.core import parallel_state as ps

    from megatron.context_parallel import context_parallel_forward

    assert not torch.cuda.is_available()
    assert not mc._INSTALLED
    query = torch.cuda.current_device
    ps.initialize_model_parallel(context_parallel_size=world_size)  # no RNG tracker either
    group = ps.get_context_parallel_group()
    layer = build_layer(world_size)
    assert torch.cuda.current_device is query
    with pytest.raises((AssertionError, RuntimeError)):  # CPU-only build / no device
        torch.cuda.current_device()  # still torch's own: it raises without CUDA
    devices = {p.device.type for p in layer.parameters()}
    assert devices == {"cpu"}, devices
    assert torch.all(layer.dt_bias == 1) and torch.all(layer.A_log.exp() >= 1)
    tree = PrefixTree(*HAND)
    plan = _plan(tree, world_size, 0)
    x, weights = batch(tree.seq_len, 0)
    got = run_tree(layer, tree, plan, rank, group, x, weights)
    want = run_paths(layer, tree, x, weights)
    failures = compare("no shim", tree, plan.local_positions(rank), got, want)

    model = mc.build_tiny_gpt(pattern="G*-")
    assert torch.cuda.current_device is query
    ids = torch.randint(0, mc.TINY["vocab_size"], (tree.seq_len,))
    out = context_parallel_forward(
        model, ids, tree.labels(ids), tree=tree, plan=plan, cp_group=group,
        fields=("target_logprobs",),
    )  # fmt: skip
    out.target_logprobs.sum().backward()
    assert out.target_logprobs.shape == (tree.seq_len, tree.max_children)
    assert all(p.grad is not None for p in model.parameters())
    return failures


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only construction")
def test_layer_and_hybrid_build_and_run_on_cpu_without_the_cuda_shim():
    # Spawned: forked ranks would inherit whatever the parent process patched.
    for failures in run_distributed(_built_without_shims, 2, start_method="spawn", timeout=300):
        assert not failures, "\n".join(failures)
