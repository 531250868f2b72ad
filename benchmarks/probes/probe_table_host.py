"""Where the fused attention's per-batch table time goes on a GPU machine's host (diagnostic).

``bench_attention.py`` reports one number per case: build the tables and copy them to the GPU,
synchronised both sides. Per case at S = 20,436 this splits it, median of ``--reps`` after two
warm-ups, in milliseconds:

* ``build``: ``build_attention_tables`` (compact keys and the rank's run or blocked tables, C++);
* ``host``: the per-call device layout on the host (``_host_tables``; runs only);
* ``pack``: ``StagedTables``' ``torch.cat`` of every table into one int64 tensor;
* ``pin``: ``pin_memory()`` of that tensor (the caching host allocator);
* ``copy``: the non-blocking host-to-device copy and a synchronisation;
* ``on``: the whole ``tables.on(cuda)`` (pack, pin, copy, int32 region, views) and a
  synchronisation;
* ``busy``: host ms of ``build`` + ``on`` without a synchronisation while the GPU runs ~20 ms of
  queued matmuls (as at a model's first attention layer): whether any step waits for the GPU;
* ``stage``: ``build`` and ``stage`` (every host layout and the pinned buffer: what
  ``ContextParallelParams.prepare`` does off the step, in a data-loader thread);
* ``staged on``: ``on(cuda)`` of tables staged ahead and a synchronisation (what the step keeps);
* with ``--step``, ``first use``: the host ms a step spends on a batch's tables staged ahead, the
  tables the first layer derives on the device included (``DeviceRuns`` / ``DeviceBlocks``: key
  sources, slot copies, offsets, statistics index; the backward's parts and windows): the launch
  time of ``on`` and one fused forward+backward with fresh staged tables, less that of the
  forward+backward on tables already on the device, the GPU kept busy in front of both
  (``step warm``: the latter); ``first use, bwd ahead``: the same with the backward's parts and
  windows staged ahead too (``prepare(heads=, head_dim=)``).

Each case runs twice: on one intra-op thread (``serial``, the library's default,
``AttentionSettings.serial_host_ops``) and on torch's intra-op threads (``threads``).

With ``--cpu`` (no GPU needed) the host's share alone, serial: ``build``, ``stage``, ``staged on``
and ``build + on`` (``bench_attention.py``'s "tables ms" less the host-to-device copy and its
synchronisation), the tables' "device" being the CPU: what any host change moves, timed on a
machine without a GPU.

    PYTHONPATH=$PWD python3 benchmarks/probes/probe_table_host.py [--reps 20] [--named] [--step]
    PYTHONPATH=$PWD python3 benchmarks/probes/probe_table_host.py --cpu [--named] [--seq-len S]
"""

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))
from bench_attention import (  # noqa: E402
    Case,
    _sequence,
    cases,
    selected_cases,
    staged_ahead,
    staged_on_ms,
)
from timing import time_ms  # noqa: E402

from megatron.context_parallel.attention.blocks import build_attention_tables  # noqa: E402
from megatron.context_parallel.attention.runs import INT32_TABLES, AttentionRuns  # noqa: E402
from megatron.context_parallel.attention.settings import attention_settings  # noqa: E402

dev = torch.device("cuda")


def median_ms(fn, reps):
    """Median ms of ``fn()`` after two warm-ups, the GPU drained before and after each call."""
    return time_ms(fn, dev, reps, 2, clock="host")


def probe(plan, rank, seq, reps, busy_work):
    """One case's row: ms per step (see the module docstring)."""
    tables = build_attention_tables(plan, rank, seq)
    row = {"build": median_ms(lambda: build_attention_tables(plan, rank, seq), reps)}
    if isinstance(tables, AttentionRuns):
        row["host"] = median_ms(tables._host_tables, reps)
        flat = [v.reshape(-1) for v in tables._host_tables().values() if v is not None]
        row["pack"] = median_ms(lambda: torch.cat(flat), reps)
        packed = torch.cat(flat)
        row["pin"] = median_ms(packed.pin_memory, reps)
        pinned = packed.pin_memory()
        row["copy"] = median_ms(lambda: pinned.to(dev, non_blocking=True), reps)
    row["build + on"] = median_ms(lambda: build_attention_tables(plan, rank, seq).on(dev), reps)
    row["on"] = row["build + on"] - row["build"]
    # Host time alone (no synchronisation after) while the GPU runs the queued matmuls.
    row["busy"] = time_ms(
        lambda: build_attention_tables(plan, rank, seq).on(dev),
        dev,
        reps,
        0,
        clock="launch",
        before=busy_work,
    )
    row["stage"] = median_ms(lambda: build_attention_tables(plan, rank, seq).stage(), reps)
    row["staged on"] = staged_on_ms(lambda: build_attention_tables(plan, rank, seq), dev, reps)
    row["layout"] = "runs" if isinstance(tables, AttentionRuns) else "blocks"
    return row


def probe_cpu(plan, rank, seq, reps):
    """``--cpu``'s row: ms of the host work alone, the tables' device being the CPU."""
    cpu = torch.device("cpu")

    def make():
        return build_attention_tables(plan, rank, seq)

    row = {"build": time_ms(make, cpu, reps, 2, clock="host")}
    row["stage"] = time_ms(lambda: make().stage(), cpu, reps, 2, clock="host")
    row["staged on"] = staged_on_ms(make, cpu, reps)
    row["build + on"] = time_ms(lambda: make().on(cpu), cpu, reps, 2, clock="host")
    row["layout"] = "runs" if isinstance(make(), AttentionRuns) else "blocks"
    return row


def first_use(plan, rank, cu, reps, backward=False):
    """(``first use``, ``step warm``) ms of one case: see the module docstring; ``backward``:
    the backward's parts and windows staged ahead too (``first use, bwd ahead``)."""
    case = Case(plan, rank, cu, dev)
    seq = case.sequence
    warm = build_attention_tables(plan, rank, seq)
    stage, fresh = staged_ahead(lambda: build_attention_tables(plan, rank, seq), backward)

    def step_fresh():
        case.runs = fresh["tables"]
        case.runs.on(dev)
        case.ours(True)

    def step_warm():
        case.runs = warm
        case.ours(True)

    step_fresh()  # warm-up: the kernels' graphs, the allocator's blocks
    step_warm()
    # The GPU spins 40 ms ahead of each call, longer than its host work, so no launch waits.
    lead = dict(clock="launch", lead_ms=40.0)
    warm_ms = time_ms(step_warm, dev, reps, 1, **lead)
    fresh_ms = time_ms(step_fresh, dev, reps, 0, before=stage, **lead)
    return fresh_ms - warm_ms, warm_ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=20436)
    parser.add_argument(
        "--named", action="store_true", help="bench_attention's named cases instead of its default"
    )
    parser.add_argument(
        "--step", action="store_true", help="also the first layer's host cost (library defaults)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="the host's share alone, on a machine without a GPU"
    )
    args = parser.parse_args()
    chosen = selected_cases(args.seq_len, named=True) if args.named else cases(args.seq_len)
    if args.cpu:
        keys = ("build", "stage", "staged on", "build + on")
        print(f"| case | layout | S | {' | '.join(keys)} |")
        print("|---|---|---:|" + "---:|" * len(keys))
        with attention_settings(serial_host_ops=True):
            for name, plan, rank, cu in chosen:
                row = probe_cpu(plan, rank, _sequence(plan.seq_len, cu), args.reps)
                cells = " | ".join(f"{row[k]:.3f}" for k in keys)
                print(f"| {name} | {row['layout']} | {plan.seq_len} | {cells} |", flush=True)
        print(f"(host: {torch.get_num_threads()} threads, serial)")
        return
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def busy_work():
        for _ in range(20):  # ~1 ms each on an H100
            a @ a

    keys = ("build", "host", "pack", "pin", "copy", "on", "build + on", "busy", "stage")
    keys += ("staged on",)
    keys += ("first use", "first use, bwd ahead", "step warm") if args.step else ()
    print("| case | layout | host ops | " + " | ".join(keys) + " |")
    print("|---|---|---|" + "---:|" * len(keys))
    for name, plan, rank, cu in chosen:
        for serial in (False, True):
            with attention_settings(serial_host_ops=serial):
                row = probe(plan, rank, _sequence(plan.seq_len, cu), args.reps, busy_work)
                if args.step and serial:
                    row["first use"], row["step warm"] = first_use(plan, rank, cu, args.reps)
                    row["first use, bwd ahead"], _ = first_use(plan, rank, cu, args.reps, True)
            cells = [f"{row[k]:.3f}" if k in row else "-" for k in keys]
            mode = "serial" if serial else "threads"
            print(f"| {name} | {row['layout']} | {mode} | " + " | ".join(cells) + " |", flush=True)
    print(f"(int32 tables: {', '.join(INT32_TABLES)}; host: {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
