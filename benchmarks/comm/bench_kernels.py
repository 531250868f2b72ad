"""Row-kernel benchmark: megatron_cp scatter/gather vs torch indexing and a plain device copy.

Timing (``timing.kernel_ms``): the stream is first held by a long sleep kernel, so every call of
a batch is queued before the GPU starts; CUDA events recorded between the calls then measure GPU
time only (no Python launch gaps). Each case warms up, then times many calls rotating over enough
input sets that the inputs of consecutive calls never share L2 (60 MB on an H200), and reports
the median. GB/s counts bytes read plus bytes written (index reads included), like the copy.

Usage: python benchmarks/comm/bench_kernels.py [--reps N] [--json PATH] [--markdown PATH]
       [--quick] [--with-logits] [--ours-only] [--max-threads-per-row T]

``--max-threads-per-row`` passes the kernel's tuning knob to every ``scatter_rows`` call (the
tuning sweep of ``benchmarks/run_device.sh tune`` runs 32, 64, 128, 256); without it the kernel
uses its default.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sys

import torch

_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))  # timing, the shared helper

from timing import kernel_ms  # noqa: E402

from megatron.context_parallel.comm import row_ops as ops  # noqa: E402
from megatron.context_parallel.comm.plan import ContextParallelPlan  # noqa: E402

REPORT_ROWS, REPORT_HIDDEN = 20436, 5120  # the hidden states of the bug report's input
L2_BYTES = 60 << 20
OURS_ONLY = False
MAX_THREADS_PER_ROW = None  # None: the kernel's default


def _n_sets(bytes_per_set):
    return max(2, min(64, math.ceil(3 * L2_BYTES / max(bytes_per_set, 1))))


def _uneven_plan(seq_len, cp, gen, unowned=0.01):
    perm = torch.randperm(seq_len, generator=gen)
    owned = seq_len - int(seq_len * unowned)
    weights = torch.rand(cp, generator=gen) + 0.5  # shard sizes differ up to 3x
    cuts = (torch.cumsum(weights, 0) / weights.sum() * owned).long().tolist()
    bounds = [0] + cuts[:-1] + [owned]
    return ContextParallelPlan.from_rank_positions(
        [perm[bounds[r] : bounds[r + 1]].tolist() for r in range(cp)], seq_len=seq_len
    )


def _empties_cache(bench):
    """Returns the GPU memory of a benchmark case to the driver once the case has returned.

    The inputs are locals captured by the timed closures, so they are freed only when the case
    returns; emptying the cache after that keeps one case's buffers from crowding the next.
    """

    @functools.wraps(bench)
    def run(*args, **kwargs):
        try:
            return bench(*args, **kwargs)
        finally:
            torch.cuda.empty_cache()

    return run


def _row(name, plan_name, row_bytes, rows, method, ms, moved):
    return {
        "case": name,
        "plan": plan_name,
        "row_bytes": row_bytes,
        "rows": rows,
        "method": method,
        "us": ms * 1e3,
        "GB/s": moved / (ms * 1e-3) / 1e9,
    }


@_empties_cache
def bench_scatter(name, plan, plan_name, widths, dtypes, reps, results, per_field_too=False, pad=0):
    """Unpacking the padded all-gather buffer of `plan` into source order, fields `widths`."""
    dev = torch.device("cuda")
    W = sum(widths) + pad
    offsets = [sum(widths[:f]) for f in range(len(widths))]
    slots = plan.cp_size * plan.max_count
    S = plan.seq_len
    row_source = plan.row_source(dev)
    slot_pos = plan.slot_positions(dev)
    owned = int((plan.row_source() >= 0).sum())
    # Bytes moved: owned rows read, every output row written, one int64 index per output row.
    moved = owned * W + S * W + 8 * S
    n = _n_sets(slots * W + S * W)
    packs = [torch.randint(0, 256, (slots, W), dtype=torch.uint8, device=dev) for _ in range(n)]
    # Baselines scatter by destination: padding slots go to a spare row that is dropped.
    dest = torch.where(slot_pos >= 0, slot_pos, S)
    outs = [torch.empty((S + 1, W), dtype=torch.uint8, device=dev) for _ in range(n)]
    widest = _typed_views(widths, W)
    # A field whose offset or row stride its dtype does not divide cannot be viewed as it.
    dtypes = [
        dt if W % dt.itemsize == 0 and off % dt.itemsize == 0 else wd
        for dt, wd, off in zip(dtypes, widest, offsets)
    ]

    def ours(k):
        return lambda: ops.scatter_rows(
            packs[k], row_source, offsets, widths, max_threads_per_row=MAX_THREADS_PER_ROW
        )

    def index_copy(k, typed):
        def run():
            for (off, w), dt in zip(zip(offsets, widths), typed):
                src = packs[k][:, off : off + w].view(dt)
                outs[k][:, off : off + w].view(dt).index_copy_(0, dest, src)

        return run

    def index_put(k, typed=dtypes):
        def run():
            for (off, w), dt in zip(zip(offsets, widths), typed):
                src = packs[k][:, off : off + w].view(dt)
                outs[k][:, off : off + w].view(dt).index_put_((dest,), src)

        return run

    copy_src = [torch.empty((S, W), dtype=torch.uint8, device=dev) for _ in range(n)]
    copy_dst = [torch.empty((S, W), dtype=torch.uint8, device=dev) for _ in range(n)]

    def device_copy(k):
        return lambda: copy_dst[k].copy_(copy_src[k])

    natural = "/".join(str(d).replace("torch.", "") for d in dtypes)
    methods = [
        ("megatron_cp.scatter_rows", ours),
        (f"index_copy_ ({natural})", lambda k: index_copy(k, dtypes)),
        ("index_copy_ (widest int view)", lambda k: index_copy(k, widest)),
        (f"index_put_ ({natural})", index_put),
        ("device copy (same bytes)", device_copy),
    ]
    if per_field_too and len(widths) > 1:

        def per_field(k):
            return lambda: [
                ops.scatter_rows(
                    packs[k], row_source, [o], [w], max_threads_per_row=MAX_THREADS_PER_ROW
                )
                for o, w in zip(offsets, widths)
            ]

        methods.insert(1, ("scatter_rows, one call per field", per_field))
    if OURS_ONLY:
        methods = methods[:1]
    for method, make in methods:
        ms = kernel_ms([make(k) for k in range(n)], reps)
        nbytes = 2 * S * W if method.startswith("device copy") else moved
        results.append(_row(name, plan_name, W, S, method, ms, nbytes))


def _typed_views(widths, row_bytes):
    # Baselines move each field as the widest integer type that divides it: fewer, larger
    # elements than the real dtype (bf16), which favours them.
    out = []
    for w in widths:
        for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1)):
            if w % size == 0 and row_bytes % size == 0:
                out.append(dt)
                break
    return out


@_empties_cache
def bench_gather(name, full_rows, row_elems, dtype, index, reps, results):
    """The backward: rows of a full tensor by an index, vs index_select."""
    dev = torch.device("cuda")
    row_bytes = row_elems * torch.empty((), dtype=dtype).element_size()
    m = index.numel()
    moved = 2 * m * row_bytes + 8 * m
    n = _n_sets(full_rows * row_bytes)
    srcs = [torch.randn(full_rows, row_elems, device=dev).to(dtype) for _ in range(n)]
    methods = [
        ("megatron_cp.gather_rows", lambda k: lambda: ops.gather_rows(srcs[k], index)),
        ("index_select", lambda k: lambda: srcs[k].index_select(0, index)),
    ]
    for method, make in methods:
        ms = kernel_ms([make(k) for k in range(n)], reps)
        results.append(_row(name, "-", row_bytes, m, method, ms, moved))


@_empties_cache
def bench_copy_ceiling(reps, results):
    n_bytes = 2 << 30
    a = [torch.empty(n_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    b = [torch.empty(n_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    ms = kernel_ms([lambda k=k: b[k].copy_(a[k]) for k in range(2)], max(10, reps // 5))
    results.append(_row("copy ceiling 2 GiB", "-", 0, 0, "device copy", ms, 2 * n_bytes))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    parser.add_argument("--quick", action="store_true", help="the bug report's shape at CP 4 only")
    parser.add_argument("--ours-only", action="store_true", help="skip the torch baselines")
    parser.add_argument("--with-logits", action="store_true", help="add the logits case to --quick")
    parser.add_argument(
        "--max-threads-per-row",
        type=int,
        metavar="T",
        help="most threads sharing one row in scatter_rows (power of two, 1-256; tuning sweeps)",
    )
    args = parser.parse_args()
    global OURS_ONLY, MAX_THREADS_PER_ROW
    OURS_ONLY = args.ours_only
    MAX_THREADS_PER_ROW = args.max_threads_per_row
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    if not ops.has_cuda_kernels():
        sys.exit("the compiled extension is not loaded: refusing to time the torch fallback")
    gen = torch.Generator().manual_seed(0)
    results = []
    if not args.ours_only:
        bench_copy_ceiling(args.reps, results)
    hidden_bytes = REPORT_HIDDEN * 2
    bf16 = torch.bfloat16
    cps = (4,) if args.quick else (2, 4, 8)
    for cp in cps:
        zigzag = ContextParallelPlan.zigzag(REPORT_ROWS - REPORT_ROWS % (2 * cp), cp)
        bench_scatter(
            "hidden 20436x5120 bf16",
            zigzag,
            f"zigzag CP{cp}",
            [hidden_bytes],
            [bf16],
            args.reps,
            results,
        )
        bench_scatter(
            "hidden 20436x5120 bf16",
            _uneven_plan(REPORT_ROWS, cp, gen),
            f"uneven CP{cp}",
            [hidden_bytes],
            [bf16],
            args.reps,
            results,
        )
    if not args.quick or args.with_logits:
        bench_scatter(
            "logits 4096x151936 bf16",
            _uneven_plan(4096, 4, gen, unowned=0.0),
            "uneven CP4",
            [151936 * 2],
            [bf16],
            max(20, args.reps // 5),
            results,
        )
    if not args.quick:
        bench_scatter(
            "per-token fp32 (4 B)",
            _uneven_plan(REPORT_ROWS, 4, gen),
            "uneven CP4",
            [4],
            [torch.float32],
            args.reps,
            results,
        )
        bench_scatter(
            "top-k 20 (int64 + fp32)",
            _uneven_plan(REPORT_ROWS, 4, gen),
            "uneven CP4",
            [160, 80],
            [torch.int64, torch.float32],
            args.reps,
            results,
            per_field_too=True,
        )
        mixed = [hidden_bytes, 160, 80, 4]
        mixed_types = [bf16, torch.int64, torch.float32, torch.float32]
        plan = _uneven_plan(REPORT_ROWS, 4, gen)
        bench_scatter(
            "hidden+top-k+logp, row 10484 B",
            plan,
            "uneven CP4",
            mixed,
            mixed_types,
            args.reps,
            results,
            per_field_too=True,
        )
        bench_scatter(
            "hidden+top-k+logp, row padded to 10496 B",
            plan,
            "uneven CP4",
            mixed,
            mixed_types,
            args.reps,
            results,
            per_field_too=True,
            pad=12,
        )
        plan = _uneven_plan(REPORT_ROWS, 4, gen)
        for r in range(1):
            index = plan.local_positions(r, torch.device("cuda"))
            bench_gather(
                "backward: own rows of grad",
                REPORT_ROWS,
                REPORT_HIDDEN,
                torch.bfloat16,
                index,
                args.reps,
                results,
            )
    lines = [
        "| case | plan | row bytes | rows | method | time (us) | GB/s |",
        "|---|---|---:|---:|---|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['case']} | {r['plan']} | {r['row_bytes']} | {r['rows']} | "
            f"{r['method']} | {r['us']:.1f} | {r['GB/s']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(meta, f, indent=1)


if __name__ == "__main__":
    main()
