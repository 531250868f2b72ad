"""What does running a batch on a larger kernel shape than its own cost? (issue 26: a finite set
of shapes, so that graph builds stop.)

A cuDNN graph is keyed by ``(batch, max_q, max_kv)`` (``AttentionRuns``): padding entries have
no rows and cuDNN reads each entry's own lengths, so any larger shape is exact, and a coarse
ladder of shapes would bound the graphs a run ever builds. Its price is the padded work the
kernels walk. Here every case of ``bench_attention.py`` at one length runs forward+backward on
its own shape at 16 sizes per octave ("own"), on that shape padded by one factor at a time
(entries, query length, key length) and by all three, and on the library's default policy
(``AttentionSettings.shape_buckets`` / ``shape_reuse``), timed in turns in one run; every
variant's outputs and gradients are compared with the own shape's.

``python benchmarks/probes/probe_shape_padding.py [--seq-len 20436] [--reps 7]``
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))

from bench_attention import Case, cases  # noqa: E402
from timing import time_round_robin  # noqa: E402

from megatron.context_parallel.attention import cudnn as _attention_cudnn  # noqa: E402
from megatron.context_parallel.attention import runs as attention_runs  # noqa: E402
from megatron.context_parallel.attention.settings import attention_settings  # noqa: E402

# (label, entries factor, query-length factor, key-length factor)
VARIANTS = (
    ("own", 1, 1.0, 1.0),
    ("q x1.25", 1, 1.25, 1.0),
    ("q x1.5", 1, 1.5, 1.0),
    ("q x2", 1, 2.0, 1.0),
    ("kv x2", 1, 1.0, 2.0),
    ("kv x4", 1, 1.0, 4.0),
    ("batch x2", 2, 1.0, 1.0),
    ("batch x4", 4, 1.0, 1.0),
    ("all x2", 2, 2.0, 2.0),
    ("q x4", 1, 4.0, 1.0),
    ("all x4", 4, 4.0, 4.0),
    ("default", None, None, None),
)


class _PaddedShapes(attention_runs.KernelShapes):
    """A shape record that runs every own shape padded by the factors (rows to multiples of 64)
    and records nothing."""

    def __init__(self, entries, q_factor, kv_factor):
        super().__init__()
        self.factors = entries, q_factor, kv_factor

    def shared(self, batch, max_q, max_kv, reuse):
        entries, q_factor, kv_factor = self.factors

        def up(n, f):
            return n if f == 1 else -(-int(n * f) // 64) * 64

        return batch * entries, up(max_q, q_factor), up(max_kv, kv_factor)


def _case(plan, rank, cu, device, entries, q_factor, kv_factor):
    """The Case under one variant of ``VARIANTS``, its graphs built (outside the timing)."""
    if entries is None:  # the library's policy, from an empty shape record
        settings, shapes = attention_settings(), attention_runs.kernel_shapes()
    else:  # fine sizes (as exact as the graphs allow), padded by the factors
        settings = attention_settings(shape_buckets=16)
        shapes = attention_runs.kernel_shapes(_PaddedShapes(entries, q_factor, kv_factor))
    with settings, shapes:
        case = Case(plan, rank, cu, device)
        case.ours(True)
    return case


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=20436)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda")
    labels = [v[0] for v in VARIANTS]
    print(f"S = {args.seq_len}; forward+backward time / own shape (median of {args.reps})")
    print("| case | own (batch, max_q, max_kv), ms | " + " | ".join(labels[1:]) + " | max diff |")
    print("|---|---|" + "---|" * len(labels))
    for name, plan, rank, cu in cases(args.seq_len):
        built = {label: _case(plan, rank, cu, device, *f) for label, *f in VARIANTS}
        fns = {label: (lambda c=c: c.ours(True)) for label, c in built.items()}
        ms, ratio = time_round_robin(fns, device, args.reps, 1, unit="own")
        mine = built["own"].ours(True)
        diff = 0.0
        for label in labels[1:]:
            theirs = built[label].ours(True)
            diff = max(diff, *((a.float() - b.float()).abs().max().item()
                               for a, b in zip(theirs, mine)))  # fmt: skip
        runs = built["own"].runs
        calls = runs.calls() if hasattr(runs, "calls") else [runs]
        shapes = ", ".join(f"({c.batch}, {c.max_q}, {c.max_kv})" for c in calls[:3])
        more = f" +{len(calls) - 3} calls" if len(calls) > 3 else ""
        first = built["default"].runs
        first = first.calls()[0] if hasattr(first, "calls") else first
        more += f"; default ({first.batch}, {first.max_q}, {first.max_kv})"
        print(
            f"| {name} | {shapes}{more}, {ms['own']:.2f} | "
            + " | ".join(f"{ratio[label]:.3f}" for label in labels[1:])
            + f" | {diff:.2g} |",
            flush=True,
        )
        del built, fns, mine
        torch.cuda.empty_cache()
    print(f"graph builds in the run: {_attention_cudnn.graph_builds()}")


if __name__ == "__main__":
    main()
