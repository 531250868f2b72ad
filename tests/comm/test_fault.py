"""A CP rank that dies or stops must not leave its peers waiting forever in the gather.

One rank of a gloo CP group is killed (SIGKILL) or stopped (SIGSTOP, a peer that is stuck but
alive) just before a ``gather_from_context_parallel_region`` call, on the plan's first use or a
later call. The survivors must fail inside that call with torch's distributed error, within the
process group's timeout (set short here) plus some slack for a loaded CI machine; a dead peer
is usually noticed at once (its sockets close), a stopped one only by that timeout. The harness
waits at most ``HARD_TIMEOUT_S`` for them, so a regression fails this test instead of hanging CI.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from megatron.context_parallel import ContextParallelPlan, gather_from_context_parallel_region

PG_TIMEOUT_S = 3.0
# Two cores shared by several ranks, and possibly by other jobs: generous, but far from a hang.
SLACK_S = 15.0
HARD_TIMEOUT_S = 60.0


def _uneven_plan(cp: int) -> ContextParallelPlan:
    """Rank r holds r + 2 shuffled positions; two positions belong to nobody."""
    owned = sum(r + 2 for r in range(cp))
    order = torch.randperm(owned + 2, generator=torch.Generator().manual_seed(cp))
    shards, start = [], 0
    for r in range(cp):
        shards.append(order[start : start + r + 2].tolist())
        start += r + 2
    return ContextParallelPlan.from_rank_positions(shards, seq_len=len(order))


def _fields(plan: ContextParallelPlan, rank: int) -> dict:
    positions = plan.local_positions(rank)
    return {
        "hidden": positions.float()[:, None].repeat(1, 8),
        "token": positions * 10,
    }


def _gather_after_a_peer_fault(rank, world_size, victim, fault, first_call):
    plan = _uneven_plan(world_size)
    group = dist.group.WORLD
    local = _fields(plan, rank)
    if not first_call:
        # The plan is verified and the data path has run once with every rank alive.
        out = gather_from_context_parallel_region(local, plan, group)
        owned = plan.owned_mask()
        assert torch.equal(out["token"][owned], torch.arange(plan.seq_len)[owned] * 10)
    dist.barrier(group=group)  # every rank, the victim included, got this far
    if rank == victim:
        os.kill(os.getpid(), fault)
        # SIGSTOP: frozen here, still holding its sockets, until the harness kills it.
        raise AssertionError("a killed or stopped rank cannot get here")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        gather_from_context_parallel_region(local, plan, group)
    elapsed = time.monotonic() - start
    message = str(info.value)
    # torch's error from the gloo transport (a RuntimeError), not one of ours about the inputs.
    assert "gloo" in message and not isinstance(info.value, ValueError), message
    assert elapsed < PG_TIMEOUT_S + SLACK_S, f"rank {rank} failed only after {elapsed:.1f} s"
    if fault == signal.SIGSTOP:
        # A stuck peer holds its connections open: only the process group's timeout, the one
        # set by the harness, ends the wait. Hence the README's advice to set it ("Timeouts").
        assert f"Timed out waiting {int(PG_TIMEOUT_S * 1000)}ms" in message, message
        assert elapsed >= 0.8 * PG_TIMEOUT_S, f"rank {rank} failed after {elapsed:.1f} s"
    return elapsed


@pytest.mark.timeout(2 * HARD_TIMEOUT_S)
@pytest.mark.parametrize(
    "world_size,victim,fault,first_call",
    [
        (2, 1, signal.SIGKILL, True),
        (2, 0, signal.SIGSTOP, False),
        (3, 0, signal.SIGKILL, False),  # rank 0 also hosts the rendezvous store
        (3, 2, signal.SIGSTOP, True),
    ],
    ids=["cp2-kill-first-call", "cp2-stop-later-call", "cp3-kill-rank0-later", "cp3-stop-first"],
)
def test_survivors_fail_within_the_process_group_timeout(world_size, victim, fault, first_call):
    elapsed = run_distributed(
        _gather_after_a_peer_fault,
        world_size,
        victim,
        fault,
        first_call,
        timeout=HARD_TIMEOUT_S,
        pg_timeout=PG_TIMEOUT_S,
        lost_ranks=[victim],
    )
    survivors = [t for r, t in enumerate(elapsed) if r != victim]
    assert len(survivors) == world_size - 1 and all(t is not None for t in survivors)
