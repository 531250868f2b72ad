"""The Gated DeltaNet layer under CP 2/3/4 and every plan kind equals a plain-torch CP 1 layer.

Every rank builds the same fp32 ``ContextParallelGatedDeltaNet`` (fixed seed, CPU init) and
runs its rows of one batch through it with the batch's ``ContextParallelParams``. The reference
is written here from the layer's parameters alone, independent of the package: the projections
as matmuls, the causal convolution and the gated delta rule as step-by-step loops (one packed
sequence at a time, over its owned positions in source order), the gated RMS norm per head. The
same weighted loss is backpropagated in both; parameter gradients are summed over the CP group
(as Megatron's DDP does) before comparing. Outputs, input gradients and every parameter
gradient must agree within 1e-5.
"""

from __future__ import annotations

import dataclasses

import _megatron_cpu as mc
import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed

from megatron.context_parallel.plan import ContextParallelPlan

pytest.importorskip("fla", reason="megatron-core builds GatedDeltaNet only with fla installed")

ATOL = 1e-5
HIDDEN = 32
# Key and value heads divide by 2, 3 and 4; two value heads per key head (grouped values).
SHAPE = dict(key_heads=12, value_heads=24, key_dim=8, value_dim=6, kernel=4)
KINDS = ("zigzag", "contiguous", "thd", "uneven", "unowned")


def _plan(kind: str, cp: int, seed: int):
    """(plan, cu_seqlens or None), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    if kind == "zigzag":
        return ContextParallelPlan.zigzag(8 * cp, cp), None
    if kind == "contiguous":
        return ContextParallelPlan.contiguous(7 * cp + 1, cp), None
    if kind == "thd":
        cu = (0, 4 * cp, 6 * cp, 12 * cp)
        return ContextParallelPlan.thd(cu, cp), cu
    cu = (0, 9, 16, 27)
    order = torch.randperm(cu[-1], generator=g)
    if kind == "unowned":
        order = order[3:]  # three positions nobody owns
    cuts = sorted(torch.randint(0, order.numel() + 1, (cp - 2,), generator=g).tolist())
    bounds = [0] + cuts + [order.numel()]
    shards = [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    shards.insert(int(torch.randint(0, cp, (1,), generator=g)), order[:0])  # one empty rank
    return ContextParallelPlan.from_rank_positions(shards, cu[-1], cu), cu


def _config(cp: int, shape: dict = SHAPE, dtype: torch.dtype = torch.float32):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        context_parallel_size=cp,
        use_cpu_initialization=True,
        params_dtype=dtype,
        normalization="RMSNorm",
        activation_func=F.silu,
        linear_conv_kernel_dim=shape["kernel"],
        linear_key_head_dim=shape["key_dim"],
        linear_value_head_dim=shape["value_dim"],
        linear_num_key_heads=shape["key_heads"],
        linear_num_value_heads=shape["value_heads"],
        gradient_accumulation_fusion=False,
    )


def _build(cp: int, shape: dict = SHAPE, dtype: torch.dtype = torch.float32, seed: int = 5):
    """The layer under test, as megatron's local GDN layer spec would build it."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron.context_parallel.gdn import get_gated_delta_net_with_context_parallel_spec

    config = _config(cp, shape, dtype)
    torch.manual_seed(seed)
    layer = build_module(
        get_gated_delta_net_with_context_parallel_spec(),
        config,
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]),
    )
    with torch.no_grad():
        # Non-trivial norm weights, so their gradients are checked with real values.
        layer.out_norm.weight.uniform_(0.5, 1.5)
    return layer


def _batch(seq_len: int, seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(seq_len, HIDDEN, generator=g), torch.randn(seq_len, HIDDEN, generator=g)


def _run_case(rank, cp, kind, seed, shape=SHAPE, device="cpu", dtype=torch.float32):
    """One rank's forward and backward; outputs, gradients and parameters on the CPU."""
    from megatron.core import parallel_state as ps

    from megatron.context_parallel.attention import ContextParallelParams

    plan, cu = _plan(kind, cp, seed)
    layer = _build(cp, shape, dtype).to(device)
    x, weights = _batch(plan.seq_len, seed)
    group = ps.get_context_parallel_group()
    params = ContextParallelParams.for_plan(plan, group, cu_seqlens=cu, device=device)
    positions = plan.local_positions(rank)
    x, weights = x.to(device, dtype), weights.to(device, dtype)
    local = x[positions.to(device)]
    if params.padding_rows:
        local = torch.cat([local, local.new_zeros(params.padding_rows, HIDDEN)])
    local = local.unsqueeze(1).requires_grad_()
    out, bias = layer(local, None, packed_seq_params=params)
    assert bias is None
    rows = positions.numel()
    (out[:rows, 0] * weights[positions.to(device)]).sum().backward()
    grads = {name: p.grad.float().cpu() for name, p in layer.named_parameters()}
    for g in grads.values():
        torch.distributed.all_reduce(g, group=group)
    return {
        "positions": positions,
        "out": out[:rows, 0].detach().float().cpu(),
        "dx": local.grad[:rows, 0].float().cpu(),
        "grads": grads,
        "state": {k: v.detach().float().cpu() for k, v in layer.named_parameters()},
    }


def _world(rank, world_size, cases):
    """This rank's failures (strings), each case compared with the reference on this rank."""
    mc.init_parallel(1, world_size)
    failures = []
    for kind, seed in cases:
        got = _run_case(rank, world_size, kind, seed)
        failures += _compare(f"{kind} cp{world_size} rank {rank}", got, kind, world_size, seed)
    return failures


# ---------------------------------------------------------------------------------------------
# The reference: one device, plain torch, loops over time.


def _reference_sequence(proj, state, shape):
    """Conv, gated delta rule and gated norm of one sequence's projected rows ``[L, D]``."""
    hk, hv = shape["key_heads"], shape["value_heads"]
    dk, dv, width = shape["key_dim"], shape["value_dim"], shape["kernel"]
    qk, v = hk * dk, hv * dv
    length = proj.shape[0]
    qkv, gate, beta, alpha = torch.split(proj, [2 * qk + v, v, hv, hv], dim=1)
    weight = state["conv1d.weight"][:, 0]  # [C, K]
    conv = []
    for t in range(length):
        acc = torch.zeros(qkv.shape[1])
        for j in range(width):
            source = t - (width - 1) + j
            if source >= 0:
                acc = acc + weight[:, j] * qkv[source]
        conv.append(F.silu(acc))
    conv = torch.stack(conv)
    q, k, val = torch.split(conv, [qk, qk, v], dim=1)
    # fla's l2norm, which megatron's GatedDeltaNet applies: x / sqrt(sum(x^2) + 1e-6).
    q, k = q.reshape(length, hk, dk), k.reshape(length, hk, dk)
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    q = q.repeat_interleave(hv // hk, dim=1) / dk**0.5
    k = k.repeat_interleave(hv // hk, dim=1)
    val = val.reshape(length, hv, dv)
    decay = -state["A_log"].exp() * F.softplus(alpha + state["dt_bias"])
    beta = beta.sigmoid()
    memory = torch.zeros(hv, dk, dv)
    core = []
    for t in range(length):
        memory = memory * decay[t].exp()[:, None, None]
        recalled = torch.einsum("hk,hkv->hv", k[t], memory)
        delta = (val[t] - recalled) * beta[t][:, None]
        memory = memory + k[t][:, :, None] * delta[:, None, :]
        core.append(torch.einsum("hk,hkv->hv", q[t], memory))
    core = torch.stack(core)
    normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + 1e-5)
    normed = normed * state["out_norm.weight"] * F.silu(gate.reshape(length, hv, dv))
    return normed.reshape(length, v)


def _reference(kind, cp, seed, state, shape=SHAPE, dtype=torch.float32):
    """(outputs by position, input gradients by position, parameter gradients), in fp32 from
    the inputs rounded to ``dtype`` as the layer under test got them."""
    plan, cu = _plan(kind, cp, seed)
    x, weights = (t.to(dtype).float() for t in _batch(plan.seq_len, seed))
    state = {k: v.clone().requires_grad_() for k, v in state.items()}
    owned = torch.nonzero(plan.owned_mask()).flatten()
    x = x.requires_grad_()
    proj = x @ state["in_proj.weight"].T
    bounds = [0, plan.seq_len] if cu is None else list(cu)
    out = torch.zeros(plan.seq_len, HIDDEN)
    for start, end in zip(bounds[:-1], bounds[1:]):
        rows = owned[(owned >= start) & (owned < end)]
        if rows.numel():
            mixed = _reference_sequence(proj[rows], state, shape)
            out = out.index_put((rows,), mixed @ state["out_proj.weight"].T)
    (out[owned] * weights[owned]).sum().backward()
    grads = {k: v.grad for k, v in state.items()}
    return out.detach(), x.grad, grads


def _error(got: torch.Tensor, want: torch.Tensor, relative: bool) -> float:
    """Largest absolute difference (over ``1 + max|want|`` when ``relative``)."""
    if want.numel() == 0:
        return 0.0
    err = (got - want).abs().max().item()
    return err / (1.0 + want.abs().max().item()) if relative else err


def _compare(name, got, kind, cp, seed, shape=SHAPE, dtype=torch.float32, tol=ATOL):
    """Failures of one rank's case against the reference: outputs and input gradients within
    ``tol``, parameter gradients (sums over many rows) within ``tol`` of their own scale."""
    out, dx, grads = _reference(kind, cp, seed, got["state"], shape, dtype)
    pos = got["positions"]
    errors = {"out": _error(got["out"], out[pos], False), "dx": _error(got["dx"], dx[pos], False)}
    for param, g in grads.items():
        errors[f"grad {param}"] = _error(got["grads"][param], g, True)
    return [f"{name} {what}: {err:.3g}" for what, err in errors.items() if not err <= tol]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_gdn_layer_any_plan_equals_plain_torch_cp1(cp):
    kinds = KINDS if cp > 1 else ("zigzag", "thd")
    cases = [(kind, 40 + i) for i, kind in enumerate(kinds)]
    failures = sum(run_distributed(_world, cp, cases), [])
    assert not failures, "\n".join(failures)


def _refusals(rank, world_size):
    """Every rank: (the head-count error, which plans megatron's own GDN is refused under)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.spec_utils import build_module

    from megatron.context_parallel.gdn import (
        check_sequence_mixers,
        get_gated_delta_net_with_context_parallel_spec,
    )

    mc.init_parallel(1, world_size)
    try:
        _build(world_size, dict(SHAPE, key_heads=3, value_heads=9))
        heads = None
    except ValueError as exc:
        heads = str(exc)
    spec = get_gated_delta_net_with_context_parallel_spec()
    megatrons = build_module(
        dataclasses.replace(spec, module=GatedDeltaNet),
        _config(world_size),
        layer_number=3,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]),
    )
    verdicts = {}
    for kind in KINDS:
        plan, cu = _plan(kind, world_size, 7)
        try:
            check_sequence_mixers([megatrons], plan, cu)
            verdicts[kind] = "runs"
        except ValueError as exc:
            assert "GatedDeltaNet (layer 3)" in str(exc) and repr(plan) in str(exc), exc
            verdicts[kind] = "refused"
    # The package's own layer passes the same check for every plan.
    ours = _build(world_size)
    for kind in KINDS:
        check_sequence_mixers([ours], *_plan(kind, world_size, 7))
    return heads, verdicts


def test_heads_not_dividing_cp_and_megatron_gdn_under_other_plans_raise_on_every_rank():
    for heads, verdicts in run_distributed(_refusals, 2):
        assert heads is not None and "3 key heads and 9 value heads" in heads, heads
        assert "CP 2" in heads, heads
        # Only Megatron's zigzag layout of one sequence is what its own all-to-all assumes.
        assert verdicts == {
            "zigzag": "runs",
            "contiguous": "refused",
            "thd": "refused",
            "uneven": "refused",
            "unowned": "refused",
        }, verdicts
