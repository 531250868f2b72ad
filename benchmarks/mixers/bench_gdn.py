"""What the package adds to a Gated DeltaNet layer under CP, against the layer's own work.

``ContextParallelGatedDeltaNet`` wraps the layer's sequence mixing in an exchange: on the way in,
this rank's projected rows are cut into per-rank head blocks of the query, key, value, beta and
alpha columns, the gate staying home (one copy, ``gdn._SendBlocks``), and the convolution reads
the rows received by the all-to-all in source order through the index tables (on CUDA a Triton
kernel of the package, ``_gdn_conv``, in place of fla's on reordered rows; elsewhere the rows
are reordered by ``ops.permute_rows`` first); on the way out the rule's output
rows go back to receive order (``permute_rows``), and megatron's gated norm (compiled on CUDA)
reads the received head blocks through a transposed view (no copy of its own). Once per batch
the index tables (``HeadShardRows.build``) are built on the host. This script times those on
one rank, forward + backward, against the same rank's layer: the projections on its rows, the
convolution + gated delta rule on its head shard of every owned row and megatron's gated norm
on its rows. What the package adds: the reorders, plus what its convolution costs beyond fla's
on rows already in order and what the norm on the blocks costs beyond megatron's on contiguous
rows (its layer's layout). The all-to-all itself is not timed (it needs several GPUs).

Shape (Qwen3.5-27B's Gated DeltaNet: ``Qwen3_5Config`` defaults): hidden 5,120, 16 key heads x
128, 48 value heads x 128, convolution kernel 4; bf16; S = 20,436 rows in 4 packed sequences
(5,000 + 7,000 + 3,436 + 5,000), CP 2, an uneven plan (rank 0 owns a random 55% of the
positions in random order), rank 0 timed: 11,240 local rows, 20,436 rows x 8 key / 24 value
heads after the exchange.

Timing: ``--warmup`` untimed calls (fla compiles and autotunes its Triton kernels on the
first), then ``--reps`` timed ones; CUDA events on CUDA, ``perf_counter`` on CPU; the median
(``timing.time_ms``).

Run (from the repository root, one GPU, fla-core 0.6.0 and einops installed)::

    python benchmarks/mixers/bench_gdn.py

``--seq-len``, ``--hidden`` and the head options shrink it (the CPU smoke test does).
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))  # timing, the shared helper

from megatron.core.ssm.gated_delta_net import common as _gdn_common  # noqa: E402
from timing import time_ms  # noqa: E402

from megatron.context_parallel.comm.plan import ContextParallelPlan  # noqa: E402
from megatron.context_parallel.comm.row_ops import permute_rows  # noqa: E402
from megatron.context_parallel.mixers import gdn  # noqa: E402
from megatron.context_parallel.mixers.gdn import (  # noqa: E402
    ContextParallelGatedDeltaNet,
    HeadShardRows,
    get_gated_delta_net_with_context_parallel_spec,
)

DOCUMENTS = (5000, 7000, 3436, 5000)  # 20,436 rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=sum(DOCUMENTS))
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--key-heads", type=int, default=16)
    p.add_argument("--value-heads", type=int, default=48)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kernel", type=int, default=4)
    p.add_argument("--share", type=float, default=0.55, help="rank 0's share of the positions")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--lift-fla-hopper-guard",
        action="store_true",
        help="time fla's gated backward on Hopper with Triton < 3.7.1, which fla refuses (its "
        "issue 640: wrong results there); for timing only, and said so in the table",
    )
    return p


def uneven_plan(seq_len: int, cp: int, share: float, seed: int = 0) -> ContextParallelPlan:
    """Packed documents (``DOCUMENTS`` scaled to ``seq_len``); rank 0 owns ``share`` of the
    positions, the other ranks split the rest; every rank's rows in random order."""
    g = torch.Generator().manual_seed(seed)
    total = sum(DOCUMENTS)
    cuts = [round(seq_len * sum(DOCUMENTS[:i]) / total) for i in range(len(DOCUMENTS) + 1)]
    order = torch.randperm(seq_len, generator=g)
    first = round(seq_len * share)
    rest = torch.tensor_split(order[first:], cp - 1)
    return ContextParallelPlan.from_rank_positions([order[:first], *rest], seq_len, cuts)


def build_layer(args, dtype: torch.dtype) -> ContextParallelGatedDeltaNet:
    """The layer at CP 1 (its mixing is then called for rank 0's head chunk of ``args.cp``)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.hidden,
        num_attention_heads=args.key_heads,
        use_cpu_initialization=True,
        params_dtype=dtype,
        normalization="RMSNorm",
        activation_func=F.silu,
        linear_conv_kernel_dim=args.kernel,
        linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim,
        linear_num_key_heads=args.key_heads,
        linear_num_value_heads=args.value_heads,
        gradient_accumulation_fusion=False,
    )
    torch.manual_seed(0)
    layer = build_module(
        get_gated_delta_net_with_context_parallel_spec(),
        config,
        layer_number=1,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]),
    )
    return layer.to(args.device)


def _fwd_bwd(
    forward: Callable[[], Sequence[torch.Tensor]], leaves: Sequence[torch.Tensor]
) -> Callable[[], None]:
    """A call that runs ``forward`` and backpropagates ones through all its outputs.

    In the layer these activations' gradients are produced once and consumed by the next
    step back; here they are leaves, so each call first drops the previous call's gradients
    (else autograd would add into them, a read-modify-write the layer never does). The output
    gradients are made once, outside the timed calls."""
    grads: list = []

    def call():
        for leaf in leaves:
            leaf.grad = None
        outs = forward()
        if not grads:
            grads.extend(torch.ones_like(o) for o in outs)
        torch.autograd.backward(list(outs), grads)

    return call


def measure(args) -> Dict[str, float]:
    """Milliseconds per piece (median), and the overhead's shares."""
    device, dtype = args.device, getattr(torch, args.dtype)
    cp = args.cp
    plan = uneven_plan(args.seq_len, cp, args.share)
    host = time_ms(
        lambda: HeadShardRows.build(plan, plan.cu_seqlens, torch.device(device)),
        torch.device("cpu"),
        args.reps,
        1,
    )
    tables = HeadShardRows.build(plan, plan.cu_seqlens, torch.device(device))
    layer = build_layer(args, dtype)
    n, owned = plan.counts[0], int(tables.to_source.numel())
    width_in = layer.in_proj_dim
    width_out = layer.v_dim // cp

    def leaf(*shape):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_()

    hidden = leaf(n, 1, args.hidden)
    local = leaf(n, width_in)
    received = leaf(owned, sum(layer._received_widths(cp)))
    mixed = leaf(owned, width_out)
    returned = leaf(cp * n, width_out)
    core_rows = leaf(n, layer.v_dim)
    # The gate as the layer's norm gets it: a (strided) view of the projected rows.
    first, width = layer._send_spans()[1]
    gate = local.detach()[:, first : first + width].requires_grad_()
    normed = leaf(n, 1, layer.v_dim)

    # On CUDA with fla the layer's convolution reads the received rows through the source-order
    # index (gdn._mix_received): no reorder on the way in, a convolution of its own instead.
    gathered = torch.device(device).type == "cuda" and _gdn_common.HAVE_FLA
    conv_weight, conv_bias = layer._conv_params(0, cp)
    widths = list(layer._received_widths(cp))

    def reorders():
        # The package's own copies around the two all-to-alls (gdn.py), nothing else.
        send, gate_home = gdn._SendBlocks.apply(local, *layer._send_spans(), cp)
        back = permute_rows(mixed, tables.from_source, tables.to_source)
        if gathered:
            return send, gate_home, back
        mine = permute_rows(received, tables.to_source, tables.from_source)
        return send, gate_home, mine, back

    def conv_rows():
        # megatron's layer: fla's convolution on its own rows (the received rows stand in).
        return (layer._convolve(received[:, : widths[0]], conv_weight, conv_bias, tables),)

    def conv_package():
        # The layer's: through the index (CUDA), else the same as conv_rows after the reorder.
        if not gathered:
            return conv_rows()
        from megatron.context_parallel.mixers.gdn_conv import gathered_causal_conv

        return gathered_causal_conv(
            received, conv_weight, conv_bias, tables.to_source, tables.from_source,
            tables.offsets, widths[0], layer.activation,
        )  # fmt: skip

    def reorders_by_element():
        # The same with the head-block copies one element at a time (no integer words).
        words = gdn._as_words
        gdn._as_words = lambda tensors, columns: (list(tensors), 1)
        try:
            return reorders()
        finally:
            gdn._as_words = words

    dv = layer.value_head_dim
    apply_norm = layer._apply_gated_norm  # megatron's, compiled by its jit_fuser
    if torch.device(device).type != "cuda":  # as gdn._gated_norm: eager off CUDA
        apply_norm = functools.partial(gdn._eager_apply_gated_norm, layer)

    def norm_rows():
        # megatron's gated norm on the rank's own rows laid out as its layer has them.
        return (apply_norm(core_rows.view(n, -1, dv), gate.view(n, -1, dv)),)

    def mixing():
        # The head chunk's convolution and rule, and megatron's gated norm on the rank's rows.
        qkv, beta, alpha = torch.split(received, widths, dim=1)
        return layer._mix(qkv, beta, alpha, tables, 0, cp), norm_rows()[0]

    def norm_blocks():
        # The layer's own: the norm on the returned head blocks read as rows.
        return (layer._gated_norm(returned, gate, cp),)

    def rule_and_conv():
        # The convolution and the rule alone on the same rows, the calls _mix makes.
        qk, v = layer.qk_dim // cp, layer.v_dim // cp
        hk, hv, d = layer.num_key_heads // cp, layer.num_value_heads // cp, args.head_dim
        qkv = layer._convolve(received[:, : 2 * qk + v], conv_weight, conv_bias, tables)
        q, k, val = torch.split(qkv, [qk, qk, v], dim=1)
        decay = -F.softplus(received[:, -hv:].float())
        beta = received[:, -2 * hv : -hv].sigmoid()
        q, k = q.reshape(1, owned, hk, d), k.reshape(1, owned, hk, d)
        return (layer._delta_rule(q, k, val.reshape(1, owned, hv, d), decay, beta, tables),)

    def projections():
        projected, _ = layer.in_proj(hidden)
        out, _ = layer.out_proj(normed)
        return projected, out

    activations = (hidden, local, received, mixed, returned, core_rows, gate, normed)
    pieces = (
        ("reorders", reorders),
        ("conv_rows", conv_rows),
        ("conv_package", conv_package),
        ("rule_and_conv", rule_and_conv),
        ("mixing", mixing),
        ("norm_rows", norm_rows),
        ("norm_blocks", norm_blocks),
        ("projections", projections),
    )
    ms = {}
    for name, fn in pieces:
        with torch.no_grad():
            ms[name + "_fwd"] = time_ms(fn, torch.device(device), args.reps, args.warmup)
    ms["added_fwd"] = (
        ms["reorders_fwd"]
        + ms["conv_package_fwd"]
        - ms["conv_rows_fwd"]
        + ms["norm_blocks_fwd"]
        - ms["norm_rows_fwd"]
    )
    ms["layer_fwd"] = ms["added_fwd"] + ms["mixing_fwd"] + ms["projections_fwd"]
    ms["overhead_of_layer_fwd"] = ms["added_fwd"] / ms["layer_fwd"]
    ms["guard_lifted"] = bool(args.lift_fla_hopper_guard)
    if args.lift_fla_hopper_guard:
        import fla.ops.common.chunk_o as chunk_o

        chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        for name, fn in pieces:
            ms[name] = time_ms(
                _fwd_bwd(fn, activations), torch.device(device), args.reps, args.warmup
            )
    except RuntimeError as exc:
        if "3.7.1" not in str(exc):
            raise
        # fla refuses its gated backward on Hopper with this Triton: forward rows only.
        print(f"backward not timed: {str(exc)[:200]}")
        ms.update(local_rows=n, owned_rows=owned, tables_host=host)
        return ms
    ms["reorders_by_element"] = time_ms(
        _fwd_bwd(reorders_by_element, activations),
        torch.device(device),
        args.reps,
        args.warmup,
    )
    ms["tables_host"] = host
    ms["added"] = (
        ms["reorders"] + ms["conv_package"] - ms["conv_rows"] + ms["norm_blocks"] - ms["norm_rows"]
    )
    ms["gathered_conv"] = gathered
    ms["layer"] = ms["added"] + ms["mixing"] + ms["projections"]
    ms["overhead_of_layer"] = ms["added"] / ms["layer"]
    ms["overhead_of_rule_and_conv"] = ms["added"] / ms["rule_and_conv"]
    ms.update(local_rows=n, owned_rows=owned)
    return ms


def table(args, ms: Dict[str, float]) -> str:
    """A short Markdown table of one measurement."""
    rows = [
        ("index tables, host, once per batch", f"{ms['tables_host']:.2f} ms"),
        ("reorders fwd (package)", f"{ms['reorders_fwd']:.3f} ms"),
        (
            "gated norm fwd on rows (megatron's layout) / on the returned blocks (ours)",
            f"{ms['norm_rows_fwd']:.3f} / {ms['norm_blocks_fwd']:.3f} ms",
        ),
        (
            "convolution fwd on rows (megatron's) / the package's",
            f"{ms['conv_rows_fwd']:.3f} / {ms['conv_package_fwd']:.3f} ms",
        ),
        (
            "added fwd: reorders + (conv - conv on rows) + (norm on blocks - norm on rows)",
            f"{ms['added_fwd']:.3f} ms",
        ),
        ("conv + gated delta rule fwd", f"{ms['rule_and_conv_fwd']:.3f} ms"),
        ("mixing fwd", f"{ms['mixing_fwd']:.3f} ms"),
        ("in/out projections fwd", f"{ms['projections_fwd']:.3f} ms"),
        ("added / layer, fwd", f"{100 * ms['overhead_of_layer_fwd']:.2f} %"),
    ]
    if "layer" not in ms:
        rows.append(("fwd+bwd", "not timed: fla refuses its gated backward here"))
        return _markdown(args, ms, rows)
    rows += [
        ("reorders fwd+bwd (package)", f"{ms['reorders']:.3f} ms"),
        (
            "same, head-block copies by element (not in 8-byte words)",
            f"{ms['reorders_by_element']:.3f} ms",
        ),
        (
            "gated norm fwd+bwd on rows / on the returned blocks",
            f"{ms['norm_rows']:.3f} / {ms['norm_blocks']:.3f} ms",
        ),
        (
            "convolution fwd+bwd on rows (megatron's) / the package's"
            + (" (through the index)" if ms.get("gathered_conv") else ""),
            f"{ms['conv_rows']:.3f} / {ms['conv_package']:.3f} ms",
        ),
        (
            "added fwd+bwd: reorders + (conv - conv on rows) + (norm on blocks - norm on rows)",
            f"{ms['added']:.3f} ms",
        ),
        ("conv + gated delta rule fwd+bwd", f"{ms['rule_and_conv']:.3f} ms"),
        ("mixing fwd+bwd (conv, rule, gates, norm)", f"{ms['mixing']:.3f} ms"),
        ("in/out projections fwd+bwd", f"{ms['projections']:.3f} ms"),
        ("layer fwd+bwd on one rank (no all-to-all)", f"{ms['layer']:.3f} ms"),
        ("added / layer", f"{100 * ms['overhead_of_layer']:.2f} %"),
        ("added / conv + rule", f"{100 * ms['overhead_of_rule_and_conv']:.2f} %"),
    ]
    if ms.get("guard_lifted"):
        rows.append(
            (
                "note",
                "fla's Hopper guard lifted for timing: its gated backward may compute wrong "
                "values with this Triton (fla issue 640); times only",
            )
        )
    return _markdown(args, ms, rows)


def _markdown(args, ms, rows) -> str:
    head = (
        f"GDN S={args.seq_len} CP={args.cp} rank 0 ({ms['local_rows']} local rows, "
        f"{ms['owned_rows']} after the exchange), hidden {args.hidden}, {args.key_heads}x"
        f"{args.head_dim} key / {args.value_heads}x{args.head_dim} value heads, kernel "
        f"{args.kernel}, {args.dtype} on {args.device}"
    )
    lines = [head, "", "| piece | time |", "|---|---|"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def _init_single_rank() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as megatron_random

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel()
    # GatedDeltaNet initialises under the model-parallel RNG fork; a single rank needs none.
    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    args = _parser().parse_args(argv)
    _init_single_rank()
    ms = measure(args)
    print(table(args, ms))
    return ms


if __name__ == "__main__":
    main()
