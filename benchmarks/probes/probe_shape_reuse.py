"""Graph builds and speed of the fused attention under kernel shape policies: sizes per octave
(``AttentionSettings.shape_buckets``) and how much larger a recorded shape a batch may run on
(``AttentionSettings.shape_reuse``) (issue 26: no recompilation over batches of new lengths).

For each policy ``buckets:reuse``: the cuDNN graph builds over 20 random uneven plans at
S = 20,436 (CP 2, rank 0 or the other rank when rank 0 owns nothing), then over each further
20 new ones (``--passes`` sets of 20 in all: whether the builds stop); then the forward+backward
of the first ``--timed`` plans with their tables (and graphs) from the first pass, against the
same plans under the first policy (the reference: fine sizes, no reuse), timed in turns in one
run.

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
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))

from bench_attention import Case, _random_uneven_plan  # noqa: E402
from timing import time_round_robin  # noqa: E402

from megatron.context_parallel.attention import cudnn as _attention_cudnn  # noqa: E402
from megatron.context_parallel.attention import runs as attention_runs  # noqa: E402
from megatron.context_parallel.attention.settings import attention_settings  # noqa: E402


def cases_at(policy, plans, device, keep):
    """Builds per set of 20 plans, the Cases of the first ``keep`` plans (each holds ~0.5 GB of
    inputs) and the number of kernel shapes recorded, built under ``policy`` (buckets, reuse)
    from an empty shape record and graph cache."""
    buckets, reuse = policy
    _attention_cudnn.reset_graphs()
    builds, cases = [], []
    policy = attention_settings(shape_buckets=buckets, shape_reuse=reuse)
    with policy, attention_runs.kernel_shapes():
        for first in range(0, len(plans), 20):
            half = plans[first : first + 20]
            before = _attention_cudnn.graph_builds()
            for plan in half:
                case = Case(plan, 0 if plan.counts[0] else 1, None, device)
                case.ours(True)
                if len(cases) < keep:
                    cases.append(case)
            builds.append(_attention_cudnn.graph_builds() - before)
        shapes = len(attention_runs.recorded_shapes())
    return builds, cases, shapes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=20436)
    parser.add_argument("--policies", default="16:1,16:1.5,1:2", help="buckets:reuse, ...")
    parser.add_argument("--timed", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--passes", type=int, default=2, help="sets of 20 new plans")
    args = parser.parse_args()
    device = torch.device("cuda")
    rng = random.Random(1)
    plans = [_random_uneven_plan(args.seq_len, rng) for _ in range(20 * args.passes)]
    names = args.policies.split(",")
    policies = {n: (int(n.split(":")[0]), float(n.split(":")[1])) for n in names}
    ref, others = names[0], names[1:]
    built = {}
    sets = " | ".join(f"plans {20 * i + 1}-{20 * i + 20}" for i in range(args.passes))
    print(f"| policy | graph builds: {sets} | recorded shapes |")
    print("|---|" + "---|" * (args.passes + 1))
    for name in names:
        builds, cases, shapes = cases_at(policies[name], plans, device, args.timed)
        built[name] = cases
        print(f"| {name} | {' | '.join(map(str, builds))} | {shapes} |", flush=True)
    # Every graph any policy used is still cached (keyed by shape), so the timing builds none.
    print(
        f"\n| plan | entries | {ref} shape (batch, max_q, max_kv) | "
        + " | ".join(f"{n}: shape, time / {ref}" for n in others)
        + f" | {ref} ms |"
    )
    print("|---|---|---|" + "---|" * len(names))
    ratios = {n: [] for n in others}
    worst = {n: 0.0 for n in others}
    for i in range(args.timed):
        fns = {n: (lambda c=built[n][i]: c.ours(True)) for n in names}
        ms = time_round_robin(fns, device, args.reps, 1)
        own = built[ref][i].runs
        cells = []
        mine = built[ref][i].ours(True)
        for n in others:
            r = built[n][i].runs
            ratios[n].append(ms[n] / ms[ref])
            # Same inputs (a Case is seeded by its plan): outputs and gradients should agree.
            diff = max((a.float() - b.float()).abs().max().item()
                       for a, b in zip(built[n][i].ours(True), mine))  # fmt: skip
            worst[n] = max(worst[n], diff)
            cells.append(f"({r.batch}, {r.max_q}, {r.max_kv}) {ms[n] / ms[ref]:.3f}")
        print(
            f"| {i} | {own.entries} | ({own.batch}, {own.max_q}, {own.max_kv}) | "
            + " | ".join(cells)
            + f" | {ms[ref]:.2f} |",
            flush=True,
        )
    for n, r in ratios.items():
        print(
            f"policy {n}: time / {ref}, median {statistics.median(r):.3f}, worst {max(r):.3f}; "
            f"max |difference| of output and gradients {worst[n]:.3g}"
        )


if __name__ == "__main__":
    main()
