"""Tests of the context-parallel output head (``megatron.context_parallel.head.output``).

Every distributed check runs inside two spawned 4-rank gloo jobs: one builds its own TP x CP
grids with ``dist.new_group`` (TP1 x CP 2, 3, 4 and TP2 x CP2, with and without sequence
parallelism), the other goes through megatron-core's ``parallel_state`` so that ``group=None``
resolves. References are plain single-device torch on the full sequence.

Inputs are small dyadic rationals (hidden in 1/8 steps, weights in 1/1024 steps, H = 16), so
every logit is computed exactly whatever the summation order: gathered data (hidden states,
logits, top-k ids) must match bit for bit, computed log-probs within fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.head.output import (
    FIELDS,
    ForwardOutput,
    TopK,
    compute_forward_output,
    make_output_processor,
)
from tests._dist import DistributedPool

S, H, V = 40, 16, 48
TOL = dict(atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------
# Shared inputs and the single-device reference.


def _make_case(seed: int, k_max: int = 30) -> dict:
    """Hidden [S, H], weight [V, H], labels [S] with runs of -100, and loss coefficients.

    Re-draws until the top ``k_max + 1`` logits of every row are distinct, so top-k ids are
    defined without ties.
    """
    for attempt in range(100):
        g = torch.Generator().manual_seed(seed * 1000 + attempt)
        hidden = torch.randint(-8, 9, (S, H), generator=g).float() / 8
        weight = torch.randint(-1024, 1025, (V, H), generator=g).float() / 1024
        top = (hidden.double() @ weight.double().t()).topk(k_max + 1).values
        if (top[:, :-1] - top[:, 1:]).min() > 1e-6:
            break
    else:  # pragma: no cover - the seeds used below all succeed
        raise AssertionError("could not draw a case without ties")
    labels = torch.randint(0, V, (S,), generator=g)
    labels[0:3] = -100
    labels[17:23] = -100
    labels[-1] = -100
    return dict(
        hidden=hidden,
        weight=weight,
        labels=labels,
        c_target=torch.randn(S, generator=g),
        c_hidden=torch.randn(S, H, generator=g),
        c_top=torch.randn(S, k_max, generator=g),
        c_logits=torch.randn(S, V, generator=g),
    )


def _losses(case: dict, k: int) -> dict:
    """Named scalar losses of a ForwardOutput; every CP rank computes them all alike."""
    return {
        "target": lambda o: (o.target_logprobs * case["c_target"]).sum(),
        "hidden": lambda o: (o.hidden_states * case["c_hidden"]).sum(),
        "top_k+logits": lambda o: (o.top_k.logprobs * case["c_top"][:, :k]).sum()
        + (o.logits * case["c_logits"]).sum(),
    }


def _reference(case: dict, owned: torch.Tensor, k: int):
    """Single-device outputs (zero where no rank owns a position) and each loss's gradients."""
    h = case["hidden"].clone().requires_grad_(True)
    w = case["weight"].clone().requires_grad_(True)
    logits = h @ w.t()
    logp = torch.log_softmax(logits.float(), dim=-1)
    labels = case["labels"]
    target = logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    target = torch.where((labels == -100) | ~owned, 0.0, target)
    top_lp, top_ids = logp.topk(k, dim=-1)
    rows = owned[:, None]
    ref = ForwardOutput(
        hidden_states=torch.where(rows, h, 0.0),
        target_logprobs=target,
        top_k=TopK(torch.where(rows, top_lp, 0.0), torch.where(rows, top_ids, 0)),
        logits=torch.where(rows, logits, 0.0),
    )
    grads = {}
    for name, fn in _losses(case, k).items():
        gh, gw = torch.autograd.grad(fn(ref), [h, w], retain_graph=True, allow_unused=True)
        grads[name] = (
            torch.zeros_like(h) if gh is None else gh,
            torch.zeros_like(w) if gw is None else gw,
        )
    return ref, grads


def _assert_fields_equal(out: ForwardOutput, ref: ForwardOutput, tag: str) -> None:
    assert torch.equal(out.hidden_states, ref.hidden_states), tag
    assert torch.equal(out.logits, ref.logits), tag
    assert torch.equal(out.top_k.tokens, ref.top_k.tokens), tag
    assert out.target_logprobs.dtype == torch.float32 and out.top_k.logprobs.dtype == torch.float32
    assert out.top_k.tokens.dtype == torch.int64
    torch.testing.assert_close(out.target_logprobs, ref.target_logprobs, **TOL, msg=tag)
    torch.testing.assert_close(out.top_k.logprobs, ref.top_k.logprobs, **TOL, msg=tag)


# ---------------------------------------------------------------------------------------------
# One configuration on the calling rank, checked against the reference.


def _check_config(
    tag, plan, cp_group, tp_group, case, k, *, sequence_parallel=False, chunk_size=3, sbh=False
):
    """Forward + three backwards on this rank's rows; asserts every field and gradient."""
    cp_rank, tp_rank = dist.get_rank(cp_group), dist.get_rank(tp_group)
    tp_size = dist.get_world_size(tp_group)
    positions = plan.local_positions(cp_rank)
    rows = case["hidden"][positions]
    if sequence_parallel:
        rows = rows.chunk(tp_size)[tp_rank]
    h_local = (rows[:, None, :] if sbh else rows).clone().requires_grad_(True)
    shard = V // tp_size
    vocab_rows = slice(tp_rank * shard, (tp_rank + 1) * shard)
    w_local = case["weight"][vocab_rows].clone().requires_grad_(True)

    out = compute_forward_output(
        h_local,
        w_local,
        plan,
        labels=case["labels"],
        fields=FIELDS,
        top_k=k,
        cp_group=cp_group,
        tp_group=tp_group,
        sequence_parallel=sequence_parallel,
        chunk_size=chunk_size,
    )
    ref, ref_grads = _reference(case, plan.owned_mask(), k)
    _assert_fields_equal(out, ref, tag)
    assert out.plan is plan and not out.logits_are_local
    ignored = case["labels"] == -100
    assert torch.equal(out.target_logprobs[ignored], torch.zeros(int(ignored.sum())))

    for name, fn in _losses(case, k).items():
        gh, gw = torch.autograd.grad(
            fn(out), [h_local, w_local], retain_graph=True, allow_unused=True
        )
        gh = torch.zeros_like(h_local) if gh is None else gh
        gw = torch.zeros_like(w_local) if gw is None else gw.clone()
        # What Megatron's DDP does over DP x CP, without its averaging factor.
        dist.all_reduce(gw, group=cp_group)
        want_h = ref_grads[name][0][positions]
        if sequence_parallel:
            want_h = want_h.chunk(tp_size)[tp_rank]
        want_w = ref_grads[name][1][vocab_rows]
        gh = gh.reshape(want_h.shape)
        if name == "hidden":  # pure data movement: exact
            assert torch.equal(gh, want_h) and torch.equal(gw, want_w), (tag, name)
        else:
            torch.testing.assert_close(gh, want_h, **TOL, msg=f"{tag} {name} hidden grad")
            torch.testing.assert_close(gw, want_w, **TOL, msg=f"{tag} {name} weight grad")
    return out


def _probe(out: ForwardOutput, case: dict) -> torch.Tensor:
    """The bug report's probe: full-sequence boolean mask over shifted hidden states."""
    mask = case["labels"][1:] != -100
    return out.hidden_states[1:][mask]


# ---------------------------------------------------------------------------------------------
# Distributed cases: one 4-rank pool, one named case per test. Each case runs on every rank and
# asserts; its groups come from one set built the same way on every rank.

_GROUPS: dict = {}


def _groups(rank: int) -> dict:
    """This process's groups (built once per pool worker, in the same order on every rank)."""
    if not _GROUPS:
        world = dist.new_group([0, 1, 2, 3])
        singles = [dist.new_group([r]) for r in range(4)]
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        triple = dist.new_group([0, 1, 2])
        cp2 = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        _GROUPS.update(
            world=world,
            me=singles[rank],
            pair=pairs[rank // 2],  # CP 2 on ranks {0, 1} and {2, 3}, TP 1
            triple=triple if rank < 3 else None,
            tp2=pairs[rank // 2],  # TP 2 x CP 2: tp_rank = rank % 2 ...
            cp2=cp2[rank % 2],  # ... cp_rank = rank // 2
        )
    return _GROUPS


def _perm() -> torch.Tensor:
    return torch.randperm(S, generator=torch.Generator().manual_seed(7))


def _uneven_cp4() -> ContextParallelPlan:
    perm = _perm()
    return ContextParallelPlan.from_rank_positions([perm[:7], perm[7:7], perm[7:19], perm[19:]], S)


def _case_cp1_probe(rank, world_size):
    g = _groups(rank)
    case = _make_case(1)
    out = _check_config("tp1xcp1", ContextParallelPlan.contiguous(S, 1), g["me"], g["me"], case, 5)
    assert torch.equal(_probe(out, case), case["hidden"][1:][case["labels"][1:] != -100])


def _case_cp4_uneven_empty_rank(rank, world_size):
    g = _groups(rank)
    case = _make_case(1)
    plan = _uneven_cp4()
    out = _check_config("tp1xcp4", plan, g["world"], g["me"], case, 5, sbh=True)
    assert torch.equal(_probe(out, case), case["hidden"][1:][case["labels"][1:] != -100])
    assert len(out.sequences()) == 1 and out.sequences()[0] is out


def _case_cp4_thd_sequences(rank, world_size):
    g = _groups(rank)
    case = _make_case(1)
    plan = ContextParallelPlan.thd([0, 16, 24, 40], 4)
    # A chunk larger than the rows.
    out = _check_config("tp1xcp4-thd", plan, g["world"], g["me"], case, 4, chunk_size=512)
    ref, _ = _reference(case, plan.owned_mask(), 4)
    pieces = out.sequences()
    assert [p.hidden_states.shape[0] for p in pieces] == [16, 8, 16]
    for piece, a, b in zip(pieces, (0, 16, 24), (16, 24, 40), strict=True):
        assert torch.equal(piece.hidden_states, ref.hidden_states[a:b])
        assert torch.equal(piece.logits, ref.logits[a:b])
        assert torch.equal(piece.top_k.tokens, ref.top_k.tokens[a:b])
        torch.testing.assert_close(piece.target_logprobs, ref.target_logprobs[a:b], **TOL)
        torch.testing.assert_close(piece.top_k.logprobs, ref.top_k.logprobs[a:b], **TOL)


def _case_cp4_output_grad(rank, world_size):
    """context_parallel_output_grad=True: each rank's loss covers a quarter of the positions."""
    g = _groups(rank)
    case = _make_case(1)
    plan = _uneven_cp4()
    h_local = case["hidden"][plan.local_positions(rank)].clone().requires_grad_(True)
    w_local = case["weight"].clone().requires_grad_(True)
    out = compute_forward_output(
        h_local,
        w_local,
        plan,
        labels=case["labels"],
        fields=("target_logprobs",),
        cp_group=g["world"],
        tp_group=g["me"],
        chunk_size=4,
        context_parallel_output_grad=True,
    )
    part = (torch.arange(S) % 4 == rank).float()
    (out.target_logprobs * case["c_target"] * part).sum().backward()
    _, ref_grads = _reference(case, plan.owned_mask(), 5)
    gw = w_local.grad.clone()
    dist.all_reduce(gw, group=g["world"])
    torch.testing.assert_close(
        h_local.grad, ref_grads["target"][0][plan.local_positions(rank)], **TOL
    )
    torch.testing.assert_close(gw, ref_grads["target"][1], **TOL)


def _case_cp2_unowned_positions(rank, world_size):
    """Positions 5 and 30 owned by nobody come out as zero rows; a full plan equals CP 1."""
    g = _groups(rank)
    case = _make_case(1)
    perm = _perm()
    kept = [int(p) for p in perm if int(p) not in (5, 30)]
    plan = ContextParallelPlan.from_rank_positions([kept[:25], kept[25:]], S)
    out = _check_config("tp1xcp2", plan, g["pair"], g["me"], case, 5)
    assert not plan.owned_mask()[5] and not plan.owned_mask()[30]
    assert torch.equal(out.hidden_states[5], torch.zeros(H))
    full = ContextParallelPlan.from_rank_positions([perm[:13], perm[13:]], S)
    out = _check_config("tp1xcp2-full", full, g["pair"], g["me"], case, 5)
    assert torch.equal(_probe(out, case), case["hidden"][1:][case["labels"][1:] != -100])


def _case_cp3_middle_rank_empty(rank, world_size):
    g = _groups(rank)
    if rank < 3:
        perm = _perm()
        plan = ContextParallelPlan.from_rank_positions([perm[:22], [], perm[22:]], S)
        _check_config("tp1xcp3", plan, g["triple"], g["me"], _make_case(1), 5)


def _case_tp2_cp2(rank, world_size, k, sequence_parallel, empty):
    """TP 2 x CP 2; k below or above the vocab shard; SP; an empty CP rank."""
    g = _groups(rank)
    perm = _perm()
    if empty:
        plan = ContextParallelPlan.from_rank_positions([perm, []], S)
    else:
        # Even counts, so sequence parallelism can split them over TP.
        plan = ContextParallelPlan.from_rank_positions([perm[:14], perm[14:]], S)
    _check_config(
        f"tp2xcp2-k{k}-sp{sequence_parallel}-empty{empty}",
        plan,
        g["cp2"],
        g["tp2"],
        _make_case(1),
        k,
        sequence_parallel=sequence_parallel,
        sbh=sequence_parallel,
        chunk_size=4,
    )


def _case_local_logits(rank, world_size):
    """gather_logits=False: megatron's own [n_r, V/TP] shard, no copy."""
    g = _groups(rank)
    case = _make_case(1)
    perm = _perm()
    plan = ContextParallelPlan.from_rank_positions([perm[:11], perm[11:]], S)
    tp_rank = rank % 2
    h_local = case["hidden"][plan.local_positions(rank // 2)]
    w_local = case["weight"][tp_rank * (V // 2) : (tp_rank + 1) * (V // 2)]
    out = compute_forward_output(
        h_local,
        w_local,
        plan,
        fields=("logits", "hidden_states"),
        cp_group=g["cp2"],
        tp_group=g["tp2"],
        gather_logits=False,
    )
    assert out.logits_are_local and out.plan is plan
    assert torch.equal(out.logits, h_local @ w_local.t())
    assert torch.equal(out.hidden_states, case["hidden"])
    with pytest.raises(ValueError, match="rank-local"):
        out.sequences()


def _case_bad_rows_on_one_rank(rank, world_size):
    """Rank 2 alone passes a row short, on a plan already used: every rank raises, in step."""
    g = _groups(rank)
    case = _make_case(1)
    plan = _uneven_cp4()
    h_local = case["hidden"][plan.local_positions(rank)]
    kw = dict(cp_group=g["world"], tp_group=g["me"])
    compute_forward_output(h_local, case["weight"], plan, **kw)
    rows = h_local[:-1] if rank == 2 else h_local
    with pytest.raises(
        ValueError, match=r"rank 2: CP rank 2 has 11 hidden rows but the plan gives it 12"
    ):
        compute_forward_output(
            rows, case["weight"], plan, fields=FIELDS, top_k=3, labels=case["labels"], **kw
        )
    # The group is still in step afterwards.
    out = compute_forward_output(h_local, case["weight"], plan, fields=("hidden_states",), **kw)
    assert torch.equal(out.hidden_states, case["hidden"])


def _case_parallel_state(rank, world_size):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    try:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        cp_rank = parallel_state.get_context_parallel_rank()
        case = _make_case(2)
        perm = torch.randperm(S, generator=torch.Generator().manual_seed(3))
        plan = ContextParallelPlan.from_rank_positions([perm[:18], perm[18:]], S)
        positions = plan.local_positions(cp_rank)
        vocab_rows = slice(tp_rank * (V // 2), (tp_rank + 1) * (V // 2))
        h_local = case["hidden"][positions].clone().requires_grad_(True)
        w_local = case["weight"][vocab_rows].clone().requires_grad_(True)
        out = compute_forward_output(
            h_local, w_local, plan, labels=case["labels"], fields=FIELDS, top_k=4
        )
        ref, grads = _reference(case, plan.owned_mask(), 4)
        _assert_fields_equal(out, ref, "parallel_state")
        _losses(case, 4)["target"](out).backward()
        gw = w_local.grad.clone()
        dist.all_reduce(gw, group=parallel_state.get_context_parallel_group())
        torch.testing.assert_close(h_local.grad, grads["target"][0][positions], **TOL)
        torch.testing.assert_close(gw, grads["target"][1][vocab_rows], **TOL)

        # The GPTModel output_processor hook, fed a real ColumnParallelLinear (SP on): its TP
        # group, sequence parallelism and weight come from the layer.
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        config = ModelParallelConfig(
            tensor_model_parallel_size=2,
            context_parallel_size=2,
            sequence_parallel=True,
            use_cpu_initialization=True,
        )
        layer = ColumnParallelLinear(
            H, V, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False
        )
        with torch.no_grad():
            layer.weight.copy_(case["weight"][vocab_rows])
        sp_rows = case["hidden"][positions].chunk(2)[tp_rank][:, None, :]
        processor = make_output_processor(plan, labels=case["labels"], fields=FIELDS, top_k=4)
        out = processor(
            hidden_states=sp_rows,
            output_layer=layer,
            output_weight=None,
            labels=None,
            config=config,
            context=None,
        )
        _assert_fields_equal(out, ref, "output_processor")
        local = make_output_processor(plan, fields=("logits",), gather_logits=False)(
            hidden_states=sp_rows, output_layer=layer, config=config
        )
        # What the layer's own forward computes (it needs CUDA, so spelled out): the
        # SP-gathered rows times this rank's vocab shard.
        assert torch.equal(local.logits, case["hidden"][positions] @ layer.weight.t())
    finally:
        parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------------------------------------
# Tests.


@pytest.fixture(scope="module")
def pool():
    # Imported before the fork, so the four workers inherit it instead of importing it.
    from megatron.core import parallel_state  # noqa: F401

    ranks = DistributedPool(4)
    yield ranks
    ranks.close()


def test_tp1_cp1_probe(pool):
    pool.run(_case_cp1_probe)


def test_tp1_cp4_uneven_plan_with_an_empty_rank(pool):
    pool.run(_case_cp4_uneven_empty_rank)


def test_tp1_cp4_thd_packed_sequences(pool):
    pool.run(_case_cp4_thd_sequences)


def test_tp1_cp4_output_grad_sums_over_cp(pool):
    pool.run(_case_cp4_output_grad)


def test_tp1_cp2_unowned_positions_are_zero(pool):
    pool.run(_case_cp2_unowned_positions)


def test_tp1_cp3_middle_rank_empty(pool):
    pool.run(_case_cp3_middle_rank_empty)


@pytest.mark.parametrize(
    "k,sequence_parallel,empty",
    [
        (5, False, False),
        (V // 2 + 3, False, False),  # k above the vocab shard V/TP
        (5, True, False),
        (5, True, True),
        # The empty CP rank with k > V/TP: its TP all-gather of the top-k statistics must run
        # like everyone else's, or its combine sees one shard's candidates only.
        (V // 2 + 3, False, True),
        (V // 2 + 3, True, True),
    ],
)
def test_tp2_cp2(pool, k, sequence_parallel, empty):
    pool.run(_case_tp2_cp2, k, sequence_parallel, empty)


def test_tp2_cp2_rank_local_logits(pool):
    pool.run(_case_local_logits)


def test_bad_rows_on_one_rank_raise_on_every_rank(pool):
    pool.run(_case_bad_rows_on_one_rank)


def test_groups_default_to_megatron_parallel_state(pool):
    pool.run(_case_parallel_state)


def test_single_rank_without_distributed_and_sequences_unpacked():
    case = _make_case(3)
    plan = ContextParallelPlan.contiguous(S, 1)
    out = compute_forward_output(
        case["hidden"],
        case["weight"],
        plan,
        labels=case["labels"],
        fields=["top_k", "target_logprobs", "logits", "hidden_states"],
        top_k=6,
        chunk_size=7,
    )
    ref, _ = _reference(case, plan.owned_mask(), 6)
    _assert_fields_equal(out, ref, "single")
    assert len(out.sequences()) == 1 and out.sequences()[0] is out
    only = compute_forward_output(case["hidden"], case["weight"], plan, fields="hidden_states")
    assert only.target_logprobs is None and only.top_k is None and only.logits is None


def test_bfloat16_model_dtype():
    case = _make_case(4)
    plan = ContextParallelPlan.contiguous(S, 1)
    h = case["hidden"].bfloat16().requires_grad_(True)
    w = case["weight"].bfloat16().requires_grad_(True)
    out = compute_forward_output(
        h,
        w,
        plan,
        labels=case["labels"],
        fields=("target_logprobs", "top_k", "hidden_states"),
        top_k=3,
        chunk_size=8,
    )
    # Target log-probs and top-k come from fp32 logits of the bf16 inputs (fp32 accumulation),
    # not from the bf16-rounded logits megatron's output layer would return.
    logp = torch.log_softmax(h.float() @ w.float().t(), dim=-1)
    want = logp.gather(1, case["labels"].clamp(min=0)[:, None]).squeeze(1)
    want = torch.where(case["labels"] == -100, 0.0, want)
    assert out.hidden_states.dtype == torch.bfloat16 and out.target_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.target_logprobs, want, **TOL)
    torch.testing.assert_close(out.top_k.logprobs, logp.topk(3).values, **TOL)
    out.target_logprobs.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_bad_input_single_rank():
    case = _make_case(1)
    plan = ContextParallelPlan.contiguous(S, 1)
    h, w = case["hidden"], case["weight"]
    with pytest.raises(ValueError, match=rf"\b{S - 3}\b.*\b{S}\b"):
        compute_forward_output(h[:-3], w, plan)
    with pytest.raises(ValueError, match="needs labels"):
        compute_forward_output(h, w, plan, fields=("target_logprobs",))
    with pytest.raises(ValueError, match="integer ids"):
        compute_forward_output(
            h, w, plan, labels=case["labels"].float(), fields=("target_logprobs",)
        )
    with pytest.raises(ValueError, match=r"got 0"):
        compute_forward_output(h, w, plan, fields=("top_k",))
    with pytest.raises(ValueError, match=f"H = {H}"):
        compute_forward_output(h, w[:, :-1], plan)
    with pytest.raises(ValueError, match="cp_size 2"):
        compute_forward_output(h, w, ContextParallelPlan.contiguous(S, 2))
    with pytest.raises(ValueError, match="chunk_size"):
        compute_forward_output(h, w, plan, chunk_size=0)


def test_out_of_range_label_is_nan_without_gradient():
    case = _make_case(1)
    plan = ContextParallelPlan.contiguous(S, 1)
    labels = case["labels"].clone()
    labels[5] = V
    h = case["hidden"].clone().requires_grad_(True)
    out = compute_forward_output(
        h, case["weight"], plan, labels=labels, fields=("target_logprobs",)
    )
    assert torch.isnan(out.target_logprobs[5]) and not torch.isnan(out.target_logprobs[6])
    out.target_logprobs.nan_to_num().sum().backward()
    assert torch.equal(h.grad[5], torch.zeros(H))


# ---------------------------------------------------------------------------------------------
# Memory bound: the peak of the CPU allocator's running total inside the head, forward and
# backward, from torch.profiler's allocation events (these include the allocations inside the
# vocab_ops custom ops, which a Python dispatch mode would not see).


def _peak_bytes(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    del kept
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def _peaks(n_rows: int, vocab: int, chunk_size: int):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n_rows, 8, generator=g).requires_grad_(True)
    w = torch.randn(vocab, 8, generator=g).requires_grad_(True)
    labels = torch.randint(0, vocab, (n_rows,), generator=g)
    plan = ContextParallelPlan.contiguous(n_rows, 1)
    outs = []

    def forward():
        outs.append(
            compute_forward_output(
                h,
                w,
                plan,
                labels=labels,
                fields=("target_logprobs", "top_k"),
                top_k=4,
                chunk_size=chunk_size,
            )
        )

    def backward():
        out = outs.pop()
        (out.target_logprobs.sum() + out.top_k.logprobs.sum()).backward()

    forward_peak = _peak_bytes(forward)
    backward_peak = _peak_bytes(backward)
    assert h.grad is not None and w.grad is not None
    return forward_peak, backward_peak


def test_chunked_memory_is_bounded_by_chunk_not_sequence():
    vocab, chunk = 4096, 64
    chunk_bytes = chunk * vocab * 4
    threads = torch.get_num_threads()
    # Many small ops: intra-op threads only spin on busy cores.
    torch.set_num_threads(1)
    try:
        for n_rows in (1024, 4096):
            # Per-row bookkeeping next to the chunks: the shard statistics, their TP-gathered
            # copy, lse, top-k values and ids (int64 and the int32 bits that travel), the
            # outputs and grads of [n, 8]; twice the bytes of one copy of each.
            small = n_rows * (3 + 2 * 4 + 8 + 8) * 16 + vocab * 8 * 4 * 2
            fwd, bwd = _peaks(n_rows, vocab, chunk)
            assert fwd <= 2 * chunk_bytes + small, (n_rows, fwd)
            assert bwd <= 2 * chunk_bytes + small, (n_rows, bwd)
        # The meter does see a whole [S, V] logits tensor when one chunk holds every row (the
        # forward's chunks) and every vocabulary column (the backward's).
        fwd, bwd = _peaks(1024, vocab, vocab)
        assert fwd >= 1024 * vocab * 4 and bwd >= 1024 * vocab * 4
    finally:
        torch.set_num_threads(threads)
