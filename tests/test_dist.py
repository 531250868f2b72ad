"""The rank harness itself (tests/_dist.py): every way a rank can fail reaches the test, fast.

A harness that swallowed a failing rank, or waited out a dead one, would make every
multi-process test in the suite either untrustworthy or slow, so its failure paths are tested.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from _dist import DistributedPool, WorkerError, run_distributed


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return scale * t.item()


def test_results_come_back_in_rank_order():
    assert run_distributed(_sum_of_ranks, 3, 10.0) == [30.0, 30.0, 30.0]


def test_spawned_ranks_work_like_forked_ones():
    # GPU tests spawn (a forked child cannot use the parent's CUDA context): keep that path alive.
    assert run_distributed(_sum_of_ranks, 2, 1.0, start_method="spawn") == [1.0, 1.0]


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one's own message")
    return rank


def test_a_raising_rank_reports_its_traceback():
    with pytest.raises(WorkerError, match="(?s)--- rank 1 ---.*ValueError: rank one's own message"):
        run_distributed(_raise_on_rank_one, 2)


def _exit_on_rank_one(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def test_a_rank_that_dies_fails_the_call_without_waiting_for_the_timeout():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 exited with code 3 before reporting"):
        run_distributed(_exit_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 20


def _sleep_on_rank_one(rank, world_size):
    if rank == 1:
        time.sleep(60)
    return rank


def test_a_hung_rank_fails_the_call_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 did not finish _sleep_on_rank_one within 2"):
        run_distributed(_sleep_on_rank_one, 2, timeout=2)
    assert time.monotonic() - start < 20


def _kill_rank_one(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_lost_ranks_are_expected_to_vanish():
    assert run_distributed(_kill_rank_one, 3, lost_ranks=[1]) == [0, None, 2]
    # A rank declared lost that reports anyway means the test did not do what it meant to.
    with pytest.raises(WorkerError, match="rank 2 reported, but it was expected to be lost"):
        run_distributed(_kill_rank_one, 3, lost_ranks=[1, 2])


def test_pool_starts_afresh_after_losing_a_rank():
    pool = DistributedPool(2, timeout=30)
    try:
        with pytest.raises(WorkerError, match="rank 1 exited with code 3"):
            pool.run(_exit_on_rank_one)
        assert pool.run(_sum_of_ranks, 2.0) == [2.0, 2.0]
    finally:
        pool.close()
