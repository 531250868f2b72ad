"""The gather alone: uneven shards of one sequence back in source order on every rank."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron.context_parallel import (
    ContextParallelPlan,
    gather_from_context_parallel_region,
    scatter_to_context_parallel_region,
)


def main(rank, world):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD  # explicit groups: no megatron-core needed
    # Any ownership: rank 0 holds positions 5, 0, 3 and rank 1 holds 1, 4, 2, 6, in that order.
    plan = ContextParallelPlan.from_rank_positions([[5, 0, 3], [1, 4, 2, 6]])
    hidden = torch.randn(7, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    local = scatter_to_context_parallel_region(hidden, plan, group)  # this rank's rows
    logprobs = -local.detach().square().sum(-1)  # any per-row field, any dtype
    out = gather_from_context_parallel_region(
        {"hidden": local * 2, "logprobs": logprobs}, plan, group
    )  # every field in ONE collective: full length, source order, on every rank
    assert torch.equal(out["hidden"], hidden * 2)
    mask = torch.tensor([True, False, True, True, False, True])
    assert out["hidden"][1:][mask].shape == (4, 4)  # index by position, as on one device
    out["hidden"].sum().backward()  # every rank computes the same loss on full outputs
    assert torch.equal(hidden.grad, torch.full_like(hidden, 2.0))  # each row's gradient once
    if rank == 0:
        print("gather: OK")


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    mp.start_processes(main, args=(2,), nprocs=2, start_method="fork")  # 2 ranks, gloo
