"""What the full-rectangle model of cuDNN's ragged causal backward predicts for the run plans.

The model (DESIGN.md, tree attention misses): with a bottom-right diagonal the ragged backward
computes each entry's whole ``q_len x kv_len`` rectangle, skipping no masked tile. For each named
run plan of ``bench_attention.py`` (heaviest rank, host tables only, no GPU) this prints the
rectangles' area over the visible query-key pairs, and the same with the square entries (a
sequence's first run) computed as triangles, as a call of their own aligned top-left would if
that alignment brings tile skipping back.

    PYTHONPATH=$PWD python3 benchmarks/probes/probe_rectangles.py [--sizes 20436,131072]
"""

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))
from bench_attention import _sequence, selected_cases  # noqa: E402

from megatron.context_parallel.attention.blocks import build_attention_tables  # noqa: E402
from megatron.context_parallel.attention.runs import AttentionRuns  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20436,131072")
    args = parser.parse_args()
    print("| case | S | entries | square | rectangles / visible | square apart / visible |")
    print("|---|---:|---:|---:|---:|---:|")
    for seq_len in (int(s) for s in args.sizes.split(",")):
        for name, plan, rank, cu in selected_cases(seq_len, named=True):
            tables = build_attention_tables(plan, rank, _sequence(plan.seq_len, cu))
            if not isinstance(tables, AttentionRuns):
                continue  # the blocked layout's calls are unmasked or square already
            q, kv = tables.q_len.double(), tables.kv_len.double()
            visible = (q * (kv - q) + q * (q + 1) / 2).sum()
            square = q == kv
            apart = (q * kv)[~square].sum() + (q * (q + 1) / 2)[square].sum()
            print(
                f"| {name} | {seq_len} | {tables.entries} | {int(square.sum())} "
                f"| {float((q * kv).sum() / visible):.2f} | {float(apart / visible):.2f} |"
            )


if __name__ == "__main__":
    main()
