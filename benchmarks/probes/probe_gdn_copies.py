"""Each copy of the Gated DeltaNet exchange timed alone, with its bandwidth, and the projections
that could absorb the two side-by-side copies (issue 28's overhead budget).

Shapes as ``bench_gdn.py`` (Qwen3.5-27B's GDN layer, S = 20,436, CP 2, rank 0 of the uneven
plan). For each piece: forward ms, forward + backward ms (gradient of ones, leaves' grads
dropped), the bytes it moves and GB/s; the head-block copies in 8-byte words (the package's)
and one element at a time; a clone of the projected rows is the bandwidth reference. Then the
input projection as one GEMM + the head-block cut against batched GEMMs that write the head
blocks directly (one per section, output views into the block buffer), and the output
projection on side-by-side rows against one accumulating GEMM per head block. megatron's gated
norm (its ``_apply_gated_norm``, compiled by its ``jit_fuser``, and the eager original) on
contiguous rows, as its layer runs it, and on a transposed view of the returned head blocks, as
``gdn._gated_norm`` runs it: what the layout change costs inside the norm.

Run on a GPU from the repository root: ``python benchmarks/probes/probe_gdn_copies.py``.
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_gdn import _init_single_rank, _parser, build_layer, uneven_plan  # noqa: E402
from bench_head import time_ms  # noqa: E402

from megatron.context_parallel import gdn  # noqa: E402
from megatron.context_parallel.gdn import HeadShardRows, _SendBlocks  # noqa: E402
from megatron.context_parallel.ops import permute_rows  # noqa: E402


def main():
    args = _parser().parse_args()
    _init_single_rank()
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    cp = args.cp
    plan = uneven_plan(args.seq_len, cp, args.share)
    tables = HeadShardRows.build(plan, plan.cu_seqlens, dev)
    layer = build_layer(args, dtype)
    n, owned = plan.counts[0], int(tables.to_source.numel())
    d_in, d_out = layer.in_proj_dim, layer.v_dim
    sections = tuple(layer.in_proj_split_sections)

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_()

    local = leaf(n, d_in)
    received = leaf(owned, sum(layer._received_widths(cp)))
    mixed = leaf(owned, d_out // cp)
    returned = leaf(cp * n, d_out // cp)
    core_rows = leaf(n, d_out)
    first, width = layer._send_spans()[1]
    gate = local.detach()[:, first : first + width].requires_grad_()  # a view, as in the layer
    esize = local.element_size()

    dv = layer.value_head_dim
    eager_norm = gdn._eager_apply_gated_norm

    def side_by_side(blocks):
        return blocks.view(cp, n, -1).transpose(0, 1).reshape(n, -1)

    def blocks_view(blocks):
        return blocks.view(cp, n, -1, dv).transpose(0, 1)

    def outputs(fn):
        out = fn()
        return list(out) if isinstance(out, tuple) else [out]

    def fb(fn, leaves):
        grads = [torch.ones_like(o) for o in outputs(fn)]

        def bwd():
            for x in leaves:
                x.grad = None
            torch.autograd.backward(outputs(fn), grads)

        with torch.no_grad():
            f = time_ms(fn, dev, args.reps, args.warmup)
        b = time_ms(bwd, dev, args.reps, args.warmup)
        return f, b

    pieces = {
        "clone of the projected rows (reference)": (lambda: local.clone(), [local], local.numel()),
        "head-block cut and gate (_SendBlocks)": (
            lambda: _SendBlocks.apply(local, *layer._send_spans(), cp),
            [local],
            local.numel(),
        ),
        "source order in (permute_rows)": (
            lambda: permute_rows(received, tables.to_source, tables.from_source),
            [received],
            received.numel(),
        ),
        "receive order out (permute_rows)": (
            lambda: permute_rows(mixed, tables.from_source, tables.to_source),
            [mixed],
            mixed.numel(),
        ),
        "side by side (torch reshape of the blocks)": (
            lambda: side_by_side(returned),
            [returned],
            returned.numel(),
        ),
        "gated norm on rows, megatron's compiled (its layer's layout)": (
            lambda: layer._apply_gated_norm(core_rows.view(n, -1, dv), gate.view(n, -1, dv)),
            [core_rows, gate],
            core_rows.numel(),
        ),
        "gated norm on rows, megatron's eager": (
            lambda: eager_norm(layer, core_rows.view(n, -1, dv), gate.view(n, -1, dv)),
            [core_rows, gate],
            core_rows.numel(),
        ),
        "gated norm on the returned blocks, compiled (the package's)": (
            lambda: layer._gated_norm(returned, gate, cp),
            [returned, gate],
            returned.numel(),
        ),
        "gated norm on the returned blocks, megatron's compiled given the view": (
            lambda: layer._apply_gated_norm(blocks_view(returned), gate.view(n, -1, dv)),
            [returned, gate],
            returned.numel(),
        ),
        "gated norm on the returned blocks, eager (the CPU path)": (
            lambda: eager_norm(layer, blocks_view(returned), gate.view(n, -1, dv)),
            [returned, gate],
            returned.numel(),
        ),
    }
    print(f"n={n} owned={owned} D_in={d_in} V={d_out} cp={cp} on {dev}")
    print("| piece | MB moved one way | fwd ms | fwd+bwd ms | fwd GB/s |")
    print("|---|---|---|---|---|")
    words = gdn._as_words
    for copies in ("words", "element"):
        if copies == "element":  # the head-block copies one element at a time
            gdn._as_words = lambda tensors, columns: (list(tensors), 1)
        for name, (fn, leaves, numel) in pieces.items():
            moves_blocks = name.startswith("head-block")
            if copies == "element" and not moves_blocks:
                continue
            f, b = fb(fn, leaves)
            moved = 2 * numel * esize  # read + write
            label = f"{name}, by {copies}" if moves_blocks else name
            print(f"| {label} | {moved / 1e6:.0f} | {f:.3f} | {b:.3f} | {moved / f / 1e6:.0f} |")
    gdn._as_words = words

    # Compiles of the package's norm over 20 batches of random row counts (a compiler must not
    # compile per batch): dynamo's frame and graph counters, around fresh layers' calls.
    from torch._dynamo.utils import counters

    if dev.type == "cuda":
        torch._dynamo.reset()
        counters.clear()
        other = build_layer(args, dtype)
        gen = torch.Generator().manual_seed(0)
        for _i in range(20):
            m = int(torch.randint(1, n, (1,), generator=gen))
            blocks = torch.randn(cp * m, d_out // cp, device=dev, dtype=dtype, requires_grad=True)
            g = torch.randn(m, d_out, device=dev, dtype=dtype, requires_grad=True)
            for lay in (layer, other):
                lay._gated_norm(blocks, g, cp).sum().backward()
        torch.cuda.synchronize()
        print(
            "norm compiles over 20 random row counts x 2 layers:",
            dict(counters["stats"]),
            "recompiles:",
            sum(counters["recompiles"].values()) if "recompiles" in counters else 0,
        )

    # The input projection: one GEMM then the cut, against batched GEMMs into the blocks.
    hidden = torch.randn(n, args.hidden, device=dev, dtype=dtype)
    weight = layer.in_proj.weight.detach()

    every = tuple((sum(sections[:i]), w) for i, w in enumerate(sections))

    def gemm_then_cut():  # every section cut, as the batched GEMMs below write them
        return gdn._rows_to_blocks(hidden @ weight.t(), every, cp)

    def gemm_into_blocks():
        blocks = hidden.new_empty(cp, n, d_in // cp)
        row, col = 0, 0
        wide = hidden.expand(cp, n, args.hidden)
        for width in sections:
            part = width // cp
            w = weight[row : row + width].view(cp, part, args.hidden).transpose(1, 2)
            torch.bmm(wide, w, out=blocks[:, :, col : col + part])
            row, col = row + width, col + part
        return blocks.view(cp * n, -1)

    with torch.no_grad():
        a, b = gemm_then_cut(), gemm_into_blocks()
        print("in_proj blocks equal:", torch.equal(a, b), "max diff", (a - b).abs().max().item())
        g = time_ms(lambda: hidden @ weight.t(), dev, args.reps, args.warmup)
        gc = time_ms(gemm_then_cut, dev, args.reps, args.warmup)
        gb = time_ms(gemm_into_blocks, dev, args.reps, args.warmup)
    print(f"in_proj GEMM {g:.3f} ms; GEMM + cut {gc:.3f} ms; GEMMs into blocks {gb:.3f} ms")

    # The output projection: side by side then one GEMM, against accumulating GEMMs per block.
    w_out = layer.out_proj.weight.detach()
    part = d_out // cp
    blocks_out = returned.detach().view(cp, n, part)

    def sbs_then_gemm():
        return side_by_side(returned.detach()) @ w_out.t()

    def gemms_per_block():
        out = blocks_out[0] @ w_out[:, :part].t()
        for c in range(1, cp):
            out.addmm_(blocks_out[c], w_out[:, c * part : (c + 1) * part].t())
        return out

    with torch.no_grad():
        a, b = sbs_then_gemm(), gemms_per_block()
        print("out_proj max diff", (a.float() - b.float()).abs().max().item())
        s = time_ms(sbs_then_gemm, dev, args.reps, args.warmup)
        p = time_ms(gemms_per_block, dev, args.reps, args.warmup)
    print(f"out_proj: side by side + GEMM {s:.3f} ms; GEMM per block, accumulated {p:.3f} ms")


if __name__ == "__main__":
    main()
