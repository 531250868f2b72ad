"""How long the host takes to queue one fused attention call, and where that time goes.

``bench_attention.py`` times a call from a CUDA event recorded when the call starts, so the
host's work before the first kernel launch counts as the call's time unless the GPU is still
busy (``--lead-ms``). This probe measures that host work directly for named cases: the wall
time of the forward and of the forward+backward while the GPU spins far ahead (so no launch
waits on the GPU), the cuDNN kernel's share of it (``g.execute`` calls, wrapped and timed), and
a ``cProfile`` of the calls' Python, heaviest functions first. ``--sync-check`` instead runs one
forward+backward under ``torch.cuda.set_sync_debug_mode("error")`` (a synchronising CUDA call
raises, naming where) and reports the caching allocator's device allocations, frees and retries
during it (a ``cudaFree`` synchronises the device without the debug mode seeing it).
``--gaps DIR`` profiles one forward+backward from an idle GPU and lists the GPU's idle gaps
between kernels, each with the host ops under way when the kernel that ended it was launched.

Usage: python benchmarks/probes/probe_attention_host.py [--cases zigzag_cp2,random_rows_cp2]
       [--size 20436] [--reps 20] [--sync-check | --forward | --gaps DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "attention"))

from bench_attention import Case, named_cases  # noqa: E402
from timing import gpu_sleep  # noqa: E402

from megatron.context_parallel.attention import cudnn as cudnn_kernel  # noqa: E402


class _ExecuteClock:
    """Wraps every cuDNN graph's ``execute`` to add up its host time."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0

    def wrap(self):
        for key, (graph, ws) in list(cudnn_kernel._GRAPHS.items()):
            if getattr(graph, "_timed", False):
                continue
            cudnn_kernel._GRAPHS[key] = (_TimedGraph(graph, self), ws)


class _TimedGraph:
    _timed = True

    def __init__(self, graph, clock):
        self._graph, self._clock = graph, clock

    def execute(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._graph.execute(*args, **kwargs)
        self._clock.seconds += time.perf_counter() - t0
        self._clock.calls += 1
        return out


def _host_ms(fn, reps, clock):
    """Median host ms of ``fn()`` behind GPU spinning, and the cuDNN execute ms per call."""
    times, execute = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        gpu_sleep(200.0)
        before = clock.seconds
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        execute.append((clock.seconds - before) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times), statistics.median(execute)


def _sync_check(case) -> str:
    """One forward+backward with synchronising CUDA calls raising; the allocator's counters."""
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        case.ours(True)
        found = "no synchronising call"
    except RuntimeError:
        found = "synchronising call:\n" + traceback.format_exc(limit=-12)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    counts = ", ".join(f"{k} {after.get(k, 0) - before.get(k, 0)}" for k in keys)
    return f"{found}\nallocator during the call: {counts}"


def _gaps(case, out_dir: str, name: str) -> str:
    """One forward+backward from an idle GPU (as ``bench_attention`` times it), profiled: the
    GPU's idle gaps between kernels, longest first, each with the kernel that ended it and the
    host ops under way when that kernel was launched (the trace is written to ``out_dir``)."""
    import json

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        case.ours(True)
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"trace_{name}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    launch = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    host = [e for e in events if e.get("cat") in ("cpu_op", "python_function")]
    if not gpu:
        return f"{name}: no GPU events in the trace"
    busy = sum(e["dur"] for e in gpu)
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    gaps, end = [], gpu[0]["ts"]
    for e in gpu:
        if e["ts"] - end > 10:
            gaps.append((e["ts"] - end, e))
        end = max(end, e["ts"] + e["dur"])
    lines = [
        f"{name}: kernels {busy / 1e3:.2f} ms over {span / 1e3:.2f} ms from the first to the "
        f"last; {len(gaps)} gaps over 10 us, {sum(g for g, _ in gaps) / 1e3:.2f} ms"
    ]
    for gap, e in sorted(gaps, key=lambda g: -g[0])[:12]:
        call = launch.get(e["args"].get("correlation"))
        under = []
        if call is not None:
            t = call["ts"]
            under = [h["name"] for h in host if h["ts"] <= t <= h["ts"] + h["dur"]]
        lines.append(f"  {gap:8.1f} us before {e['name'][:60]} | launched in {' > '.join(under)}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="zigzag_cp2,packed_cut_1seq_cp4,random_rows_cp2")
    ap.add_argument("--size", type=int, default=20436)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sync-check", action="store_true", help="only look for host syncs")
    ap.add_argument(
        "--forward", action="store_true", help="profile the forward alone, by cumulative time"
    )
    ap.add_argument(
        "--gaps",
        metavar="DIR",
        help="only profile one forward+backward from an idle GPU: its idle gaps (trace to DIR)",
    )
    args = ap.parse_args()
    device = torch.device("cuda")
    for name, plan, rank, cu in named_cases(args.size, args.cases.split(",")):
        case = Case(plan, rank, cu, device)
        case.ours(True)
        if args.gaps:
            print(_gaps(case, args.gaps, f"{name.split()[0]}_{args.size}"), flush=True)
            continue
        if args.sync_check:
            print(f"{name} S={args.size}: {case.runs.describe()}\n{_sync_check(case)}", flush=True)
            continue
        clock = _ExecuteClock()
        clock.wrap()
        fwd, fwd_exec = _host_ms(lambda c=case: c.ours(False), args.reps, clock)
        both, both_exec = _host_ms(lambda c=case: c.ours(True), args.reps, clock)
        print(
            f"{name} S={args.size}: host ms fwd {fwd:.3f} (cuDNN execute {fwd_exec:.3f}), "
            f"fwd+bwd {both:.3f} (cuDNN execute {both_exec:.3f}); {case.runs.describe()}",
            flush=True,
        )
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        gpu_sleep(2000.0)
        prof.enable()
        for _ in range(10):
            case.ours(not args.forward)
        prof.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        order = "cumulative" if args.forward else "tottime"
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(40 if args.forward else 18)
        print(text.getvalue(), flush=True)


if __name__ == "__main__":
    main()
