"""How many cuDNN graphs would random plans build under a shape policy? Answered on the CPU.

A batch's graphs are keyed by the kernel shape its tables ask for (``AttentionRuns.batch /
max_q / max_kv``, after ``attention_runs.SHAPE_REUSE``) and, for the backward, by the row
totals a built graph can hold (``_attention_cudnn.backward`` reuses one built for larger
totals). Both are host quantities, so replaying the tables of the plans
``probe_shape_reuse.py`` draws gives its build counts without a GPU (session 22: the same
37, 35, 30, 27, 29 and 27, 9, 8, 10, 11 as the H100). Policies are tried here before a device
call times them.

Per tolerance: builds per set of 20 random uneven plans at S = 20,436, split into new forward
shapes, new backward shapes and larger totals of a known backward shape. ``--any-key-length``
also lets a batch run on a recorded shape with any larger key length (cuDNN's padded key tiles
end early), an untimed alternative.

``python benchmarks/probes/probe_build_policy.py [--sets 5] [--tolerances 1,1.5]``
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench_attention import _random_uneven_plan, _sequence  # noqa: E402

from megatron.context_parallel import attention_runs  # noqa: E402
from megatron.context_parallel.attention_blocks import (  # noqa: E402
    AttentionBlocks,
    build_attention_tables,
)


def _calls(tables):
    """Every kernel call of a batch's tables."""
    if isinstance(tables, AttentionBlocks):
        calls = [call for call, *_ in tables.diagonal] + list(tables.levels)
        return calls + ([tables.bulk] if tables.bulk is not None else [])
    return [tables]


def _any_key_length(batch, max_q, max_kv):
    """``attention_runs._shared_shape`` with no bound on the recorded key length."""
    own = (batch, max_q, max_kv)
    chosen = attention_runs._SHAPES.get(own)
    if chosen is None:
        fits = [
            s
            for s in attention_runs.recorded_shapes()
            if batch <= s[0] <= 2 * batch
            and max_q <= s[1] <= max_q * attention_runs.SHAPE_REUSE
            and max_kv <= s[2]
        ]
        chosen = min(fits, key=lambda s: (s[0] * s[1] * s[2], s)) if fits else own
        attention_runs._SHAPES[own] = chosen
    return chosen


def replay(tolerance, sets, seq_len=20436, seed=1):
    """(builds per set of 20 plans, {kind: builds}) from an empty shape record."""
    attention_runs.SHAPE_REUSE = tolerance
    attention_runs._SHAPES.clear()
    rng = random.Random(seed)
    forward, backward = set(), {}
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
                totals = backward.setdefault(key, [])
                if not any(q >= call.total_q and m >= call.total_mat for q, m in totals):
                    kinds["larger totals" if totals else "backward shapes"] += 1
                    totals.append((call.total_q, call.total_mat))
                    builds += 1
        per_set.append(builds)
    return per_set, kinds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sets", type=int, default=5, help="sets of 20 random plans")
    parser.add_argument("--tolerances", default="1,1.5")
    parser.add_argument("--any-key-length", action="store_true")
    args = parser.parse_args()
    default_tolerance, default_shared = attention_runs.SHAPE_REUSE, attention_runs._shared_shape
    if args.any_key_length:
        attention_runs._shared_shape = _any_key_length
    try:
        header = "builds per set of 20 plans | forward / backward shapes, larger totals"
        print(f"| tolerance | {header} |")
        print("|---|---|---|")
        for tolerance in (float(t) for t in args.tolerances.split(",")):
            per_set, kinds = replay(tolerance, args.sets)
            print(f"| {tolerance} | {', '.join(map(str, per_set))} | "
                  f"{' / '.join(str(v) for v in kinds.values())} |", flush=True)  # fmt: skip
    finally:
        attention_runs.SHAPE_REUSE, attention_runs._shared_shape = default_tolerance, default_shared
        attention_runs._SHAPES.clear()


if __name__ == "__main__":
    main()
