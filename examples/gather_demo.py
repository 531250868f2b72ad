"""Several gloo ranks hold uneven shards of one sequence; the gather returns it in source order.

Run on a CPU: ``python examples/gather_demo.py [--cp 3] [--seq-len 20]``. The script spawns the
ranks itself. Each rank holds the rows an uneven, shuffled plan gives it (one rank holds none),
gathers hidden states, per-token log-probs and a padding mask in ONE collective, and checks the
result against the full tensors it started from. The bug report's probe, ``hidden[1:][mask]`` with a
full-sequence mask, then works as it does on one GPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.context_parallel import ContextParallelPlan, gather_from_context_parallel_region


def uneven_plan(seq_len: int, cp: int, seed: int) -> ContextParallelPlan:
    """A shuffled plan with shard sizes 0, 1, 2, ... (scaled), like a prefix-tree rank plan."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(seq_len, generator=g)
    weights = torch.arange(cp, dtype=torch.float64)
    cuts = (weights.cumsum(0) / weights.sum() * seq_len).round().long().tolist()
    starts = [0] + cuts[:-1]
    return ContextParallelPlan.from_rank_positions(
        [order[a:b] for a, b in zip(starts, cuts)], seq_len=seq_len
    )


def full_fields(seq_len: int, hidden: int):
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(seq_len, hidden, generator=g).to(torch.bfloat16),
        "target_logprobs": -torch.rand(seq_len, generator=g),
        "mask": torch.rand(seq_len, generator=g) > 0.3,
    }


def worker(rank: int, cp: int, port: int, seq_len: int, hidden: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=cp,
        timeout=datetime.timedelta(seconds=60),
    )
    plan = uneven_plan(seq_len, cp, seed=1)
    full = full_fields(seq_len, hidden)
    mine = plan.local_positions(rank)
    local = {k: v[mine] for k, v in full.items()}
    out = gather_from_context_parallel_region(local, plan, dist.group.WORLD)
    exact = all(torch.equal(out[k], full[k]) for k in full)
    probe = out["hidden_states"][1:][full["mask"][1:]]
    reference = full["hidden_states"][1:][full["mask"][1:]]
    msg = (
        f"rank {rank}: holds {plan.counts[rank]:>3} rows {mine[:6].tolist()}"
        f"{'...' if plan.counts[rank] > 6 else ''} -> gathered {tuple(out['hidden_states'].shape)}"
        f" in source order: {'exact' if exact else 'MISMATCH'}; probe hidden[1:][mask] "
        f"{tuple(probe.shape)} {'passed' if torch.equal(probe, reference) else 'FAILED'}"
    )
    for r in range(cp):
        if r == rank:
            print(msg, flush=True)
        dist.barrier()
    dist.destroy_process_group()
    if not exact or not torch.equal(probe, reference):
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=4, help="CP ranks to spawn (gloo, CPU)")
    parser.add_argument("--seq-len", type=int, default=37)
    parser.add_argument("--hidden", type=int, default=16)
    args = parser.parse_args()
    plan = uneven_plan(args.seq_len, args.cp, seed=1)
    print(f"plan: {plan}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(args.cp, port, args.seq_len, args.hidden), nprocs=args.cp)
    print("gather_demo: PASSED (every rank holds the full sequence in source order)")


if __name__ == "__main__":
    main()
