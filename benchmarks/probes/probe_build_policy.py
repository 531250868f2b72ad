"""How many cuDNN graphs would random plans build under a shape policy? Answered on the CPU.

A batch's graphs are keyed by the kernel shape its tables ask for (``AttentionRuns.batch /
max_q / max_kv``: sizes rounded to ``AttentionSettings.shape_buckets`` per octave, then maybe
a recorded shape up to ``AttentionSettings.shape_reuse`` times larger) and, for the backward,
by the row totals a built graph can hold (``attention.cudnn.backward_totals``, called here as
the kernel calls it). Both are host quantities, so replaying the tables of the plans
``probe_shape_reuse.py`` draws gives its build counts without a GPU (the same counts as on the
H100: RESULTS.md, "Attention kernel shapes"). Policies are tried here before a device call times
them.

Per policy ``buckets:reuse``: builds per set of 20 random uneven plans, split into new
forward shapes, new backward shapes and larger totals of a known backward shape.

``python benchmarks/probes/probe_build_policy.py [--sets 5] [--policies 16:1,16:1.5,1:2]
[--seq-len 20436]``
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))

from bench_attention import _random_uneven_plan, _sequence  # noqa: E402

from megatron.context_parallel.attention import cudnn as _attention_cudnn  # noqa: E402
from megatron.context_parallel.attention import runs as attention_runs  # noqa: E402
from megatron.context_parallel.attention.blocks import (  # noqa: E402
    AttentionBlocks,
    build_attention_tables,
)
from megatron.context_parallel.attention.settings import (  # noqa: E402
    attention_settings,
    current_attention_settings,
)


def _calls(tables):
    """Every kernel call of a batch's tables."""
    if isinstance(tables, AttentionBlocks):
        calls = [call for call, *_ in tables.diagonal] + list(tables.levels)
        return calls + ([tables.bulk] if tables.bulk is not None else [])
    return [tables]


def replay(buckets, reuse, sets, seq_len=20436, seed=1):
    """(builds per set of 20 plans, {kind: builds}) from an empty shape record and graph cache,
    with ``AttentionSettings.shape_buckets = buckets`` and ``shape_reuse = reuse``."""
    policy = attention_settings(shape_buckets=buckets, shape_reuse=reuse)
    with policy, attention_runs.kernel_shapes():
        return _replay(sets, seq_len, seed)


def _replay(sets, seq_len, seed):
    """``replay`` under the settings and shape record in effect."""
    rng = random.Random(seed)
    _attention_cudnn.reset_graphs()
    forward, backward = set(), set()
    kinds = {"forward shapes": 0, "backward shapes": 0, "larger totals": 0}
    per_set = []
    for _ in range(sets):
        builds = 0
        for _ in range(20):
            plan = _random_uneven_plan(seq_len, rng)
            rank = 0 if plan.counts[0] else 1
            for call in _calls(build_attention_tables(plan, rank, _sequence(seq_len, None))):
                key = (call.batch, call.max_q, call.max_kv, call.causal)
                if key not in forward:
                    forward.add(key)
                    kinds["forward shapes"] += 1
                    builds += 1
                # The library's own choice of backward graph totals, on the kernel's records.
                _, built = _attention_cudnn.backward_totals(key, call.total_q, call.total_mat)
                if built:
                    kinds["larger totals" if key in backward else "backward shapes"] += 1
                    backward.add(key)
                    builds += 1
        per_set.append(builds)
    return per_set, kinds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sets", type=int, default=5, help="sets of 20 random plans")
    parser.add_argument("--policies", default="16:1,16:1.5,1:2", help="buckets:reuse, ...")
    parser.add_argument("--seq-len", type=int, default=20436)
    args = parser.parse_args()
    settings = current_attention_settings()
    default = settings.shape_buckets, settings.shape_reuse
    try:
        header = "builds per set of 20 plans | forward / backward shapes, larger totals"
        print(f"S = {args.seq_len}; default policy {default[0]}:{default[1]}")
        print(f"| policy | {header} |")
        print("|---|---|---|")
        for policy in args.policies.split(","):
            buckets, reuse = policy.split(":")
            per_set, kinds = replay(int(buckets), float(reuse), args.sets, args.seq_len)
            print(f"| {policy} | {', '.join(map(str, per_set))} | "
                  f"{' / '.join(str(v) for v in kinds.values())} |", flush=True)  # fmt: skip
    finally:
        _attention_cudnn.reset_graphs()


if __name__ == "__main__":
    main()
