"""megatron-core's HybridModel under CP, through the same entry points as GPTModel.

The model is megatron-core's own ``HybridModel`` with ``get_hybrid_stack_with_context_parallel_
spec()``; the reference is the same ``HybridModel`` with megatron-core's ``SelfAttention`` and
``DotProductAttention`` in its attention layers, at TP 1 / CP 1, one packed sequence at a time,
through its own forward (no output processor, no hooks). Every output field and every
parameter gradient (summed over CP) must equal the reference within 1e-5 in fp32, for CP 2, 3
and 4 and every plan kind: zigzag, contiguous, THD, uneven with an empty rank and shuffled
rows, and equal shards of a shuffled packing; TP 2 x CP 2 and DP 2 x CP 2 too, and MoE
layers. megatron's schedules with DDP, DP 2 x CP 2 with its optimizer and PP 2 x CP 2 stages
(interleaved too) reuse the GPTModel cases of ``test_megatron_native``.
"""

from __future__ import annotations

import _megatron_cpu as mc
import torch
from _dist import run_distributed

import models.test_forward as test_model
import models.test_megatron_native as native
from megatron.context_parallel import (
    context_parallel_batch,
    context_parallel_forward,
    get_hybrid_stack_with_context_parallel_spec,
)
from megatron.context_parallel.comm.plan import ContextParallelPlan

DENSE = "*-*-"
KINDS = test_model.KINDS + ("permuted",)


def _cases(cp, seed, **kw):
    return test_model._cases(cp, seed=seed, kinds=KINDS, pattern=DENSE, **kw)


# ---------------------------------------------------------------------------------------------
# Every output field and every gradient equals CP 1.


def test_dense_pattern_cp2_every_plan_gated_attention_gqa():
    cases = (
        _cases(2, 0)
        + _cases(2, 10, attention_output_gate=True)[2:4]
        + _cases(2, 20, num_query_groups=2)[:1]
        + _cases(2, 30, position_embedding_type="learned_absolute")[3:4]
    )
    test_model._check(run_distributed(test_model._world, 2, cases, {}))


def test_dense_pattern_cp3_every_plan_and_moe():
    moe = test_model._cases(
        3, seed=70, kinds=("uneven", "permuted", "thd"), pattern="*E-E", num_experts=4
    )
    test_model._check(run_distributed(test_model._world, 3, _cases(3, 40) + moe, {}))


def test_dense_pattern_cp4_every_plan_tp2_cp2_and_dp2_cp2():
    tp2 = test_model._cases(2, tp=2, seed=55, kinds=("thd", "uneven"), pattern=DENSE)
    dp_cases = test_model._cases(2, seed=60, kinds=("uneven", "thd"), pattern=DENSE)
    test_model._check(
        run_distributed(test_model._world, 4, _cases(4, 50) + tp2, {"dp_cases": dp_cases})
    )


# ---------------------------------------------------------------------------------------------
# megatron's schedules, DDP, optimizers and pipeline stages.

SCHEDULE_CASES = [
    native.Case("hybrid-zigzag-mean", pattern=DENSE),
    native.Case("hybrid-uneven-sum", plan="uneven", loss="sum", pattern=DENSE),
    native.Case("hybrid-thd-per-token", plan="thd", loss="per_token", pattern=DENSE),
    native.Case("hybrid-empty-mean", plan="empty", pattern=DENSE),
]

PARALLEL_CASES = [
    native.Case("hybrid-dp2-cp2-uneven-adam", plan="uneven", optimizer="adam", pattern=DENSE),
    native.Case("hybrid-pp2-cp2-uneven-tied", pp=2, plan="uneven", tied=True, pattern="*-|*-"),
    native.Case("hybrid-pp2-cp2-thd-sum", pp=2, plan="thd", loss="sum", pattern="-*|*-"),
    native.Case("hybrid-pp2-vpp2-cp2-zigzag", pp=2, vpp=2, micro_batches=4, pattern="*-|*-|-*|*"),
]


def test_hybrid_schedule_ddp_cp2():
    per_rank = run_distributed(native._cases_worker, 2, SCHEDULE_CASES, timeout=400)
    native._check(per_rank, [c.name for c in SCHEDULE_CASES])


def test_hybrid_dp2_cp2_adam_and_pp2_cp2_stages():
    per_rank = run_distributed(native._cases_worker, 4, PARALLEL_CASES, timeout=600)
    native._check(per_rank, [c.name for c in PARALLEL_CASES])


# ---------------------------------------------------------------------------------------------
# The report's probe on a hybrid with an uneven plan.


def _report_probe(rank, world_size, pattern=DENSE):
    import models.test_report_regression as report

    ids, labels = report._batch()
    mc.init_parallel(1, 1)
    model = mc.build_tiny_gpt(pattern=pattern)
    reference = report._probe(
        context_parallel_forward(model, ids, labels, cu_seqlens=report.CU_SEQLENS), labels
    )
    mc.init_parallel(1, world_size)
    plan = report._prefix_tree_plan(world_size)
    assert len(set(plan.counts)) == world_size, plan.counts
    out = context_parallel_forward(
        mc.build_tiny_gpt(pattern=pattern), ids, labels, cu_seqlens=report.CU_SEQLENS, plan=plan
    )
    probe = report._probe(out, labels)
    assert probe.shape == reference.shape == (report.SEQ_LEN - 20, mc.TINY["hidden_size"])
    return (probe - reference).abs().max().item()


def test_report_probe_on_hybrid_with_uneven_plan():
    for error in run_distributed(_report_probe, 4):
        assert error <= 1e-5, error


# ---------------------------------------------------------------------------------------------
# The head's hooks, the spec's refusals.


def _hooks(rank, world_size):
    """Without ``output_processor`` the model is HybridModel.forward unchanged (logits), also
    after the head was attached; a call that raises leaves ``post_process`` as it was."""
    mc.init_parallel(1, 1)
    model = mc.build_tiny_gpt(pattern=DENSE)
    ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(12, 12, dtype=torch.bool).triu(1)[None, None]
    plain = model(ids[None], torch.arange(12)[None], causal)
    batch = context_parallel_batch(model, ids, ids, fields="target_logprobs")
    output = model(**batch.forward_kwargs())
    after = model(ids[None], torch.arange(12)[None], causal)
    logprobs = torch.log_softmax(plain[0], -1).gather(1, ids[:, None])[:, 0]
    broken = dict(batch.forward_kwargs(), input_ids=ids[None, :5])
    try:
        model(**broken)
        raised = None
    except Exception as exc:  # noqa: BLE001 - whichever megatron raises
        raised = type(exc).__name__
    return {
        "plain_again": torch.equal(plain, after),
        "logprobs": (output.target_logprobs - logprobs).abs().max().item(),
        "raised": raised,
        "post_process": model.post_process,
        "hooks": len(model._forward_hooks) + len(model._forward_pre_hooks),
    }


def test_head_hooks_leave_the_plain_forward_alone():
    ((result,),) = [run_distributed(_hooks, 1)]
    assert result["plain_again"] is True
    assert result["logprobs"] <= 1e-5
    assert result["raised"] is not None
    assert result["post_process"] is True
    assert result["hooks"] == 2


def _capacity(rank, world_size):
    mc.init_parallel(1, world_size)
    model = mc.build_tiny_gpt(pattern="*E", num_experts=4)
    model.config.moe_expert_capacity_factor = 1.0
    ids = torch.arange(24)
    try:
        context_parallel_forward(model, ids, ids)
    except ValueError as exc:
        return str(exc)
    return None


def test_moe_with_token_dropping_refused_under_cp():
    for message in run_distributed(_capacity, 2):
        assert message is not None and "layer 2 ('E', MoE)" in message, message
        assert "capacity factor 1.0" in message and "ContextParallelPlan(cp_size=2" in message


def test_spec_refuses_mamba_naming_the_symbol():
    def build(pattern):
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        mc.init_parallel(1, 1)
        config = mc.build_tiny_gpt(pattern=DENSE).config
        config.num_layers = len(pattern)
        return HybridModel(
            config,
            get_hybrid_stack_with_context_parallel_spec(),
            128,
            128,
            hybrid_layer_pattern=pattern,
        )

    def messages(rank, world_size):
        out = []
        for pattern in ("M*",):
            try:
                build(pattern)
                out.append(None)
            except ValueError as exc:
                out.append(str(exc))
        return out

    ((mamba,),) = run_distributed(messages, 1)
    assert mamba is not None and "'M' (Mamba)" in mamba, mamba


def _megatron_gdn(rank, world_size):
    """A layer holding megatron-core's own GatedDeltaNet (only its type is read before the
    model runs, so it is made without its fla kernels): zigzag of one sequence passes the
    batch, any other plan or packing raises on every rank, naming the plan and the layer."""
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet

    mc.init_parallel(1, world_size)
    model = mc.build_tiny_gpt(pattern=DENSE)
    megatron_gdn = GatedDeltaNet.__new__(GatedDeltaNet)
    torch.nn.Module.__init__(megatron_gdn)
    # Layer 2 stands in for a 'G' layer of megatron's own hybrid spec.
    model.decoder.layer_type_list[1] = "G"
    model.decoder.layers[1].self_attention = megatron_gdn
    ids = torch.arange(24)
    results = {}
    for name, kwargs in (
        ("zigzag", {}),
        ("contiguous", dict(plan=ContextParallelPlan.contiguous(24, world_size))),
        ("packed", dict(cu_seqlens=(0, 8, 24))),
    ):
        try:
            context_parallel_batch(model, ids, ids, **kwargs)
            results[name] = None
        except ValueError as exc:
            results[name] = str(exc)
    return results


def test_megatron_gdn_refuses_plans_it_would_get_wrong():
    per_rank = run_distributed(_megatron_gdn, 2)
    assert per_rank[0] == per_rank[1]
    results = per_rank[0]
    assert results["zigzag"] is None
    for name in ("contiguous", "packed"):
        message = results[name]
        assert message is not None and "layer 2 ('G', megatron-core's GatedDeltaNet)" in message
        assert "ContextParallelPlan(cp_size=2" in message, message
    assert "with packed sequences" in results["packed"]
