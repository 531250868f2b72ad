"""Where the head forward's host time goes (diagnostic, GPU).

``bench_head.py``'s "idle" columns time each call from an idle GPU, so Python that runs before the
forward kernel's launch is GPU time lost. Per shape and k this prints, for calls of the one-shard
composition (``_vocab_ref.shard_logprobs``, what ``bench_head.py`` times) made right after a
synchronisation (as the benchmark makes them: "cold") while the GPU is still busy with earlier
work:

* ``to launch``: microseconds from the call to the forward kernel's launch;
* ``launch``: the Triton launch itself (argument binding, descriptors, the driver call);
* ``after``: from the launch's return to the call's return (k > 0: includes the wait for the GPU
  at the host read, so only k = 0's is pure host time);

then the pieces alone, back to back ("warm") and each right after a synchronisation ("cold"), in
microseconds per call, and a cProfile of cold k = 0 calls sorted by own time. First, per shape
("layers"): the microseconds from a cold k = 0 call to each layer's entry (the composition's
``vocab_stats``, the op's CUDA implementation, the launch helper, Triton's launch and its return),
and the whole cold call of an empty autograd Function, an empty custom op and one allocation.

    PYTHONPATH=$PWD python3 benchmarks/probes/probe_host.py [--calls 100] [--layers-only]
"""

import argparse
import cProfile
import io
import pathlib
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
from _vocab_ref import IGNORE, shard_logprobs  # noqa: E402
from timing import gpu_sleep, time_ms  # noqa: E402

from megatron.context_parallel.head import vocab_ops  # noqa: E402
from megatron.context_parallel.head import vocab_triton as _vocab_triton

dev = torch.device("cuda")
_STAMPS = []


def busy(ms=30.0):
    """Keeps the GPU busy for about ``ms`` so the host runs ahead of it."""
    gpu_sleep(ms)


def warm_us(fn, calls):
    """Microseconds per call, back to back (the GPU kept busy)."""

    def loop():
        for _ in range(calls):
            fn()

    return time_ms(loop, dev, 1, 0, max(5.0, calls * 0.3), clock="launch") * 1e3 / calls


def cold_us(fn, reps=15):
    """Median microseconds of one call made right after a synchronisation (the GPU kept busy)."""
    return time_ms(fn, dev, reps, 0, 20.0, clock="launch") * 1e3


class _Stamp:
    """Replaces ``owner.name`` (a function, or with ``kernel`` a Triton kernel) by a wrapper that
    records when calls enter it (and, for a kernel, when its launch returns)."""

    def __init__(self, owner, name, label, kernel=False):
        self.owner, self.name, self.label, self.kernel = owner, name, label, kernel
        self.real = getattr(owner, name)

    def __enter__(self):
        real, label = self.real, self.label
        if self.kernel:

            class Kernel:
                def __getitem__(self, grid):
                    launch = real[grid]

                    def run(*args, **kwargs):
                        _STAMPS.append((label, time.perf_counter()))
                        out = launch(*args, **kwargs)
                        _STAMPS.append(("launch returned", time.perf_counter()))
                        return out

                    return run

            setattr(self.owner, self.name, Kernel())
        else:

            def wrapped(*args, **kwargs):
                _STAMPS.append((label, time.perf_counter()))
                return real(*args, **kwargs)

            setattr(self.owner, self.name, wrapped)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.real)


def cold_stamps(fn, wrappers, reps=15):
    """Calls ``fn`` ``reps`` times, each right after a synchronisation with the GPU kept busy,
    with the ``_Stamp`` ``wrappers`` in place; per call ``(start, [(label, time), ...], end)``."""
    for wrapper in wrappers:
        wrapper.__enter__()
    calls = []
    try:
        for _ in range(reps):
            torch.cuda.synchronize()
            busy()
            _STAMPS.clear()
            t0 = time.perf_counter()
            fn()
            calls.append((t0, list(_STAMPS), time.perf_counter()))
    finally:
        for wrapper in reversed(wrappers):
            wrapper.__exit__()
    torch.cuda.synchronize()
    return calls


def stamps(fn, reps=15):
    """Median (to launch, launch, after) microseconds of cold calls of ``fn`` (its first launch
    of the forward kernel)."""
    kernel = _Stamp(_vocab_triton, "_stats_fwd_kernel", "launch", kernel=True)
    rows = []
    for t0, marks, t1 in cold_stamps(fn, [kernel], reps):
        (_, a), (_, b) = marks[:2]
        rows.append(((a - t0) * 1e6, (b - a) * 1e6, (t1 - b) * 1e6))
    return [statistics.median(col) for col in zip(*rows)]


def cold_profile(fn, calls=15, lines=40):
    prof = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        busy(20)
        prof.enable()
        fn()
        prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    return "\n".join(text.getvalue().splitlines()[:lines])


def probe(n, vocab, calls, profile):
    gen = torch.Generator(device=dev).manual_seed(0)
    slots = vocab_ops._sm_count(dev)
    h = torch.randn(n, 5120, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(vocab, 5120, device=dev, generator=gen) * 2 / 5120**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    labels[::7] = IGNORE
    print(f"\n{n} x {vocab}")
    for k in (0, 20):
        shard_logprobs(h, w, labels, k)
        torch.cuda.synchronize()
        to_launch, launch, after = stamps(lambda: shard_logprobs(h, w, labels, k))  # noqa: B023
        print(
            f"k={k:2d}: to launch {to_launch:7.1f} us, launch {launch:7.1f} us, "
            f"after {after:8.1f} us"
        )
    cfg = dict(vocab_ops.current_kernel_config()["fwd"])
    splits = vocab_ops.forward_splits(n, vocab, 0, slots)
    part = torch.empty(splits, 3, n, device=dev)
    tv = torch.empty(splits, n, 0, device=dev)
    ti = torch.empty(splits, n, 0, device=dev, dtype=torch.int32)
    gluon = vocab_ops._kernel_path("stats", h, w) == "gluon"
    pieces = {
        # With the use_tma check the launcher made itself before it moved to vocab_ops.
        "launch_stats_fwd (k=0)": lambda: _vocab_triton.launch_stats_fwd(
            h, w, labels, 0, part, tv, ti, splits, cfg, False, use_tma=vocab_ops._use_tma(cfg, h, w)
        ),
        "_descriptors": lambda: _vocab_triton._descriptors(h, w, 128, 256, 64, True),
        "torch.empty": lambda: torch.empty(splits, 3, n, device=dev),
        "_stats_kernel (k=0)": lambda: vocab_ops._stats_kernel(h, w, labels, 0, slots, gluon=gluon),
        "vocab_stats (k=0, op)": lambda: vocab_ops.vocab_stats(h, w, labels, 0),
        "shard_logprobs (k=0)": lambda: shard_logprobs(h, w, labels, 0),
        "GEMM h @ w.T": lambda: h @ w.t(),
        "torch.add": lambda: labels + 1,
    }
    print(f"  {'piece':28s} {'warm us':>9s} {'cold us':>9s}")
    for name, piece in pieces.items():
        piece()
        heavy = "stats" in name or "logprobs" in name or "GEMM" in name
        warm = statistics.median(warm_us(piece, 20 if heavy else calls) for _ in range(3))
        print(f"  {name:28s} {warm:9.1f} {cold_us(piece):9.1f}")
    if profile:
        print(cold_profile(lambda: shard_logprobs(h, w, labels, 0)))


def layers(n, vocab, reps=15):
    """Cold k = 0 calls of the one-shard composition: median microseconds from the call to each
    layer's entry; then the whole cold call of an empty autograd Function and of an empty custom
    op (what any op built this way pays before its own code) and of one allocation."""
    import _vocab_ref

    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(n, 5120, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(vocab, 5120, device=dev, generator=gen) * 2 / 5120**0.5).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (n,), device=dev, generator=gen)
    stamps = [
        (_vocab_ref, "vocab_stats", "vocab_stats entered"),
        (vocab_ops, "_stats_kernel", "op dispatched (_stats_kernel)"),
        (_vocab_triton, "launch_stats_fwd", "launch_stats_fwd entered"),
        (_vocab_triton, "_stats_fwd_kernel", "Triton launch entered", True),
    ]
    rows = {}
    shard_logprobs(h, w, labels, 0)
    calls = cold_stamps(lambda: shard_logprobs(h, w, labels, 0), [_Stamp(*s) for s in stamps], reps)
    for t0, marks, _ in calls:
        for label, t in marks:
            rows.setdefault(label, []).append((t - t0) * 1e6)
    print(f"\n{n} x {vocab}, k = 0, cold: microseconds from the call to")
    for label, times in rows.items():
        print(f"  {label:34s} {statistics.median(times):8.1f}")

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    lib = torch.library.Library("probe_host", "FRAGMENT")
    lib.define("noop(Tensor x) -> Tensor")
    lib.impl("noop", lambda x: x.view_as(x), "CUDA")
    x = h.requires_grad_(False)
    for name, fn in (
        ("empty autograd Function", lambda: Empty.apply(w.requires_grad_(True))),
        ("empty custom op", lambda: torch.ops.probe_host.noop(x)),
        ("torch.empty", lambda: torch.empty(8, 3, n, device=dev)),
    ):
        fn()
        print(f"  {name:34s} {cold_us(fn):8.1f} (whole call)")
    w.requires_grad_(False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--layers-only", action="store_true")
    args = parser.parse_args()
    for n, vocab in [(8192, 37984), (20436, 151936)]:
        layers(n, vocab)
        if not args.layers_only:
            probe(n, vocab, args.calls, profile=n == 8192)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
