"""The ping-pong d_logits kernel (``_vocab_gluon``) against the Triton one and the unit GEMM (GPU).

First checks it: on shapes with ragged rows and columns, its ``d_logits`` against our Triton
kernel's on the same inputs (bits equal, or the largest difference). Then times, in turns and
with the GPU busy 2 ms before each start (bench_head's "queued"), all the backward's slices of
each kernel against the unit GEMM ``hidden @ weight.T``, for each ping-pong config, and the
forward without a top-k (the whole call through each kernel, and the Gluon kernel alone per
config).

    PYTHONPATH=$PWD python3 benchmarks/probes/probe_pingpong.py [--reps 7] [--shapes 20436x151936]

``--topk``: instead, the top-20 forward: the whole call through the Gluon and the Triton
kernels, each kernel alone, and the Gluon kernel per ring / grouping variant.

``--topk-splits``: the top-20 forward's kernels alone per column split count (how many row
blocks the programs hold at once, so how much of the hidden operand stays in L2), and the whole
Gluon call at a forced split count.

``--profile``: the GPU kernels of one top-20 call per shape (torch.profiler), after a ~1 ms busy
lead so that its launches queue as in a training step.
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "head"))

from bench_head import dlogits_inputs  # noqa: E402
from timing import gpu_sleep, time_round_robin  # noqa: E402

from megatron.context_parallel.head import vocab_gluon as pp  # noqa: E402
from megatron.context_parallel.head import vocab_ops  # noqa: E402

dev = torch.device("cuda")
SMS = vocab_ops._sm_count(dev)
H = 5120

VARIANTS = [
    ("4 stages, group 16", {}),
    ("5 stages, group 16", dict(stages=5)),
    ("4 stages, group 8", dict(GROUP=8)),
]


def _inputs(n, vocab, seed):
    gen = torch.Generator(device=dev).manual_seed(seed)
    hidden = torch.randn(n, H, device=dev, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(vocab, H, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    return hidden, weight


def _kernels(hidden, weight, width=None):
    """The Triton kernel and each ping-pong variant over the same inputs and slices:
    ``{name: (d, slices)}``."""
    cfg = dict(vocab_ops.current_kernel_config()["bwd"])
    out = {"triton": dlogits_inputs(hidden, weight, dev, cfg, width=width)}
    width = out["triton"][0].shape[1]
    for label, over in VARIANTS:
        pcfg = dict(pp.CONFIG, **over)

        def launcher(*args, pcfg=pcfg):
            pp.launch_dlogits_pingpong(*args, SMS, pcfg)

        out[label] = dlogits_inputs(
            hidden, weight, dev, dict(cfg, BN=pcfg["BN"]), launcher=launcher, width=width
        )
    return out


def check(n, vocab, width):
    hidden, weight = _inputs(n, vocab, n + vocab)
    runs = _kernels(hidden, weight, width)
    lines = []
    ref_d, ref_slices = runs.pop("triton")
    for label, (d, slices) in runs.items():
        same, worst = True, 0.0
        for (v0, v1, ref_launch), (_, _, launch) in zip(ref_slices, slices):
            ref_d.fill_(float("nan"))
            d.fill_(float("nan"))
            ref_launch()
            launch()
            torch.cuda.synchronize()
            a, b = ref_d[:, : v1 - v0], d[:, : v1 - v0]
            same &= bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
            worst = max(worst, (a.float() - b.float()).abs().max().item())
        lines.append(f"| {n} x {vocab} / {width} | {label} | {same} | {worst:.3g} |")
    return lines


def _call(hidden, weight, k, pingpong, splits=None):
    """One whole ``vocab_stats`` call with top-k ``k`` (its config "fwd_topk", or "fwd" for 0)
    through the Gluon (``pingpong``) or the Triton kernel, with the Gluon top-k's split count
    forced to ``splits`` when given; the config is restored after."""
    name = "fwd_topk" if k else "fwd"

    def run():
        saved_splits = pp.topk_splits
        if splits:
            pp.topk_splits = lambda *args, **kwargs: splits
        try:
            with vocab_ops.kernel_config_scope(name, pingpong=pingpong):
                vocab_ops.vocab_stats(hidden, weight, None, k)
        finally:
            pp.topk_splits = saved_splits

    return run


FWD_VARIANTS = [
    ("fwd kernel, 6 stages, group 8", {}),
    ("fwd kernel, 4 stages, group 8", dict(stages=4)),
    ("fwd kernel, 6 stages, group 16", dict(GROUP=16)),
]


def _forward_fns(hidden, weight):
    """The whole k = 0 forward (Gluon and Triton kernels), and the Gluon kernel alone per
    variant."""
    fns = {
        "fwd call, Gluon": _call(hidden, weight, 0, True),
        "fwd call, Triton": _call(hidden, weight, 0, False),
    }
    for label, over in FWD_VARIANTS:
        cfg = dict(pp.STATS_CONFIG, **over)
        part = torch.empty(pp.stats_tiles(weight.shape[0], cfg), 3, hidden.shape[0], device=dev)
        fns[label] = lambda cfg=cfg, part=part: pp.launch_stats_pingpong(
            hidden, weight, None, part, SMS, cfg
        )
    return fns


TOPK_VARIANTS = [
    ("top-20 kernel, 64 x 256 tiles, group 16", {}),
    ("top-20 kernel, 64 x 256 tiles, group 8", dict(GROUP=8)),
    # The statistics kernel's tile: two consumers' top-k over half the columns each.
    ("top-20 kernel, 128 x 128 tiles, group 8", dict(BM=128, BN=128, GROUP=8)),
]


def _topk_fns(hidden, weight, k=20):
    """The whole top-k forward (Gluon and Triton kernels), each kernel alone (the Triton one
    with the split count the call would take), and the Gluon kernel per variant."""
    n, vocab = hidden.shape[0], weight.shape[0]
    fns = {
        "top-20 call, Gluon": _call(hidden, weight, k, True),
        "top-20 call, Triton": _call(hidden, weight, k, False),
    }
    cfg = dict(vocab_ops.current_kernel_config()["fwd_topk"])
    splits = vocab_ops.forward_splits(n, vocab, k, SMS)
    bufs = vocab_ops._split_buffers(splits, 4, n, k, dev)
    use_tma = vocab_ops._use_tma(cfg, hidden, weight)
    fns[f"top-20 Triton kernel alone ({splits} splits)"] = lambda: (
        vocab_ops.vocab_triton.launch_stats_fwd(
            hidden, weight, None, k, *bufs, splits, cfg, True, use_tma=use_tma
        )
    )
    for label, over in TOPK_VARIANTS:
        tcfg = dict(pp.TOPK_CONFIG, **over)
        tsplits = pp.topk_splits(n, vocab, SMS, H * 2, tcfg)
        tbufs = pp.topk_buffers(n, vocab, k, tsplits, dev)
        fns[f"{label} ({tsplits} splits)"] = lambda tcfg=tcfg, s=tsplits, b=tbufs: (
            pp.launch_topk_pingpong(hidden, weight, None, k, *b, s, SMS, cfg=tcfg)
        )
    return fns


SPLIT_COUNTS = (2, 4, 8, 9, 10, 12, 16)


def _effective_splits(vocab, want, bn):
    num_c = -(-vocab // bn)
    per = -(-num_c // want)
    return -(-num_c // per)


def _split_fns(hidden, weight, k=20):
    """The Gluon top-k kernel alone at each of ``SPLIT_COUNTS`` (and the 128 x 128 variant at 8),
    the Triton kernel alone at its model's count and at 8, and the whole Gluon call with the
    split count forced to 8 and to the model's."""
    n, vocab = hidden.shape[0], weight.shape[0]
    fns = {}
    cfg = dict(vocab_ops.current_kernel_config()["fwd_topk"])
    model = vocab_ops.forward_splits(n, vocab, k, SMS)
    use_tma = vocab_ops._use_tma(cfg, hidden, weight)
    for s in sorted({model, 8}):
        bufs = vocab_ops._split_buffers(s, 4, n, k, dev)
        fns[f"Triton kernel alone, {s} splits{' (model)' if s == model else ''}"] = (
            lambda s=s, bufs=bufs: vocab_ops.vocab_triton.launch_stats_fwd(
                hidden, weight, None, k, *bufs, s, cfg, True, use_tma=use_tma
            )
        )
    gmodel = pp.topk_splits(n, vocab, SMS, H * 2)
    for label, over, counts in (
        ("Gluon 64 x 256", {}, SPLIT_COUNTS),
        ("Gluon 128 x 128", dict(BM=128, BN=128, GROUP=8), (8,)),
    ):
        tcfg = dict(pp.TOPK_CONFIG, **over)
        seen = set()
        for want in counts:
            s = _effective_splits(vocab, want, tcfg["BN"])
            if s in seen:
                continue
            seen.add(s)
            b = pp.topk_buffers(n, vocab, k, s, dev)
            tag = " (model)" if s == gmodel and not over else ""
            fns[f"{label} kernel alone, {s} splits{tag}"] = lambda tcfg=tcfg, s=s, b=b: (
                pp.launch_topk_pingpong(hidden, weight, None, k, *b, s, SMS, cfg=tcfg)
            )

    fns["Triton call"] = _call(hidden, weight, k, False)
    fns[f"Gluon call, {gmodel} splits (model)"] = _call(hidden, weight, k, True)
    eight = _effective_splits(vocab, 8, pp.TOPK_CONFIG["BN"])
    fns["Gluon call, 8 splits"] = _call(hidden, weight, k, True, eight)
    return fns


def _against_gemm(make_fns):
    """A timing function ``(n, vocab, reps) -> table rows``: ``make_fns(hidden, weight)``'s calls
    timed in turns with the unit GEMM, in GEMMs (queued)."""

    def timing(n, vocab, reps):
        hidden, weight = _inputs(n, vocab, 0)
        logits = torch.empty(n, vocab, dtype=hidden.dtype, device=dev)
        fns = {"gemm": lambda: torch.mm(hidden, weight.t(), out=logits)}
        fns.update(make_fns(hidden, weight))
        _, ratios = time_round_robin(fns, dev, reps, 1, unit="gemm", lead_ms=2.0)
        return [f"| {n} x {vocab} | {label} | {r:.3f} |" for label, r in ratios.items()]

    return timing


def _dlogits_fns(hidden, weight):
    """The k = 0 forward's calls and kernels, and each d_logits kernel over all its slices."""
    fns = _forward_fns(hidden, weight)
    for label, (_, slices) in _kernels(hidden, weight).items():

        def all_slices(slices=slices):
            for _, _, launch in slices:
                launch()

        fns[label] = all_slices
    return fns


topk_split_timing = _against_gemm(_split_fns)
topk_timing = _against_gemm(_topk_fns)
timing = _against_gemm(_dlogits_fns)


def profile_topk(n, vocab, k=20):
    """The kernels of one top-20 call (default config), each with its GPU time."""
    hidden, weight = _inputs(n, vocab, 0)
    target = torch.randint(0, vocab, (n,), device=dev)
    for _ in range(2):
        vocab_ops.vocab_stats(hidden, weight, target, k)
    gpu_sleep(0.0)  # calibrates the sleep outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gpu_sleep(1.0)
        vocab_ops.vocab_stats(hidden, weight, target, k)
        torch.cuda.synchronize()
    print(f"\n{n} x {vocab}, top-{k} call, GEMMs at the unit's ms: see --topk-splits")
    print(
        prof.key_averages().table(
            sort_by="device_time_total", row_limit=30, max_name_column_width=60
        )
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--shapes", default="8192x151936,20436x151936,8192x37984,20436x37984", help="NxV,..."
    )
    parser.add_argument(
        "--topk", action="store_true", help="only the top-20 forward: calls and kernels alone"
    )
    parser.add_argument(
        "--topk-splits", action="store_true", help="only the top-20 kernels per split count"
    )
    parser.add_argument(
        "--profile", action="store_true", help="only the kernels of one top-20 call per shape"
    )
    args = parser.parse_args(argv)
    if args.profile:
        for shape in args.shapes.split(","):
            profile_topk(*map(int, shape.split("x")))
        return
    if args.topk_splits:
        print(f"# top-20 forward per split count, {torch.cuda.get_device_name()}, H = {H}, bf16\n")
        _print_timings("| shape | kernel | GEMMs (queued) |", topk_split_timing, args)
        return
    if args.topk:
        print(f"# ping-pong top-20 forward, {torch.cuda.get_device_name()}, H = {H}, bf16\n")
        _print_timings("| shape | kernel | GEMMs (queued) |", topk_timing, args)
        return
    print(f"# ping-pong d_logits, {torch.cuda.get_device_name()}, H = {H}, bf16\n")
    print("| shape / slice width | kernel | bits equal to Triton | max abs diff |")
    print("|---|---|---|---:|")
    for n, vocab, width in [
        (1000, 3000, 1024),
        (333, 2999, 640),
        (2000, 20000, 4096),
        (4100, 37984, None),
    ]:
        for line in check(n, vocab, width):
            print(line, flush=True)
    print()
    _print_timings("| shape | kernel (d_logits: all slices) | GEMMs (queued) |", timing, args)


def _print_timings(header, timing_fn, args):
    """A table of ``timing_fn(n, vocab, reps)``'s rows for each of ``--shapes``."""
    print(header)
    print("|---|---|---:|")
    for shape in args.shapes.split(","):
        n, vocab = map(int, shape.split("x"))
        for line in timing_fn(n, vocab, args.reps):
            print(line, flush=True)


if __name__ == "__main__":
    main()
