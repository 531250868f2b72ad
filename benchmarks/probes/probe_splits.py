"""Vocabulary splits and launch groups of the forward kernel, measured (diagnostic, GPU).

``vocab_ops.forward_splits`` picks the splits per row block from a wave model
(``_vocab_triton.choose_splits``). This times the forward kernel alone (k = 0 and top-20) at the
model's choice and at its neighbours, and with other launch-group sizes (``GROUP``: row blocks
whose programs run together), against cuBLAS's ``hidden @ weight.T``, in turns with the GPU busy
2 ms before each start (so host time is hidden). Prints ms and GEMMs per variant, the model's
choice marked.

    PYTHONPATH=$PWD python3 benchmarks/probes/probe_splits.py [--reps 7] [--shapes 20436x151936]
        [--splits 9,33] [--groups 4,16]
"""

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_head import time_round_robin  # noqa: E402
from probe_topk import dev, launch, slots  # noqa: E402

from megatron.context_parallel import vocab_ops  # noqa: E402


def candidates(n, vocab, k):
    """The model's splits and nearby counts that change the program count's fit to the waves."""
    cfg = dict(vocab_ops._CONFIG["fwd_topk" if k else "fwd"])
    tiles = -(-vocab // cfg["BN"])
    model = vocab_ops.forward_splits(n, vocab, k, slots)
    picks = {model}
    for s in range(max(1, model - 5), model + 6):
        per = -(-tiles // s)
        picks.add(-(-tiles // per))
    return model, sorted(picks)


def probe(n, vocab, reps, splits=None, groups=(4, 16)):
    gen = torch.Generator(device=dev).manual_seed(n + vocab)
    h = torch.randn(n, 5120, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(vocab, 5120, device=dev, generator=gen) * 2 / 5120**0.5).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    for k in (0, 20):
        model, picks = candidates(n, vocab, k)
        picks = sorted(set(splits) | {model}) if splits else picks
        group = vocab_ops._CONFIG["fwd_topk" if k else "fwd"].get("GROUP", 8)
        fns = {"GEMM": lambda: h @ w.t()}
        for s in picks:
            fns[f"k={k} splits {s}{' (model)' if s == model else ''}"] = launch(h, w, t, k, s)
        for g in groups:
            fns[f"k={k} splits {model} GROUP {g}"] = launch(h, w, t, k, model, GROUP=g)
        ms, ratio = time_round_robin(fns, dev, reps, 1, unit="GEMM", lead_ms=2.0)
        print(f"\n## N = {n}, V = {vocab}, k = {k} (configured GROUP {group})")
        print("| variant | ms | GEMMs |\n|---|---:|---:|")
        for name in fns:
            print(f"| {name} | {ms[name]:.2f} | {ratio[name]:.3f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--shapes", default="20436x151936,20436x37984,8192x151936,8192x37984")
    parser.add_argument(
        "--splits", default="", help="split counts to time (default: near the model's)"
    )
    parser.add_argument("--groups", default="4,16", help="other GROUP sizes at the model's splits")
    args = parser.parse_args()
    splits = [int(x) for x in args.splits.split(",") if x]
    groups = [int(x) for x in args.groups.split(",") if x]
    print(torch.__version__, __import__("triton").__version__, torch.cuda.get_device_name())
    for shape in args.shapes.split(","):
        n, vocab = (int(x) for x in shape.split("x"))
        probe(n, vocab, args.reps, splits, groups)


if __name__ == "__main__":
    main()
