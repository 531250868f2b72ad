"""Two programs per SM against one: tile configs of the head kernels (diagnostic, GPU).

Our kernels run one 128x256 tile per SM with two warpgroups that both do the mainloop, then both
the epilogue (the forward's statistics, the backward's ``d_logits``), so the tensor cores idle
during every epilogue. Smaller tiles with one warpgroup let two programs share an SM: while one
runs its epilogue the other can issue its matrix products, the overlap a ping-pong kernel builds
by hand. This times, in turns with the unit GEMM (``hidden @ weight.T``, cuBLAS) and with the GPU
busy 2 ms before each start, the forward kernel alone (k = 0) and one backward slice's d_logits
kernel alone for each config, and prints each compiled kernel's registers, spills and shared
memory with the programs per SM they allow.

    PYTHONPATH=$PWD python3 benchmarks/probes/probe_occupancy.py [--reps 7] [--shapes 20436x151936]
"""

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_head import dlogits_inputs, time_round_robin  # noqa: E402
from probe_topk import launch  # noqa: E402

from megatron.context_parallel import _vocab_triton, vocab_ops  # noqa: E402

dev = torch.device("cuda")
SMS = vocab_ops._sm_count(dev)
_SMEM_PER_SM = 228 * 1024
_REGS_PER_SM = 64 * 1024

# (label, overrides of the configured kernel); ctas_per_sm is what the config claims, for the
# split model and the persistent grid; the printed occupancy says whether it holds.
FWD = [
    ("128x256 w8 s3 (configured)", {}),
    ("128x128 w4 s3 x2", dict(BN=128, warps=4, stages=3, ctas_per_sm=2)),
    ("128x128 w4 s2 x2", dict(BN=128, warps=4, stages=2, ctas_per_sm=2)),
    ("64x256 w4 s2 x2", dict(BM=64, warps=4, stages=2, ctas_per_sm=2)),
    ("128x128 w4 s4 x1", dict(BN=128, warps=4, stages=4, ctas_per_sm=1)),
]
BWD = [
    ("128x256 w8 s3 (configured)", {}),
    ("128x128 w4 s2 x2 tma store", dict(BN=128, warps=4, stages=2, ctas_per_sm=2)),
    ("128x128 w4 s3 x2 ptr store", dict(BN=128, warps=4, stages=3, ctas_per_sm=2, tma_store=False)),
    ("64x256 w4 s2 x2 ptr store", dict(BM=64, warps=4, stages=2, ctas_per_sm=2, tma_store=False)),
    ("128x128 w4 s3 x1 tma store", dict(BN=128, warps=4, stages=3, ctas_per_sm=1)),
]


class _Capture:
    """Stands in for a Triton kernel object: keeps the compiled kernel each launch returns."""

    def __init__(self, kernel):
        self.kernel, self.last = kernel, None

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.last = launch(*args, **kwargs)
            return self.last

        return run


def occupancy(compiled, warps):
    """'regs R, spills S, smem B KiB -> P programs/SM' of a compiled kernel."""
    regs, spills = compiled.n_regs, compiled.n_spills
    shared = compiled.metadata.shared
    by_smem = _SMEM_PER_SM // (shared + 1024)
    # Registers are allocated per warp in units of 256.
    per_warp = -(-(regs * 32) // 256) * 256
    by_regs = _REGS_PER_SM // (per_warp * warps)
    return (
        f"regs {regs}, spills {spills}, smem {shared / 1024:.0f} KiB -> {min(by_smem, by_regs)}/SM"
    )


def forward_case(h, w, t, over):
    n, vocab = h.shape[0], w.shape[0]
    cfg = dict(vocab_ops._CONFIG["fwd"], **over)
    saved = dict(vocab_ops._CONFIG["fwd"])
    vocab_ops._CONFIG["fwd"].update(cfg)
    try:
        splits = vocab_ops.forward_splits(n, vocab, 0, SMS)
    finally:
        vocab_ops._CONFIG["fwd"].update(saved)
    return launch(h, w, t, 0, splits, **over), splits, cfg


def dlogits_case(h, w, over):
    """The backward's first slice under ``over``; the unit for it is the slice's own GEMM."""
    cfg = dict(vocab_ops._CONFIG["bwd"], **over)
    _, slices = dlogits_inputs(h, w, dev, cfg)
    v0, v1, run = slices[0]
    return run, v1 - v0, (lambda: h @ w[v0:v1].t())


def probe(n, vocab, reps):
    gen = torch.Generator(device=dev).manual_seed(n + vocab)
    h = torch.randn(n, 5120, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(vocab, 5120, device=dev, generator=gen) * 2 / 5120**0.5).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    for kind, variants in (("fwd", FWD), ("d_logits", BWD)):
        name = "_stats_fwd_kernel" if kind == "fwd" else "_dlogits_kernel"
        real = getattr(_vocab_triton, name)
        spy = _Capture(real)
        setattr(_vocab_triton, name, spy)
        fns, info = {}, {}
        try:
            unit = None
            for label, over in variants:
                try:
                    if kind == "fwd":
                        run, splits, cfg = forward_case(h, w, t, over)
                        extra = f"splits {splits}"
                    else:
                        run, width, unit = dlogits_case(h, w, over)
                        cfg = dict(vocab_ops._CONFIG["bwd"], **over)
                        extra = f"slice {width}"
                    run()
                    torch.cuda.synchronize()
                    info[label] = f"{extra}; {occupancy(spy.last, cfg['warps'])}"
                    fns[label] = run
                except Exception as exc:  # noqa: BLE001 - a config that fails is reported
                    msg = str(exc).strip().splitlines()
                    why = msg[-1][:200] if msg else ""
                    print(f"{kind} {label}: failed ({type(exc).__name__}: {why})")
            fns["GEMM"] = (lambda: h @ w.t()) if kind == "fwd" else unit
        finally:
            setattr(_vocab_triton, name, real)
        ms, ratio = time_round_robin(fns, dev, reps, 1, unit="GEMM", lead_ms=2.0)
        print(f"\n## {kind}, N = {n}, V = {vocab}")
        print("| config | ms | GEMMs | compiled |\n|---|---:|---:|---|")
        for label in fns:
            print(
                f"| {label} | {ms[label]:.2f} | {ratio[label]:.3f} | {info.get(label, '')} |",
                flush=True,
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--shapes", default="20436x151936,8192x37984")
    args = parser.parse_args()
    for item in args.shapes.split(","):
        n, vocab = (int(x) for x in item.split("x"))
        probe(n, vocab, args.reps)


if __name__ == "__main__":
    main()
