"""The fused attention path on a GPU (cuDNN through nvidia-cudnn-frontend) against the oracle.

``oracle_attention`` (float64, from source positions alone) is the reference; fp16 / bf16
results compare by relative error (norm of the difference over the norm of the reference),
outputs and every gradient. CP 2/3/4 run as gloo ranks sharing the GPU (spawned), and a bf16
GPTModel at CP 2 through the fused path matches CP 1.
"""

from __future__ import annotations

import pytest
import torch
from _attention_ref import oracle_attention
from _dist import run_distributed

from megatron.context_parallel import ContextParallelPlan
from megatron.context_parallel.attention import cudnn as cudnn_kernel
from megatron.context_parallel.attention import runs as attention_runs
from megatron.context_parallel.attention.blocks import AttentionBlocks, build_attention_tables
from megatron.context_parallel.attention.fused import fused_attention
from megatron.context_parallel.attention.runs import AttentionRuns
from megatron.context_parallel.attention.settings import attention_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cudnn_kernel.available(torch.device("cuda")),
        reason="needs a CUDA device and nvidia-cudnn-frontend",
    ),
]

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _sequence(seq_len, cu):
    if cu is None:
        return torch.zeros(seq_len, dtype=torch.int64)
    lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    return torch.repeat_interleave(torch.arange(len(lengths)), lengths)


def _slots(full, plan):
    out = full.new_zeros((plan.cp_size * plan.max_count,) + tuple(full.shape[1:]))
    for r in range(plan.cp_size):
        pos = plan.local_positions(r).to(full.device)
        out[r * plan.max_count : r * plan.max_count + pos.numel()] = full[pos]
    return out


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _dealt(seq_len, bounds, cp):
    """The pieces between ``bounds`` dealt to ``cp`` ranks in turn (rows sorted per rank)."""
    ranks = [[] for _ in range(cp)]
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        ranks[i % cp].extend(range(a, b))
    return ContextParallelPlan.from_rank_positions(ranks, seq_len)


def _plan(kind, seq_len, g):
    if kind == "zigzag":
        return ContextParallelPlan.zigzag(seq_len, 2), None
    if kind == "contiguous":
        return ContextParallelPlan.contiguous(seq_len, 4), None
    if kind == "thd":
        cu = (0, 128, 640, 896, seq_len)
        return ContextParallelPlan.thd(torch.tensor(cu), 2), cu
    if kind == "uneven":
        return _dealt(seq_len, [0, 300, 410, 700, 850, seq_len], 2), None
    if kind == "random_half":
        owner = torch.randint(0, 2, (seq_len,), generator=g)
        return (
            ContextParallelPlan.from_rank_positions(
                [torch.nonzero(owner == r).flatten() for r in range(2)], seq_len
            ),
            None,
        )
    if kind == "permuted_unowned_empty":
        perm = torch.randperm(seq_len, generator=g)
        return ContextParallelPlan.from_rank_positions([perm[: seq_len // 2], []], seq_len), None
    raise AssertionError(kind)


def _check(plan, rank, cu, heads, groups, dim, dtype, seed, merge_gap=64, blocks=None, kernel=None):
    g = torch.Generator().manual_seed(seed)
    seq_len = plan.seq_len
    dev = torch.device("cuda")
    q_full = torch.randn(seq_len, heads, dim, generator=g).to(dev, dtype)
    kv_full = torch.randn(seq_len, groups, 2 * dim, generator=g).to(dev, dtype)
    weight = torch.randn(seq_len, heads, dim, generator=g).to(dev, torch.float64)
    padding = 1 if plan.counts[rank] == 0 else 0
    if blocks is not None and not padding:
        runs = AttentionBlocks.build(plan, rank, _sequence(seq_len, cu), **blocks)
    else:
        runs = AttentionRuns.build(
            plan, rank, _sequence(seq_len, cu), padding_rows=padding, merge_gap=merge_gap
        )
    pos = plan.local_positions(rank).to(dev)
    query = q_full[pos]
    if padding:
        query = torch.zeros(1, heads, dim, device=dev, dtype=dtype)
    query.requires_grad_()
    kv_slots = _slots(kv_full, plan).requires_grad_()
    out = fused_attention(query, kv_slots, runs, dim**-0.5, kernel=kernel)
    n = pos.numel()
    w = weight[pos] if not padding else torch.ones(1, heads, dim, device=dev)
    (out.double() * w).sum().backward()

    q_ref = q_full[pos].double().requires_grad_()
    kv_ref = kv_full.double().requires_grad_()
    expected = oracle_attention(
        q_ref,
        kv_ref[..., :dim],
        kv_ref[..., dim:],
        pos,
        _sequence(seq_len, cu).to(dev),
        plan.owned_mask().to(dev),
        dim**-0.5,
    )
    if n:
        (expected * weight[pos]).sum().backward()
    tol = TOL[dtype]
    assert torch.isfinite(out).all()
    if n:
        assert _rel(out[:n], expected) < tol, (plan, rank, _rel(out[:n], expected))
        assert _rel(query.grad[:n], q_ref.grad) < tol
        owned_slots = _slots(kv_ref.grad, plan)
        assert _rel(kv_slots.grad, owned_slots) < tol
    else:
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(kv_slots.grad, torch.zeros_like(kv_slots.grad))
    return runs


@pytest.mark.parametrize(
    "kind", ["zigzag", "contiguous", "thd", "uneven", "random_half", "permuted_unowned_empty"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_plans_match_the_oracle(kind, dtype):
    g = torch.Generator().manual_seed(0)
    plan, cu = _plan(kind, 1024, g)
    for rank in range(plan.cp_size):
        _check(plan, rank, cu, 8, 2, 128, dtype, rank)


def _packed_random(seq_len, cp, g):
    """Packed sequences, each position to a random rank, rows in random order."""
    cu = (0, 300, 1100, 1600, seq_len)
    owner = torch.randint(0, cp, (seq_len,), generator=g)
    ranks = []
    for r in range(cp):
        pos = torch.nonzero(owner == r).flatten()
        ranks.append(pos[torch.randperm(pos.numel(), generator=g)])
    return ContextParallelPlan.from_rank_positions(ranks, seq_len, cu), cu


@pytest.mark.parametrize(
    "kind", ["random_half", "packed_random_quarter", "uneven", "zigzag", "permuted_unowned_empty"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("span_budget", [512, 16384])
def test_blocked_layout_matches_the_oracle(kind, dtype, span_budget):
    """Bulk + diagonal spans merged by log-sum-exp, the backward's levels summed in fp32."""
    g = torch.Generator().manual_seed(1)
    if kind == "packed_random_quarter":
        plan, cu = _packed_random(2048, 4, g)
    else:
        plan, cu = _plan(kind, 2048, g)
    for rank in range(plan.cp_size):
        _check(plan, rank, cu, 8, 2, 128, dtype, rank, blocks={"span_budget": span_budget})


def _named_plan(kind, seq_len, g):
    """The attention benchmark's named plan kinds at a test size: packed sequences cut at
    points unrelated to their boundaries, 64-row blocks shuffled over CP 4, random rows (the
    random half of ``_plan``)."""
    if kind == "packed_cut":
        inner = sorted(torch.randperm(seq_len - 1, generator=g)[:12].add(1).tolist())
        cu = (0, *inner, seq_len)
        cuts = sorted(torch.randperm(seq_len - 1, generator=g)[:11].add(1).tolist())
        return _dealt(seq_len, [0, *cuts, seq_len], 4), cu
    if kind == "block_shuffled_64":
        blocks = -(-seq_len // 64)
        owner = torch.empty(blocks, dtype=torch.int64)
        owner[torch.randperm(blocks, generator=g)] = torch.arange(blocks) % 4
        owner = owner.repeat_interleave(64)[:seq_len]
        ranks = [torch.nonzero(owner == r).flatten() for r in range(4)]
        return ContextParallelPlan.from_rank_positions(ranks, seq_len), None
    if kind == "random_rows":
        return _plan("random_half", seq_len, g)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["packed_cut", "block_shuffled_64", "random_rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_named_plan_kinds_match_the_oracle(kind, dtype):
    """Every rank of each plan kind, through the layout the choice takes (runs or blocks)."""
    g = torch.Generator().manual_seed(7)
    plan, cu = _named_plan(kind, 3000, g)
    for rank in range(plan.cp_size):
        sequence = _sequence(plan.seq_len, cu)
        chosen = build_attention_tables(plan, rank, sequence)
        blocks = {} if isinstance(chosen, AttentionBlocks) else None
        _check(plan, rank, cu, 8, 2, 128, dtype, rank, blocks=blocks)


@pytest.mark.parametrize("kind", ["zigzag", "thd", "uneven", "packed_cut", "random_rows"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_windows_match_the_oracle(kind, dtype):
    """Every backward call cut into windows of its rows (a workspace budget of 1 MiB: windows
    of 256 query plus key-gradient rows at 8 heads, d = 128), through the layout the choice
    takes: cuDNN given row slices of the query, output and statistics and of one key-gradient
    buffer, with tables counted from the window."""
    g = torch.Generator().manual_seed(5)
    if kind in ("packed_cut", "random_rows"):
        plan, cu = _named_plan(kind, 3000, g)
    else:
        plan, cu = _plan(kind, 1024, g)
    kernel = cudnn_kernel.CudnnKernel(cudnn_kernel.CudnnOptions(backward_workspace=1 << 20))
    assert kernel.backward_window_rows(8, 128) == 256
    windowed = 0
    for rank in range(plan.cp_size):
        chosen = build_attention_tables(plan, rank, _sequence(plan.seq_len, cu))
        blocks = {} if isinstance(chosen, AttentionBlocks) else None
        tables = _check(plan, rank, cu, 8, 2, 128, dtype, rank, blocks=blocks, kernel=kernel)
        calls = [tables] if isinstance(tables, AttentionRuns) else list(tables.levels)
        windowed += sum(len(c.backward_windows(256)) > 1 for c in calls)
    assert windowed


def test_the_choice_takes_blocks_for_scattered_rows_and_runs_else():
    g = torch.Generator().manual_seed(2)
    half, _ = _plan("random_half", 4096, g)
    seq = _sequence(4096, None)
    assert isinstance(build_attention_tables(half, 0, seq), AttentionBlocks)
    zig, _ = _plan("zigzag", 4096, g)
    assert isinstance(build_attention_tables(zig, 0, seq), AttentionRuns)


@pytest.mark.parametrize("heads,groups", [(8, 8), (10, 2), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
def test_blocked_layout_gqa_ratios_and_head_dims(heads, groups, dim):
    g = torch.Generator().manual_seed(3)
    plan, cu = _packed_random(2048, 2, g)
    for rank in range(2):
        _check(plan, rank, cu, heads, groups, dim, torch.bfloat16, rank, blocks={})


@pytest.mark.parametrize("heads,groups", [(8, 8), (10, 2), (8, 1)])
@pytest.mark.parametrize("dim", [64, 128])
def test_gqa_ratios_and_head_dims(heads, groups, dim):
    g = torch.Generator().manual_seed(1)
    plan, cu = _plan("uneven", 1024, g)
    _check(plan, 0, cu, heads, groups, dim, torch.bfloat16, 3)


def test_single_row_runs_and_random_plans():
    g = torch.Generator().manual_seed(2)
    plan, _ = _plan("random_half", 777, g)
    runs = _check(plan, 1, None, 8, 2, 64, torch.bfloat16, 5, merge_gap=1)
    assert runs.entries > 100 and runs.identity  # every run its own entry, many of one row
    for seed in range(4):
        cp = 2 + seed % 3
        owner = torch.randint(0, cp + 1, (600,), generator=g)  # value cp: nobody owns it
        cuts = sorted(torch.randint(0, 600, (3,), generator=g).tolist())
        cu = tuple([0] + cuts + [600])
        ranks = [torch.nonzero(owner == r).flatten() for r in range(cp)]
        ranks = [r[torch.randperm(r.numel(), generator=g)] for r in ranks]
        plan = ContextParallelPlan.from_rank_positions(ranks, 600, cu)
        for rank in range(cp):
            _check(plan, rank, cu, 8, 4, 64, torch.bfloat16, seed)


def test_new_lengths_reuse_built_graphs():
    """Graphs are keyed by bucketed sizes (and mask): a batch of new lengths in a known bucket
    builds nothing, and the same batches again build nothing at all."""
    g = torch.Generator().manual_seed(3)
    plans = []
    for _ in range(6):
        cuts = sorted(torch.randint(200, 900, (3,), generator=g).tolist())
        first = list(range(0, cuts[0])) + list(range(cuts[1], cuts[2]))
        taken = set(first)
        plans.append(
            ContextParallelPlan.from_rank_positions(
                [first, [p for p in range(1024) if p not in taken]], 1024
            )
        )
    forward, backward = set(), set()
    before = cudnn_kernel.graph_builds()
    for plan in plans:
        runs = _check(plan, 0, None, 8, 2, 64, torch.bfloat16, 0)
        forward.add((runs.batch, runs.max_q, runs.max_kv))
        # The backward runs the call, or its prefix and diagonal calls (the default kernel
        # splits it where the rectangles exceed the visible pairs): one graph per mask and size.
        split = runs.backward_split() if cudnn_kernel.KERNEL.split_backward else None
        for c in split or (runs,):
            mask = cudnn_kernel.diagonal(c, cudnn_kernel.KERNEL.options)
            backward.add((mask, c.batch, c.max_q, c.max_kv, c.total_q, c.total_mat))
    assert cudnn_kernel.graph_builds() - before <= len(forward) + len(backward)
    again = cudnn_kernel.graph_builds()
    for plan in plans:
        _check(plan, 0, None, 8, 2, 64, torch.bfloat16, 1)
    assert cudnn_kernel.graph_builds() == again


def test_batches_on_larger_recorded_shapes_match_the_oracle():
    """With ``shape_reuse`` a batch runs on a recorded kernel shape up to that much larger than
    its own (more padding entries, longer padded rows and keys): same results, fewer graphs."""
    g = torch.Generator().manual_seed(4)
    with attention_settings(shape_reuse=2.0):
        for kind in ("uneven", "thd", "zigzag", "random_half"):
            plan, cu = _plan(kind, 1024, g)
            with attention_runs.kernel_shapes():
                own = AttentionRuns.build(plan, 0, _sequence(1024, cu))
            with attention_runs.kernel_shapes() as shapes:
                # A recorded shape larger in every size, within the tolerance.
                larger = (2 * own.batch, int(own.max_q * 1.9) + 1, int(own.max_kv * 1.9) + 1)
                shapes.record(larger)
                for rank in range(plan.cp_size):
                    runs = _check(plan, rank, cu, 8, 2, 128, torch.bfloat16, rank)
                    if rank == 0:
                        assert (runs.batch, runs.max_q, runs.max_kv) == larger


def _w_group(rank, world, seed):
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(seed)
    seq_len, heads, groups, dim = 900, 8, 2, 128
    owner = torch.randint(0, world, (seq_len,), generator=g)
    plan = ContextParallelPlan.from_rank_positions(
        [torch.nonzero(owner == r).flatten() for r in range(world)], seq_len
    )
    from megatron.context_parallel.comm.mappings import gather_padded_from_context_parallel_region

    dev = torch.device("cuda")
    q_full = torch.randn(seq_len, heads, dim, generator=g).to(dev, torch.bfloat16)
    kv_full = torch.randn(seq_len, groups, 2 * dim, generator=g).to(dev, torch.bfloat16)
    weight = torch.randn(seq_len, heads, dim, generator=g).to(dev, torch.float64)
    runs = AttentionRuns.build(plan, rank, torch.zeros(seq_len, dtype=torch.int64))
    pos = plan.local_positions(rank).to(dev)
    query = q_full[pos].clone().requires_grad_()
    kv_local = kv_full[pos].clone().requires_grad_()
    slots = gather_padded_from_context_parallel_region(
        kv_local, plan.max_count, torch.distributed.group.WORLD
    )
    out = fused_attention(query, slots, runs, dim**-0.5)
    (out.double() * weight[pos]).sum().backward()
    q_ref = q_full.double().requires_grad_()
    kv_ref = kv_full.double().requires_grad_()
    expected = oracle_attention(
        q_ref,
        kv_ref[..., :dim],
        kv_ref[..., dim:],
        torch.arange(seq_len, device=dev),
        torch.zeros(seq_len, dtype=torch.int64, device=dev),
        torch.ones(seq_len, dtype=torch.bool, device=dev),
        dim**-0.5,
    )
    (expected * weight).sum().backward()
    assert _rel(out, expected[pos]) < 2e-2
    assert _rel(query.grad, q_ref.grad[pos]) < 2e-2
    assert _rel(kv_local.grad, kv_ref.grad[pos]) < 2e-2


@pytest.mark.parametrize("world", [2, 3, 4])
def test_cp_groups_on_one_gpu(world):
    run_distributed(_w_group, world, 7, start_method="spawn", timeout=300)


def _w_gpt(rank, world, plan_kind):
    """A bf16 GPTModel (fused attention) at CP ``world`` on one GPU: fields and gradients."""
    import _megatron_cpu as mc
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    from megatron.context_parallel.models.forward import context_parallel_forward

    torch.cuda.set_device(0)
    ps.initialize_model_parallel(context_parallel_size=world)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    model = mc.build_tiny_gpt(num_query_groups=2).cuda().bfloat16()
    seq_len = 96
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, mc.TINY["vocab_size"], (seq_len,), generator=g)
    labels = torch.randint(0, mc.TINY["vocab_size"], (seq_len,), generator=g)
    plan = None
    order = torch.randperm(seq_len, generator=g)  # drawn at every CP size: the same loss weights
    if world > 1 and plan_kind in ("uneven", "blocked"):
        plan = ContextParallelPlan.from_rank_positions([order[:70], order[70:]], seq_len)
    if world > 1 and plan_kind == "blocked":
        # The blocked layout on every rank, with groups of 16 rows (several levels).
        import megatron.context_parallel.params as params

        params.build_attention_tables = lambda plan, rank, seq, padding_rows=0: (
            AttentionBlocks.build(plan, rank, seq, group_rows=16, span_budget=40)
        )
    out = context_parallel_forward(
        model, ids.cuda(), labels.cuda(), plan=plan, fields=("hidden_states", "target_logprobs")
    )
    w = torch.randn(seq_len, mc.TINY["hidden_size"], generator=g).cuda()
    loss = (out.hidden_states.float() * w).sum() + out.target_logprobs.float().sum()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.float().clone()
        torch.distributed.all_reduce(grad, group=ps.get_context_parallel_group())
        grads[name] = grad.cpu().numpy()
    # numpy arrays travel by value; CPU tensors would be shared through file descriptors that
    # die with the worker.
    return {
        "hidden": out.hidden_states.detach().float().cpu().numpy(),
        "logp": out.target_logprobs.detach().float().cpu().numpy(),
        "grads": grads,
    }


@pytest.mark.parametrize("plan_kind", ["default", "uneven", "blocked"])
def test_gpt_model_cp2_matches_cp1(plan_kind):
    ref = run_distributed(_w_gpt, 1, plan_kind, start_method="spawn", timeout=300)[0]
    got = run_distributed(_w_gpt, 2, plan_kind, start_method="spawn", timeout=300)
    t = torch.from_numpy
    for out in got:
        assert _rel(t(out["hidden"]), t(ref["hidden"])) < 2e-2
        assert _rel(t(out["logp"]), t(ref["logp"])) < 2e-2
        for name, g in ref["grads"].items():
            assert _rel(t(out["grads"][name]), t(g)) < 5e-2, name


@pytest.mark.parametrize("kind", ["zigzag", "uneven", "thd"])
def test_backward_on_shared_key_ranges(kind):
    """Whether cuDNN's backward may read overlapping key ranges (no per-entry copies)."""
    g = torch.Generator().manual_seed(4)
    plan, cu = _plan(kind, 1024, g)
    options = cudnn_kernel.CudnnOptions(shared_keys_in_backward=True)
    runs = _check(
        plan, 0, cu, 8, 2, 128, torch.bfloat16, 9, kernel=cudnn_kernel.CudnnKernel(options)
    )
    assert runs.materialize


@pytest.mark.parametrize("kind", ["zigzag", "uneven", "thd", "random_half"])
@pytest.mark.parametrize("heads,groups,dim", [(8, 2, 128), (10, 2, 64)])
def test_backward_writes_only_the_workspace_it_asked_for(kind, heads, groups, dim, monkeypatch):
    """``exact_key_workspace`` gives a GQA backward graph half the key total (cuDNN's frontend
    sizes its 16-bit per-head key gradients at four bytes an element): a guard region after
    every workspace keeps its bytes, and the gradients still match the oracle (a kernel writing
    past its halved buffers would spill into the next one or past the end)."""
    guards = []

    def guarded(size, device):
        size = max(int(size), 1)
        buf = torch.full((size + (1 << 20),), 0x5A, dtype=torch.uint8, device=device)
        guards.append((buf, size))
        return buf

    monkeypatch.setattr(cudnn_kernel, "_workspace", guarded)
    kernel = cudnn_kernel.CudnnKernel(cudnn_kernel.CudnnOptions(exact_key_workspace=True))
    g = torch.Generator().manual_seed(5)
    plan, cu = _plan(kind, 2048, g)
    blocks = {} if kind == "random_half" else None
    _check(plan, 0, cu, heads, groups, dim, torch.bfloat16, 11, blocks=blocks, kernel=kernel)
    torch.cuda.synchronize()
    assert len(guards) >= 2
    for buf, size in guards:
        assert bool((buf[size:] == 0x5A).all()), (kind, size)
