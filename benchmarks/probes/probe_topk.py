"""Where the forward top-k's time goes (diagnostic, GPU). Per shape, timed in turns (every round
runs each variant once, so clock and power drift hit all alike): the cuBLAS GEMM, the k = 0 and
top-20 paths (flagged rows re-selected through logit keys, or all through the row-list launch),
the kernel alone with k = 20 (three selection passes per tile, flattened loop), k = 1 and k = 0
(the floor of the epilogue), the merge of the splits' results, and the exact re-selection of 18
rows (in place: through logit keys and its pieces, through the row-list launch, the launches
with no row flagged, and the every-element kernel on 18 gathered rows). Prints ms and GEMMs (cuBLAS
``hidden @ weight.T``) per variant; then the host time of one call of each path (how long the
GPU would wait on Python were it idle), the kernels of one top-20 call (torch.profiler), and on
the TP-4 shard the backward's pieces.

    PYTHONPATH=$PWD python3 benchmarks/probes/probe_topk.py [--reps 7]
"""

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
from bench_head import backward_parts, time_round_robin  # noqa: E402

from megatron.context_parallel import _vocab_triton, vocab_ops  # noqa: E402

dev = torch.device("cuda")
slots = vocab_ops._sm_count(dev)
gen = torch.Generator(device=dev).manual_seed(0)
base = dict(vocab_ops._CONFIG["fwd_topk"])


def launch(h, w, t, k, splits, **over):
    """The forward kernel alone with ``fwd_topk`` (k > 0) or ``fwd`` overridden by ``over``."""
    c = dict(base if k else vocab_ops._CONFIG["fwd"], **over)
    grouped = bool(k and c.get("grouped"))
    part, tv, ti = vocab_ops._split_buffers(splits, 4 if grouped else 3, h.shape[0], k, dev)
    return lambda: _vocab_triton.launch_stats_fwd(h, w, t, k, part, tv, ti, splits, c, grouped)


def probe(n, vocab, reps):
    h = torch.randn(n, 5120, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(vocab, 5120, device=dev, generator=gen) * 2 / 5120**0.5).to(torch.bfloat16)
    t = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    auto0 = vocab_ops.forward_splits(n, vocab, 0, slots)
    fns = {"GEMM": lambda: h @ w.t()}
    fns["fwd k=0 path"] = lambda: vocab_ops.vocab_stats(h, w, t, 0)
    fns[f"top-20 path {base}"] = lambda: vocab_ops.vocab_stats(h, w, t, 20)

    def no_ahead():
        vocab_ops._CONFIG["fwd_topk"].update(reselect_ahead=0)
        try:
            return vocab_ops.vocab_stats(h, w, t, 20)
        finally:
            vocab_ops._CONFIG["fwd_topk"].update(base)

    fns["top-20 path, every flagged row through the row-list launch"] = no_ahead
    fns[f"kernel k=0 flatten splits={auto0}"] = launch(h, w, t, 0, auto0)
    fns[f"kernel k=20 passes=3 flatten splits={auto0}"] = launch(
        h, w, t, 20, auto0, flatten=True, passes=3
    )
    fns[f"kernel k=1 passes=1 flatten splits={auto0}"] = launch(
        h, w, t, 1, auto0, flatten=True, passes=1
    )
    part = torch.randn(auto0, 4, n, device=dev)
    tv = torch.randn(auto0, n, 32, device=dev)
    ti = torch.randint(0, vocab, (auto0, n, 32), device=dev, dtype=torch.int32)
    fns[f"merge of {auto0} splits"] = lambda: vocab_ops._combine_splits(part, tv, ti, 20, vocab)
    hs = h[:18].contiguous()
    cfg = dict(vocab_ops._CONFIG["fwd_topk"])
    # 18 flagged rows (spread out), re-selected in place: through logit keys, or all through the
    # every-element kernel's row-list launch.
    redo = torch.zeros(n, dtype=torch.bool, device=dev)
    redo[torch.randperm(n, device=dev, generator=gen)[:18]] = True
    v_n = torch.zeros(n, 20, device=dev)
    i_n = torch.zeros(n, 20, dtype=torch.int64, device=dev)
    fns["redo of 18 rows, logit keys"] = lambda: vocab_ops._reselect_into(
        h, w, redo, v_n, i_n, 20, slots, cfg
    )
    fns["redo of 18 rows, row-list launch"] = lambda: vocab_ops._reselect_into(
        h, w, redo, v_n, i_n, 20, slots, dict(cfg, reselect_ahead=0)
    )
    no_rows = torch.zeros(n, dtype=torch.bool, device=dev)
    fns["no row flagged (the launches' fixed cost)"] = lambda: vocab_ops._reselect_into(
        h, w, no_rows, v_n, i_n, 20, slots, cfg
    )
    keys = torch.empty(18, _vocab_triton.key_columns(vocab, cfg), dtype=torch.int64, device=dev)
    tile = vocab_ops._keys_tile(cfg)
    fns["  logit keys kernel (BM 64)"] = lambda: _vocab_triton.logit_keys(hs, w, keys, tile, slots)
    fns["  logit keys kernel (BM 128)"] = lambda: _vocab_triton.logit_keys(hs, w, keys, cfg, slots)
    count18 = torch.full((1,), 18, dtype=torch.int32, device=dev)
    rows18 = torch.arange(18, device=dev)
    v18 = torch.empty(18, 20, device=dev)
    i18 = torch.empty(18, 20, dtype=torch.int64, device=dev)
    fns["  top-k of the keys (topk_of_keys)"] = lambda: _vocab_triton.topk_of_keys(
        keys, count18, 20, vocab, rows18, v18, i18
    )
    fns["  torch.topk of the keys"] = lambda: keys.topk(20, dim=1)
    fns["redo of 18 rows, every-element kernel"] = lambda: vocab_ops._stats_kernel(
        hs, w, None, 20, slots, False
    )
    for name, fn in list(fns.items()):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and drop a variant that fails to compile
            print(name, type(exc).__name__, str(exc).strip().splitlines()[-1][:300])
            del fns[name]
    times = time_round_robin(fns, dev, reps, 1)
    print(f"\n{n}x{vocab}: splits {auto0}\n")
    print("| variant | ms | GEMMs |\n|---|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.2f} | {ms / times['GEMM']:.3f} |")
    print("\nhost ms per call (no sync)")
    for name in ("fwd k=0 path", f"top-20 path {base}", "redo of 18 rows, logit keys"):
        host = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fns[name]()
            host.append((time.perf_counter() - t0) * 1e3)
        print(f"{name[:40]}: {statistics.median(host):.3f}")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fns[f"top-20 path {base}"]()
        torch.cuda.synchronize()
    try:
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=14))
    except Exception as exc:  # noqa: BLE001 - a diagnostic: report and go on
        print("profile table:", type(exc).__name__, exc)
    if vocab < 100000 and n > 10000:
        print("\n".join(backward_parts(h, w, dev, reps, times["GEMM"])))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    for n, vocab in [(20436, 37984), (20436, 151936), (8192, 37984)]:
        probe(n, vocab, args.reps)
