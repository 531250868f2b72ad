"""Per-call cost of the bad-input exchange on the good path, against the same call without it.

Every gather and scatter first exchanges every rank's verdict on its input (``groups.agree``:
one all-gather of a few int64 per rank on the group's collective device, read on the host).
"without" is the same call with that exchange replaced by the local checks alone, which is
what the code before it did on every call after a plan's first use; the two are timed
interleaved in one run.

Modes:

* ``--backend gloo`` (CPU tensors, or CUDA tensors with ``--device cuda``: gloo ranks may share
  one GPU): ``--world`` ranks spawned here. Times a gather of per-token log-probs (20,436 fp32)
  and of a small hidden payload, with and without the exchange, and the exchange alone.
* ``--backend nccl`` (one GPU): NCCL refuses two ranks on one GPU, and a group of one exchanges
  nothing, so the exchange's own work (int64 to the GPU, an NCCL all-gather, the host read) is
  timed on a one-rank NCCL group: alone, and in a loop behind about a millisecond of queued GPU
  work per call, where the host read must wait for that work and the GPU then idles while the
  host launches what follows. A real CP group adds the all-gather's NVLink latency (a few us).

Run (repository root):

    PYTHONPATH=. python benchmarks/comm/bench_exchange.py --backend gloo --device cpu --world 2
    PYTHONPATH=. python benchmarks/comm/bench_exchange.py --backend nccl --device cuda
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import sys
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "benchmarks"))  # timing, the shared helper

from timing import sync, time_ms, time_round_robin  # noqa: E402

from megatron.context_parallel import (  # noqa: E402
    ContextParallelPlan,
    gather_from_context_parallel_region,
)
from megatron.context_parallel.comm import groups, mappings  # noqa: E402


class _NoExchange:
    """Within the block, the mappings check their input locally and exchange nothing."""

    def __enter__(self):
        self._real = mappings._agree_on_input

        def local_only(problem, plan, group, check):
            if problem is not None:
                raise problem
            rank = plan.rank_in(group)
            check(rank)
            return rank

        mappings._agree_on_input = local_only

    def __exit__(self, *exc):
        mappings._agree_on_input = self._real


def _gloo_worker(rank: int, world: int, port: int, device_kind: str, reps: int, out: dict):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = torch.device("cuda", 0) if device_kind == "cuda" else torch.device("cpu")

    group = dist.group.WORLD
    results: Dict[str, float] = {}
    for name, rows, width in (
        ("logprobs 20436 fp32", 20436, 1),
        ("hidden 1024x256 fp32", 1024, 256),
    ):
        plan = ContextParallelPlan.zigzag(rows - rows % (2 * world), world)
        shape = (plan.counts[rank],) + ((width,) if width > 1 else ())
        local = torch.randn(shape, device=device)
        for _ in range(3):
            gather_from_context_parallel_region(local, plan, group)

        def call(local=local, plan=plan):
            # Until every rank is done: the wait for the device and the barrier are part of it.
            gather_from_context_parallel_region(local, plan, group)
            sync(device)
            dist.barrier()

        def call_without(call=call):
            with _NoExchange():
                call()

        # Every rank draws the same order (the same seed), so the collectives pair up.
        ms = time_round_robin(
            {"with": call, "without": call_without},
            device,
            reps,
            0,
            clock="host",
            before=dist.barrier,
        )
        results[f"gather {name}: with exchange"] = 1e3 * ms["with"]
        results[f"gather {name}: without"] = 1e3 * ms["without"]
    values = list(range(15))

    def exchange():
        groups.exchange(values, group)
        sync(device)
        dist.barrier()

    results["exchange alone"] = 1e3 * time_ms(
        exchange, device, reps, 0, clock="host", before=dist.barrier
    )
    if rank == 0:
        out.update(results)
    dist.destroy_process_group()


def _run_gloo(args) -> Dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.Manager()
    out = manager.dict()
    mp.spawn(
        _gloo_worker,
        args=(args.world, port, args.device, args.reps, out),
        nprocs=args.world,
        join=True,
    )
    return dict(out)


def _run_nccl(args) -> Dict[str, float]:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    group = dist.group.WORLD
    device = groups.collective_device(group)
    values = list(range(15))

    def exchange_work():
        # What groups.exchange does on a group of two or more (a group of one skips it).
        return groups._all_gather_ints(values, group, 1, device)

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def queued_work():
        for _ in range(8):
            torch.matmul(a, b)

    def step(with_exchange: bool):
        queued_work()
        if with_exchange:
            exchange_work()

    for _ in range(5):
        step(True)
    torch.cuda.synchronize()
    results = {
        "exchange alone (idle GPU)": 1e3
        * time_ms(exchange_work, device, args.reps, 0, clock="host")
    }
    loops = 50

    def loop(flag):
        for _ in range(loops):
            step(flag)

    ms = time_round_robin(
        {"with": lambda: loop(True), "without": lambda: loop(False)},
        device,
        max(args.reps // 10, 5),
        0,
        clock="host",
    )
    results["loop step, ~1 ms queued GPU work: with exchange"] = 1e3 * ms["with"] / loops
    results["loop step, ~1 ms queued GPU work: without"] = 1e3 * ms["without"] / loops
    results["per-call cost in the loop"] = (
        results["loop step, ~1 ms queued GPU work: with exchange"]
        - results["loop step, ~1 ms queued GPU work: without"]
    )
    dist.destroy_process_group()
    return results


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args(argv)
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    results = _run_gloo(args) if args.backend == "gloo" else _run_nccl(args)
    where = f"{args.backend}, {args.device}" + (
        f", {args.world} ranks" if args.backend == "gloo" else ", one-rank group"
    )
    if args.device == "cuda":
        where += f", {torch.cuda.get_device_name(0)}"
    print(f"\n| per call ({where}), median | us |\n|---|---:|")
    for key, value in results.items():
        print(f"| {key} | {value:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
