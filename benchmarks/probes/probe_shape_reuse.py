"""Graph builds and speed of the fused attention when batches may run on a larger recorded
kernel shape (``attention_runs.SHAPE_REUSE``) than their own bucketed one (issue 26: no
recompilation over batches of new lengths).

For each tolerance: the cuDNN graph builds over 20 random uneven plans at S = 20,436 (CP 2,
rank 0 or the other rank when rank 0 owns nothing), then over each further 20 new ones
(``--passes`` sets of 20 in all: whether the builds stop); then the
forward+backward of the first ``--timed`` plans with their tables (and graphs) from the first
pass, against the same plans at tolerance 1 (own shapes), timed in turns in one run.

Run on a GPU with nvidia-cudnn-frontend: ``python benchmarks/probes/probe_shape_reuse.py``.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_attention import Case, _random_uneven_plan  # noqa: E402
from bench_head import time_round_robin  # noqa: E402

from megatron.context_parallel import _attention_cudnn, attention_runs  # noqa: E402


def cases_at(tolerance, plans, device, keep):
    """Builds per set of 20 plans, and the Cases of the first ``keep`` plans (each holds ~0.5 GB
    of inputs), built at ``tolerance`` from an empty shape record and graph cache."""
    attention_runs.SHAPE_REUSE = tolerance
    attention_runs._SHAPES.clear()
    _attention_cudnn._GRAPHS.clear()
    _attention_cudnn._TOTALS.clear()
    builds, cases = [], []
    for first in range(0, len(plans), 20):
        half = plans[first : first + 20]
        before = _attention_cudnn.graph_builds()
        for plan in half:
            case = Case(plan, 0 if plan.counts[0] else 1, None, device)
            case.ours(True)
            if len(cases) < keep:
                cases.append(case)
        builds.append(_attention_cudnn.graph_builds() - before)
    return builds, cases


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=20436)
    parser.add_argument("--tolerances", default="1.25,1.5")
    parser.add_argument("--timed", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--passes", type=int, default=2, help="sets of 20 new plans")
    args = parser.parse_args()
    device = torch.device("cuda")
    rng = random.Random(1)
    plans = [_random_uneven_plan(args.seq_len, rng) for _ in range(20 * args.passes)]
    tolerances = [1.0] + [float(t) for t in args.tolerances.split(",")]
    built = {}
    sets = " | ".join(f"plans {20 * i + 1}-{20 * i + 20}" for i in range(args.passes))
    print(f"| tolerance | graph builds: {sets} | recorded shapes |")
    print("|---|" + "---|" * (args.passes + 1))
    for tol in tolerances:
        builds, cases = cases_at(tol, plans, device, args.timed)
        built[tol] = cases
        print(
            f"| {tol} | {' | '.join(map(str, builds))} | "
            f"{len(attention_runs.recorded_shapes())} |",
            flush=True,
        )
    # Every graph any tolerance used is still cached (keyed by shape), so the timing builds none.
    print(
        "\n| plan | entries | own shape (batch, max_q, max_kv) | "
        + " | ".join(f"tol {t}: shape, time / own" for t in tolerances[1:])
        + " | own ms |"
    )
    print("|---|---|---|" + "---|" * len(tolerances))
    ratios = {t: [] for t in tolerances[1:]}
    worst = {t: 0.0 for t in tolerances[1:]}
    for i in range(args.timed):
        fns = {t: (lambda c=built[t][i]: c.ours(True)) for t in tolerances}
        ms = time_round_robin(fns, device, args.reps, 1)
        own = built[1.0][i].runs
        cells = []
        mine = built[1.0][i].ours(True)
        for t in tolerances[1:]:
            r = built[t][i].runs
            ratios[t].append(ms[t] / ms[1.0])
            # Same inputs (a Case is seeded by its plan): outputs and gradients should agree.
            diff = max((a.float() - b.float()).abs().max().item()
                       for a, b in zip(built[t][i].ours(True), mine))  # fmt: skip
            worst[t] = max(worst[t], diff)
            cells.append(f"({r.batch}, {r.max_q}, {r.max_kv}) {ms[t] / ms[1.0]:.3f}")
        print(
            f"| {i} | {own.entries} | ({own.batch}, {own.max_q}, {own.max_kv}) | "
            + " | ".join(cells)
            + f" | {ms[1.0]:.2f} |",
            flush=True,
        )
    for t, r in ratios.items():
        print(
            f"tolerance {t}: time / own shape, median {statistics.median(r):.3f}, "
            f"worst {max(r):.3f}; max |difference| of output and gradients {worst[t]:.3g}"
        )
    attention_runs.SHAPE_REUSE = 1.0


if __name__ == "__main__":
    main()
