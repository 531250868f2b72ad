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

import _megatron_cpu as mc
import pytest
import torch
import torch.nn.functional as F
from _dist import run_distributed
from _gdn_ref import gated_delta_net_sequence

from megatron.context_parallel.comm.plan import ContextParallelPlan

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

    from megatron.context_parallel.mixers.gdn import get_gated_delta_net_with_context_parallel_spec

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

    from megatron.context_parallel.params import ContextParallelParams

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
# The reference: one device, plain torch, loops over time (_gdn_ref).


def _reference(kind, cp, seed, state, shape=SHAPE, dtype=torch.float32):
    """(outputs by position, input gradients by position, parameter gradients), in fp32 from
    the inputs rounded to ``dtype`` as the layer under test got them."""
    plan, cu = _plan(kind, cp, seed)
    x, weights = (t.to(dtype).float() for t in _batch(plan.seq_len, seed))
    state = {k: v.clone().requires_grad_() for k, v in state.items()}
    owned = torch.nonzero(plan.owned_mask()).flatten()
    x = x.requires_grad_()
    proj = x @ state["in_proj.weight"].T

    def norm(core):
        return (
            core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + 1e-5) * state["out_norm.weight"]
        )

    bounds = [0, plan.seq_len] if cu is None else list(cu)
    out = torch.zeros(plan.seq_len, HIDDEN)
    for start, end in zip(bounds[:-1], bounds[1:]):
        rows = owned[(owned >= start) & (owned < end)]
        if rows.numel():
            mixed = gated_delta_net_sequence(
                proj[rows],
                state["conv1d.weight"][:, 0],
                state["A_log"],
                state["dt_bias"],
                norm,
                shape,
            )
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
    """Every rank's messages: a layer built at CP 2 with 3 key heads, and a batch at CP 2 for a
    hybrid built (at CP 1) with 3 key heads."""
    from megatron.core import parallel_state as ps

    from megatron.context_parallel import context_parallel_batch

    mc.init_parallel(1, world_size)
    messages = []
    try:
        _build(world_size, dict(SHAPE, key_heads=3, value_heads=9))
        messages.append(None)
    except ValueError as exc:
        messages.append(str(exc))
    mc.init_parallel(1, 1)
    mc.TINY_GDN = dict(mc.TINY_GDN, linear_num_key_heads=3, linear_num_value_heads=9)
    model = mc.build_tiny_gpt(pattern="*G")
    mc.init_parallel(1, world_size)
    try:
        context_parallel_batch(model, torch.arange(24), cp_group=ps.get_context_parallel_group())
        messages.append(None)
    except ValueError as exc:
        messages.append(str(exc))
    return messages


def test_heads_not_dividing_cp_raise_on_every_rank_at_build_and_at_the_batch():
    for built, batch in run_distributed(_refusals, 2):
        for message, layer in ((built, 1), (batch, 2)):
            assert message is not None, "no error"
            assert f"Gated DeltaNet layer {layer}: CP 2" in message, message
            assert "3 key heads and 9 value heads per TP rank" in message, message


def test_permute_rows_moves_rows_and_gradients_exactly():
    from megatron.context_parallel.comm.row_ops import permute_rows

    g = torch.Generator().manual_seed(3)
    src = torch.randn(11, 3, 2, generator=g, dtype=torch.float64).requires_grad_()
    index = torch.randperm(11, generator=g)
    inverse = torch.argsort(index)
    out = permute_rows(src, index, inverse)
    assert torch.equal(out, src.detach()[index])
    grad = torch.randn(11, 3, 2, generator=g, dtype=torch.float64)
    out.backward(grad)
    expected = torch.zeros_like(grad)
    for i, j in enumerate(index.tolist()):
        expected[j] = grad[i]
    assert torch.equal(src.grad, expected)
    with pytest.raises(ValueError, match="a permutation of 11 rows"):
        permute_rows(src, index[:5], inverse)


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", ["element", "words"])
def test_send_blocks_move_columns_and_gradients_exactly(cp, dtype, layout):
    """Block ``c`` of ``_SendBlocks`` holds the ``c``-th ``1/cp`` of the q, k, v, beta and
    alpha sections (megatron's order q, k, v, z, beta, alpha) side by side; the gate (z) comes
    out as a view of the input; the gradients go back to the same columns. The reference indexes
    columns one by one. ``element``: sections and a buffer offset that no wider word divides
    (element copies); ``words``: every 1/cp of a section a multiple of 4 bf16 (8-byte words)."""
    from megatron.context_parallel.mixers.gdn import ContextParallelGatedDeltaNet, _SendBlocks

    if layout == "element":
        sections = [2 * cp, 2 * cp, 3 * cp, 5, cp, cp]
    else:
        sections = [4 * cp, 4 * cp, 12 * cp, 8, 4 * cp, 4 * cp]
    layer = ContextParallelGatedDeltaNet.__new__(ContextParallelGatedDeltaNet)
    layer.in_proj_split_sections = sections
    g = torch.Generator().manual_seed(cp)
    n, width = 5, sum(sections)
    # A column slice of a wider buffer: the rows need not be contiguous.
    skip = 1 if layout == "element" else 4
    local = torch.randn(n, width + 8, generator=g).to(dtype)[:, skip : width + skip]
    local.requires_grad_()
    starts = [sum(sections[:i]) for i in range(6)]
    gate_columns = list(range(starts[3], starts[3] + sections[3]))
    columns = []  # for each block c, the source columns side by side
    for c in range(cp):
        for i in (0, 1, 2, 4, 5):
            part = sections[i] // cp
            columns += [starts[i] + c * part + j for j in range(part)]
    columns = torch.tensor(columns).view(cp, -1)
    blocks, gate = _SendBlocks.apply(local, *layer._send_spans(), cp)
    expected = torch.cat([local.detach()[:, columns[c]] for c in range(cp)])
    sent = width - sections[3]
    assert blocks.shape == (cp * n, sent // cp)
    assert torch.equal(blocks, expected)
    assert (
        gate.dtype == dtype
        and gate.data_ptr() == local.data_ptr() + starts[3] * gate.element_size()
    )
    assert torch.equal(gate, local.detach()[:, gate_columns])
    grad = torch.randn(cp * n, sent // cp, generator=g).to(dtype)
    grad_gate = torch.randn(n, sections[3], generator=g).to(dtype)
    torch.autograd.backward([blocks, gate], [grad, grad_gate])
    want = torch.zeros(n, width, dtype=dtype)
    for c in range(cp):
        want[:, columns[c]] = grad[c * n : (c + 1) * n]
    want[:, gate_columns] = grad_gate
    assert torch.equal(local.grad, want)
    # A rank that owns no rows sends empty blocks.
    empty, _ = _SendBlocks.apply(local.detach()[:0], *layer._send_spans(), cp)
    assert empty.shape == (0, sent // cp)


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [5, 0])
def test_gated_norm_of_blocks_equals_megatrons_on_rows(cp, dtype, rows):
    """``_gated_norm`` on the head blocks the way back delivers (block ``c``: head chunk ``c``
    of the rows) equals megatron's gated norm expression on the rows with the blocks put side
    by side by an index loop, bit for bit: the output, the blocks' gradient and the gate's (a
    strided view of wider rows, as the layer passes it); the norm weight's gradient to
    rounding. On CPU the layer calls megatron's eager function on a transposed view of the
    blocks; the reference writes the expression out on rows laid out independently.
    ``rows=0``: an empty rank."""
    import types

    from megatron.context_parallel.mixers.gdn import ContextParallelGatedDeltaNet

    g = torch.Generator().manual_seed(cp * 10 + rows)
    heads, dv = 2 * cp, 8
    width = heads * dv
    part = width // cp

    def make_layer():
        norm = torch.nn.RMSNorm(dv, eps=1e-6, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(dv, generator=g))
        return types.SimpleNamespace(value_head_dim=dv, out_norm=norm, act_fn=F.silu)

    ours, theirs = make_layer(), make_layer()
    theirs.out_norm.load_state_dict(ours.out_norm.state_dict())
    blocks = torch.randn(cp * rows, part, generator=g).to(dtype).requires_grad_()
    wide = torch.randn(rows, width + 6, generator=g).to(dtype)
    gate = wide[:, 3 : width + 3].requires_grad_()
    side = torch.empty(rows, width, dtype=dtype)
    for i in range(rows):
        for c in range(cp):
            side[i, c * part : (c + 1) * part] = blocks.detach()[c * rows + i]
    side.requires_grad_()
    gate_ref = gate.detach().clone().requires_grad_()

    got = ContextParallelGatedDeltaNet._gated_norm(ours, blocks, gate, cp)
    # megatron's ``_apply_gated_norm`` written out eagerly (megatron wraps it in
    # ``torch.compile``, whose fused kernel rounds differently from any eager code).
    normed = theirs.out_norm(side.reshape(-1, dv))
    want = (normed * F.silu(gate_ref.float().reshape(-1, dv))).to(dtype).reshape(rows, width)
    assert got.shape == (rows, width) and got.dtype == dtype
    assert torch.equal(got, want)
    grad = torch.randn(rows, width, generator=g).to(dtype)
    got.backward(grad)
    want.backward(grad)
    want_blocks = torch.empty(cp * rows, part, dtype=dtype)
    for i in range(rows):
        for c in range(cp):
            want_blocks[c * rows + i] = side.grad[i, c * part : (c + 1) * part]
    assert torch.equal(blocks.grad, want_blocks)
    assert torch.equal(gate.grad, gate_ref.grad)
    torch.testing.assert_close(ours.out_norm.weight.grad, theirs.out_norm.weight.grad)
