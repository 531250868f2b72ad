"""megatron-core's own training machinery under CP: every case equals CP 1 / PP 1.

A Megatron user trains through ``get_forward_backward_func()`` schedules, megatron's
``DistributedDataParallel`` with ``finalize_model_grads``, its optimizers and pipeline stages.
Here a ``forward_step_func`` written as in megatron's ``pretrain_gpt`` (``context_parallel_batch``
then ``model(**batch.forward_kwargs())``, a ``loss_func`` on the full ``target_logprobs``) runs
under all of them, and each case is compared with a single-device reference on the same weights
and the same micro-batches: megatron-core's own GPTModel (its local spec, ``DotProductAttention``,
TP 1 / CP 1 / PP 1), one packed sequence at a time, computing the same objective. Checked, in
fp32, within 1e-5 relative per tensor:

* every loss the schedule reports (``loss_func``'s reported values, per micro-batch);
* every parameter gradient after ``finalize_model_grads`` (DDP's ``main_grad``);
* with an optimizer, every parameter after one Adam step (megatron's optimizer, distributed or
  not, against ``torch.optim.AdamW`` on the reference). ``adam_eps = 1`` keeps that step linear
  enough in the gradient that a wrongly scaled gradient moves the weights visibly (Adam's
  first step with a tiny eps is scale-invariant: it would hide a factor of CP).

Loss functions (see the README's Megatron recipe): ``mean`` is a 2-tuple (mean NLL; megatron
multiplies by CP itself), ``sum`` a 3-tuple ``(nll_sum * cp, tokens, [nll_sum, tokens])``,
``per_token`` the same 3-tuple with ``calculate_per_token_loss``, ``mean_per_token`` the 2-tuple
with ``calculate_per_token_loss`` (CP 1 then sums the micro-batch means over DP and micro-batches,
megatron dividing by nothing). ``wrapped`` cases write the loss as for CP 1 and return
``batch.loss_func(loss)``, which applies the CP scaling.

Cases run in few spawned worlds (megatron's groups are rebuilt between cases) to keep the suite
fast on two cores.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Optional

import _megatron_cpu as mc
import pytest
import torch
from _dist import run_distributed

from megatron.context_parallel.attention.layers import ContextParallelSelfAttention
from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.models.forward import context_parallel_batch

RTOL = 1e-5
# fp32 rounding of the last subtraction of an optimizer step, relative to the weight itself.
STEP_ROUNDING = 2.0**-22
ADAM = dict(lr=0.05, eps=1.0)


@dataclasses.dataclass(frozen=True)
class Case:
    """One training step of megatron's machinery under CP, compared with the reference."""

    name: str
    cp: int = 2
    pp: int = 1
    vpp: Optional[int] = None
    plan: str = "zigzag"  # zigzag | contiguous | thd | uneven | empty
    loss: str = "mean"  # mean | sum | per_token | mean_per_token
    wrapped: bool = False  # the CP-1 loss through batch.loss_func instead of scaled by hand
    optimizer: Optional[str] = None  # None | "adam" | "adam-distributed"
    tied: bool = False
    layers: int = 2
    micro_batches: int = 3
    pattern: Optional[str] = None  # a HybridModel's layer pattern instead of a GPTModel


# ---------------------------------------------------------------------------------------------
# Batches and plans: built identically on every rank from the case, replica and micro-batch.

_SEQ = {"zigzag": (0, 24), "contiguous": (0, 24), "thd": (0, 8, 12, 24)}
_PACKED = (0, 9, 16, 27)


def _batch(case: Case, replica: int, micro: int):
    """(input_ids [S], labels [S], cu_seqlens or None, plan) of one micro-batch."""
    seed = 1000 * replica + micro + 17 * len(case.name)
    g = torch.Generator().manual_seed(seed)
    cu = _SEQ.get(case.plan, _PACKED)
    seq_len = cu[-1]
    if case.plan == "zigzag":
        plan, cu = ContextParallelPlan.zigzag(seq_len, case.cp), None
    elif case.plan == "contiguous":
        plan, cu = ContextParallelPlan.contiguous(seq_len, case.cp), None
    elif case.plan == "thd":
        plan = ContextParallelPlan.thd(cu, case.cp)
    elif case.plan == "uneven":
        # A prefix-tree style plan, new for every micro-batch: shuffled, every shard a
        # different size.
        order = torch.randperm(seq_len, generator=g)
        weights = torch.arange(case.cp, 0, -1, dtype=torch.float64) + 0.5
        bounds = (weights.cumsum(0) / weights.sum() * seq_len).round().long().tolist()
        starts = [0] + bounds[:-1]
        plan = ContextParallelPlan.from_rank_positions(
            [order[a:b] for a, b in zip(starts, bounds)], seq_len, cu
        )
    elif case.plan == "empty":
        # Every position on one rank (shuffled); the others own nothing.
        owner = int(torch.randint(0, case.cp, (1,), generator=g))
        shards = [torch.zeros(0, dtype=torch.int64)] * case.cp
        shards[owner] = torch.randperm(seq_len, generator=g)
        plan = ContextParallelPlan.from_rank_positions(shards, seq_len, cu)
    else:
        raise AssertionError(case.plan)
    ids = torch.randint(0, mc.TINY["vocab_size"], (seq_len,), generator=g)
    labels = torch.randint(0, mc.TINY["vocab_size"], (seq_len,), generator=g)
    labels[torch.randperm(seq_len, generator=g)[: seq_len // 5]] = -100
    return ids, labels, cu, plan


# ---------------------------------------------------------------------------------------------
# The reference: megatron-core's own model, one device, one packed sequence at a time.


def _target_logprobs(model, ids, labels, cu):
    """fp32 ``[S]``: log p(label) at every position (0.0 where the label is -100)."""
    cuts = cu if cu is not None else (0, ids.numel())
    pieces = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        n = b - a
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]
        logits = model(ids[None, a:b], torch.arange(n)[None], causal)  # [1, n, V]
        logprobs = torch.log_softmax(logits[0].float(), dim=-1)
        target = logprobs.gather(1, labels[a:b].clamp(min=0)[:, None])[:, 0]
        pieces.append(torch.where(labels[a:b] == -100, 0.0, target))
    return torch.cat(pieces)


def _nll(model, ids, labels, cu):
    """(sum of -log p(label) over the labelled positions, their count) on the whole model."""
    return -_target_logprobs(model, ids, labels, cu).sum(), int((labels != -100).sum())


def _reference(case: Case, dp: int):
    """Initial weights, reported losses per (replica, micro-batch), expected gradients and,
    with an optimizer, the expected weights after one step (all by global parameter name)."""
    model = mc.build_tiny_gpt(
        reference=True, num_layers=case.layers, tied=case.tied, pattern=case.pattern
    )
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    reported, objective, tokens = {}, 0.0, 0
    for d in range(dp):
        for m in range(case.micro_batches):
            ids, labels, cu, _ = _batch(case, d, m)
            nll, n = _nll(model, ids, labels, cu)
            tokens += n
            if case.loss.startswith("mean"):
                reported[(d, m)] = torch.tensor([nll.item() / n])
            else:
                reported[(d, m)] = torch.tensor([nll.item(), float(n)])
            if case.loss == "per_token":
                objective = objective + nll
            elif case.loss == "mean_per_token":  # megatron: x cp / M, no DP or token division
                objective = objective + nll / n / case.micro_batches
            else:  # megatron averages the micro-batches' means over replicas and micro-batches
                objective = objective + nll / n / (dp * case.micro_batches)
    if case.loss == "per_token":
        objective = objective / tokens  # one token count summed over everything
    objective.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    stepped = None
    if case.optimizer:
        opt = torch.optim.AdamW(
            model.parameters(), lr=ADAM["lr"], eps=ADAM["eps"], weight_decay=0.0
        )
        opt.step()
        stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
    return initial, reported, grads, stepped


# ---------------------------------------------------------------------------------------------
# The CP run: megatron's schedule, DDP, finalize_model_grads, optimizer.


def _loss_func(labels, cp_size: int, mode: str, output):
    """megatron ``loss_func`` on the full-sequence target log-probs (same on every CP rank);
    ``cp_size`` 1 gives the CP-1 loss that ``batch.loss_func`` scales."""
    valid = labels != -100
    nll = -(output.target_logprobs * valid).sum()
    count = valid.sum()
    if mode.startswith("mean"):
        loss = nll / count
        # A copy: megatron scales the returned loss in place (by CP and 1 / micro-batches).
        return loss, {"lm loss": loss.detach().clone().view(1)}
    # megatron divides 3-tuple losses by a token count summed over DP x CP, in which every CP
    # rank counts the whole batch: scale the (replicated) sum by CP to compensate.
    report = torch.stack([nll.detach(), count.float()])
    return nll * cp_size, count.int(), {"lm loss": report}


def _forward_step(case: Case, data_iterator, model):
    ids, labels, cu, plan = next(data_iterator)
    batch = context_parallel_batch(
        model, ids, labels, cu_seqlens=cu, plan=plan, fields="target_logprobs"
    )
    output = model(**batch.forward_kwargs())
    if case.wrapped:
        return output, batch.loss_func(functools.partial(_loss_func, labels, 1, case.loss))
    return output, functools.partial(_loss_func, labels, batch.cp_size, case.loss)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    if math.isnan(diff):
        return float("nan")
    return diff / scale if scale > 0 else diff


def _run_case(case: Case, reference) -> dict:
    """Runs ``case`` on this rank; returns {check: error} (errors <= RTOL pass)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mc.init_parallel(1, case.cp, case.pp, case.vpp)
    replica = ps.get_data_parallel_rank()
    initial, reported, ref_grads, ref_stepped = reference

    chunks = []
    for vp_stage in range(case.vpp) if case.vpp else [None]:
        stage = mc.build_tiny_gpt(
            num_layers=case.layers, tied=case.tied, vp_stage=vp_stage, pattern=case.pattern
        )
        mc.load_stage(stage, initial)
        chunks.append(stage)
    config = chunks[0].config
    # Every chunk's own config (Megatron-LM gives all chunks one config object; the batch helper
    # reads the chunk's).
    for chunk in chunks:
        chunk.config.calculate_per_token_loss = case.loss in ("per_token", "mean_per_token")
        chunk.config.variable_seq_lengths = case.plan in ("uneven", "empty")
    config.batch_p2p_comm = not case.vpp
    config.finalize_model_grads_func = finalize_model_grads
    distributed = case.optimizer == "adam-distributed"
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    models = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
    no_sync = [m.no_sync for m in models]
    config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
    optimizer = None
    if case.optimizer:
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=ADAM["lr"],
                adam_eps=ADAM["eps"],
                weight_decay=0.0,
                clip_grad=0.0,
                use_distributed_optimizer=distributed,
            ),
            models,
        )
        optimizer.zero_grad()
    for m in models:
        m.zero_grad_buffer()

    micro = [_batch(case, replica, m) for m in range(case.micro_batches)]
    iterators = [iter(micro) for _ in models]
    reports = get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, case),
        data_iterator=iterators if case.vpp else iterators[0],
        model=models,
        num_microbatches=case.micro_batches,
        seq_length=micro[0][0].numel(),
        micro_batch_size=1,
        forward_only=False,
    )

    errors = {}
    last = ps.is_pipeline_last_stage(ignore_virtual=True)
    if last:
        assert len(reports) == case.micro_batches, reports
        for m, report in enumerate(reports):
            errors[f"loss[{m}]"] = _relative(report["lm loss"], reported[(replica, m)])
    else:
        assert reports == [], reports
    params = [(mc.global_name(c, n), p) for c in chunks for n, p in c.named_parameters()]
    if not distributed:
        # The distributed optimizer leaves each rank only its shard of the reduced gradients.
        for name, p in params:
            errors[f"grad {name}"] = _relative(p.main_grad, ref_grads[name])
    if optimizer is not None:
        ok, _, _ = optimizer.step()
        assert ok
        for name, p in params:
            change = ref_stepped[name] - initial[name]
            bound = RTOL * change.abs().max() + STEP_ROUNDING * ref_stepped[name].abs()
            excess = ((p.detach() - ref_stepped[name]).abs() - bound).max().item()
            errors[f"step {name}"] = 0.0 if excess <= 0 else excess
    return errors


def _references(cases, world_size) -> dict:
    """Every case's reference, computed first, on this rank alone (TP = CP = PP = 1)."""
    mc.init_parallel(1, 1)
    return {c.name: _reference(c, world_size // (c.cp * c.pp)) for c in cases}


def _cases_worker(rank, world_size, cases):
    references = _references(cases, world_size)
    return {case.name: _run_case(case, references[case.name]) for case in cases}


def _check(per_rank, expected_names):
    failures = []
    for rank, results in enumerate(per_rank):
        assert sorted(results) == sorted(expected_names), results.keys()
        for case, errors in results.items():
            assert errors, (rank, case)
            for key, value in errors.items():
                if not value <= RTOL:  # also NaN
                    failures.append(f"rank {rank} {case}: {key} = {value:.3g}")
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# The cases.

SCHEDULE_CASES = [
    Case(f"{plan}-{loss}", plan=plan, loss=loss)
    for plan, losses in (
        ("zigzag", ("mean", "sum", "per_token")),
        ("thd", ("mean", "per_token")),
        ("uneven", ("mean", "sum", "per_token")),
        ("contiguous", ("sum",)),
        ("empty", ("per_token",)),
    )
    for loss in losses
] + [
    Case("uneven-sum-wrapped", plan="uneven", loss="sum", wrapped=True),
    Case("thd-mean-per-token-wrapped", plan="thd", loss="mean_per_token", wrapped=True),
]


def test_schedule_ddp_cp2_every_plan_and_loss_func():
    """get_forward_backward_func + DDP + finalize_model_grads at CP 2, several micro-batches."""
    per_rank = run_distributed(_cases_worker, 2, SCHEDULE_CASES, timeout=400)
    _check(per_rank, [c.name for c in SCHEDULE_CASES])


DP_CASES = [
    Case("dp2-cp2-thd-adam", plan="thd", loss="mean", optimizer="adam"),
    Case(
        "dp2-cp2-uneven-adam-distributed", plan="uneven", loss="sum", optimizer="adam-distributed"
    ),
    Case("dp2-cp2-zigzag-per-token-distributed", loss="per_token", optimizer="adam-distributed"),
    Case("dp2-cp2-zigzag-mean-per-token-wrapped", loss="mean_per_token", wrapped=True),
]

PP_CASES = [
    Case("pp2-cp2-zigzag-untied", pp=2, micro_batches=4),
    Case("pp2-cp2-thd-tied-sum", pp=2, plan="thd", tied=True, loss="sum", micro_batches=4),
    Case("pp2-cp2-uneven-tied", pp=2, plan="uneven", tied=True, micro_batches=4),
    Case("pp2-cp2-empty-per-token-adam", pp=2, plan="empty", loss="per_token", optimizer="adam"),
    Case("pp2-vpp2-cp2-zigzag-tied", pp=2, vpp=2, layers=4, tied=True, micro_batches=4),
    Case("pp2-vpp2-cp2-uneven-untied", pp=2, vpp=2, layers=4, plan="uneven", micro_batches=4),
]


def _stage_forward(rank, world_size):
    """``context_parallel_forward`` on PP 2 x CP 2 stages by hand: hidden rows from the first
    stage (sent on by p2p), a ForwardOutput from the last one, given no input ids."""
    from megatron.core import parallel_state as ps

    from megatron.context_parallel.models.forward import context_parallel_forward

    case = Case("stages", pp=2, plan="uneven")
    ids, labels, cu, plan = _batch(case, 0, 0)
    mc.init_parallel(1, 1)
    whole = mc.build_tiny_gpt(reference=True)
    expected = _target_logprobs(whole, ids, labels, cu).detach()
    state = {n: p.detach().clone() for n, p in whole.named_parameters()}
    mc.init_parallel(1, 2, 2)
    stage = mc.build_tiny_gpt()
    mc.load_stage(stage, state)
    # An uneven plan: the batch helper refuses fixed-length stage exchanges.
    stage.config.variable_seq_lengths = True
    group = ps.get_pipeline_model_parallel_group()
    peer = ps.get_pipeline_model_parallel_next_rank()
    rows = plan.counts[ps.get_context_parallel_rank()] or 1  # an empty rank runs one padding row
    kwargs = dict(cu_seqlens=cu, plan=plan, fields="target_logprobs")
    if ps.is_pipeline_first_stage():
        hidden = context_parallel_forward(stage, ids, labels, **kwargs)
        assert isinstance(hidden, torch.Tensor) and hidden.shape == (rows, 1, 64), hidden.shape
        torch.distributed.send(hidden.detach().contiguous(), peer, group=group)
        return 0.0
    received = torch.empty(rows, 1, mc.TINY["hidden_size"])
    torch.distributed.recv(received, ps.get_pipeline_model_parallel_prev_rank(), group=group)
    stage.set_input_tensor(received)
    out = context_parallel_forward(stage, None, labels, **kwargs)
    return _relative(out.target_logprobs, expected)


def test_dp2_cp2_ddp_optimizers_and_pp2_cp2_pipelines():
    """DP 2 x CP 2 with megatron's optimizer (distributed or not), then PP 2 x CP 2 with and
    without virtual stages, tied and untied embeddings, even and uneven plans."""
    cases = DP_CASES + PP_CASES
    per_rank = run_distributed(_cases_worker, 4, cases, timeout=600)
    _check(per_rank, [c.name for c in cases])


def test_context_parallel_forward_runs_pipeline_stages():
    for error in run_distributed(_stage_forward, 4):
        assert error <= RTOL, error


# ---------------------------------------------------------------------------------------------
# The checks can fail, and megatron's own rotary path refuses plans it would get wrong.


def _wrong_rotary_worker(rank, world_size):
    """With megatron's zigzag-sliced rotary table forced back in, a contiguous plan (whose
    shards have the table's size, so nothing else notices) must fail the comparison."""
    import megatron.context_parallel.params as cp_params

    case = Case("contiguous-mean-wrong-rotary", plan="contiguous")
    reference = _references([case], world_size)[case.name]
    original = (
        ContextParallelSelfAttention._rotary_at_source_positions,
        cp_params.skip_table_length,
    )
    # GPTModel builds its table again (plain lengths), and the layers apply it.
    cp_params.skip_table_length = int
    ContextParallelSelfAttention._rotary_at_source_positions = lambda self, table, params: table
    try:
        return _run_case(case, reference)
    finally:
        ContextParallelSelfAttention._rotary_at_source_positions = original[0]
        cp_params.skip_table_length = original[1]


def test_the_comparison_catches_a_wrong_rotary_table():
    for errors in run_distributed(_wrong_rotary_worker, 2):
        losses = [v for k, v in errors.items() if k.startswith("loss")]
        grads = [v for k, v in errors.items() if k.startswith("grad")]
        assert max(losses) > RTOL, errors  # log-prob errors ~1e-4 over ~20 tokens
        assert max(grads) > 100 * RTOL, errors


def _unscaled_two_tuple_worker(rank, world_size):
    """The 2-tuple loss under ``calculate_per_token_loss`` returned as it is, not through
    ``batch.loss_func``: megatron multiplies it by CP and divides by nothing, so gradients are
    CP times those of CP 1 (what the wrapper exists for)."""
    case = Case("uneven-mean-per-token-unscaled", plan="uneven", loss="mean_per_token")
    return _run_case(case, _references([case], world_size)[case.name])


def test_two_tuple_per_token_loss_without_the_wrapper_is_cp_times_cp1():
    for errors in run_distributed(_unscaled_two_tuple_worker, 2):
        grads = [v for k, v in errors.items() if k.startswith("grad")]
        losses = [v for k, v in errors.items() if k.startswith("loss")]
        assert max(losses) <= RTOL, errors  # the reported values are right...
        assert all(abs(g - 1.0) < 1e-4 for g in grads), errors  # ...the gradients 2x (CP 2)


def _pp_fixed_lengths_worker(rank, world_size):
    """PP 2 x CP 2 with an uneven and an empty-rank plan and ``variable_seq_lengths=False``:
    every rank's ``context_parallel_batch`` refuses, naming the setting; equal shards pass."""
    from megatron.core import parallel_state as ps

    mc.init_parallel(1, 2, 2)
    stage = mc.build_tiny_gpt()
    stage.config.variable_seq_lengths = False
    first = ps.is_pipeline_first_stage()
    messages = {}
    for plan in ("uneven", "empty", "zigzag"):
        ids, labels, cu, cp_plan = _batch(Case("pp", pp=2, plan=plan), 0, 0)
        try:
            context_parallel_batch(
                stage, ids if first else None, labels, cu_seqlens=cu, plan=cp_plan
            )
            messages[plan] = None
        except ValueError as exc:
            messages[plan] = str(exc)
    return messages


def test_pipeline_stages_refuse_uneven_plans_without_variable_seq_lengths():
    per_rank = run_distributed(_pp_fixed_lengths_worker, 4)
    for messages in per_rank:
        assert messages["zigzag"] is None, messages
        for plan in ("uneven", "empty"):
            assert "config.variable_seq_lengths = True" in messages[plan], messages
    # Every rank alike (each CP group names its own first rank).
    texts = {re.sub(r"^rank \d+: ", "", m[p]) for m in per_rank for p in ("uneven", "empty")}
    assert len(texts) == 2, texts


def _megatron_self_attention_worker(rank, world_size):
    """Layers with megatron-core's own SelfAttention (GPTModel's zigzag-sliced rotary table)
    and ContextParallelAttention: zigzag runs and is exact, any other plan raises on every rank
    before computing anything."""
    from megatron.core.transformer.attention import SelfAttention

    import megatron.context_parallel.attention.layers as cp_attention

    cases = [
        Case(f"megatron-rotary-{plan}", plan=plan)
        for plan in ("zigzag", "thd", "contiguous", "uneven")
    ]
    references = _references(cases, world_size)
    results = {}
    original = cp_attention.ContextParallelSelfAttention
    # The package's spec, with megatron-core's SelfAttention put back.
    cp_attention.ContextParallelSelfAttention = SelfAttention
    try:
        results["zigzag"] = _run_case(cases[0], references[cases[0].name])
        for case in cases[1:]:
            try:
                _run_case(case, references[case.name])
                results[case.plan] = None
            except ValueError as exc:
                results[case.plan] = str(exc)
    finally:
        cp_attention.ContextParallelSelfAttention = original
    return results


def test_megatron_rotary_path_raises_for_plans_it_would_get_wrong():
    per_rank = run_distributed(_megatron_self_attention_worker, 2)
    for rank, results in enumerate(per_rank):
        errors = results.pop("zigzag")
        assert all(v <= RTOL for v in errors.values()), errors
        for plan, message in results.items():
            assert message is not None, (rank, plan)
            assert "SelfAttention with ContextParallelAttention" in message, message
            assert "ContextParallelPlan(" in message and "zigzag" in message, message
    assert per_rank[0] == per_rank[1]


@pytest.mark.parametrize(
    "plan,expected", [("zigzag", 24), ("thd", 24), ("uneven", None), ("empty", None)]
)
def test_pipeline_seq_length_only_for_equal_shards(plan, expected):
    from megatron.context_parallel.models.forward import ContextParallelBatch

    *_, cp_plan = _batch(Case("x", plan=plan), 0, 0)
    batch = ContextParallelBatch(
        input_ids=None,
        position_ids=torch.zeros(1, 1, dtype=torch.int64),
        attention_mask=None,
        packed_seq_params=None,
        output_processor=None,
        plan=cp_plan,
        cp_size=2,
        padding_rows=0,
    )
    assert batch.pipeline_seq_length == expected


def _hand_built_params(rank, world_size):
    """``GPTModel.forward`` given ``ContextParallelParams.for_plan`` directly (no batch helper):
    the attention modules themselves refuse what they would get wrong."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention

    import megatron.context_parallel.attention.layers as cp_attention

    def forward(model, plan, rotary, cp_group):
        ids = torch.randint(0, 128, (plan.seq_len,), generator=torch.Generator().manual_seed(3))
        rotary = model.rotary_pos_emb if rotary else None
        params = cp_attention.ContextParallelParams.for_plan(plan, cp_group, rotary=rotary)
        local = ids.index_select(0, plan.local_positions(params.rank))
        return model(local[None], params.position_ids[None], None, packed_seq_params=params)

    def error(fn):
        try:
            fn()
        except ValueError as exc:
            return str(exc)
        return None

    mc.init_parallel(1, 2)
    cp = ps.get_context_parallel_group()
    zigzag = ContextParallelPlan.zigzag(24, 2)
    thd = ContextParallelPlan.thd((0, 8, 12, 24), 2)
    ours = mc.build_tiny_gpt()
    results = {
        # Where megatron's table is exact, params without rows use it: the same numbers.
        "zigzag_same": torch.equal(
            forward(ours, zigzag, False, cp), forward(ours, zigzag, True, cp)
        ),
        "thd_without_rows": error(lambda: forward(ours, thd, False, cp)),
    }
    original = cp_attention.ContextParallelSelfAttention
    cp_attention.ContextParallelSelfAttention = SelfAttention
    try:
        megatron_rotary = mc.build_tiny_gpt()
    finally:
        cp_attention.ContextParallelSelfAttention = original
    results["megatron_self_attention"] = error(lambda: forward(megatron_rotary, thd, True, cp))

    mc.init_parallel(1, 1)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.module = cp_attention.ContextParallelSelfAttention
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(0)
    config = mc.build_tiny_gpt(reference=True).config
    other_core = GPTModel(config, spec, 128, 128, position_embedding_type="rope")
    one = ContextParallelPlan.contiguous(24, 1)
    results["other_core"] = error(lambda: forward(other_core, one, True, None))
    return results


def test_attention_modules_refuse_what_they_would_get_wrong():
    per_rank = run_distributed(_hand_built_params, 2)
    assert per_rank[0] == per_rank[1]
    results = per_rank[0]
    assert results["zigzag_same"] is True
    assert "carry no rotary rows" in results["thd_without_rows"]
    assert "ContextParallelPlan(cp_size=2, seq_len=24" in results["thd_without_rows"]
    message = results["megatron_self_attention"]
    assert message.startswith("ContextParallelAttention (layer 1)"), message
    assert "zigzag" in message and "ContextParallelPlan(cp_size=2" in message, message
    message = results["other_core"]
    assert "need ContextParallelAttention" in message and "DotProductAttention" in message
