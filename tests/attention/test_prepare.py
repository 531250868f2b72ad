"""Building a batch's attention tables ahead of its forward (``ContextParallelParams.prepare``).

A trainer builds the next micro-batch's tables while the current one runs (a background thread
or a data-loader worker): ``prepare`` must build them exactly once, give the layers the same
object, and warm the device tables of every kernel call inside, for run, blocked and tree tables.
"""

from __future__ import annotations

import threading

import torch
from _dist import run_distributed

from megatron.context_parallel import ContextParallelParams, ContextParallelPlan, PrefixTree
from megatron.context_parallel.attention.blocks import AttentionBlocks
from megatron.context_parallel.attention.runs import AttentionRuns
from megatron.context_parallel.attention.tree_tables import TreeTables

SEQ = 2048


def _scattered() -> ContextParallelPlan:
    owner = torch.randint(0, 2, (SEQ,), generator=torch.Generator().manual_seed(0))
    return ContextParallelPlan.from_rank_positions(
        [torch.nonzero(owner == r).flatten() for r in range(2)], SEQ
    )


CASES = {
    "runs": (ContextParallelPlan.zigzag(SEQ, 2), None, AttentionRuns),
    "blocks": (_scattered(), None, AttentionBlocks),
    "tree": (
        ContextParallelPlan.contiguous(SEQ, 2),
        PrefixTree(parents=(-1, 0, 0, 1), lengths=(800, 400, 600, 248)),
        TreeTables,
    ),
}


def _prepare_on_each_rank(rank, world):
    import torch.distributed as dist

    failures = []
    device = torch.device("cpu")
    for name, (plan, tree, kind) in CASES.items():
        params = ContextParallelParams.for_plan(plan, dist.group.WORLD, tree=tree)
        if params.prepare(device) is not params:
            failures.append(f"{name}: prepare returned another object")
        tables = params.runs
        if not isinstance(tables, kind) or params.runs is not tables:
            failures.append(f"{name}: {type(tables).__name__} built, {kind.__name__} expected")
        if device not in tables._device:
            failures.append(f"{name}: the device tables were not built")
        calls = {
            "runs": [],
            "blocks": tables.calls() if isinstance(tables, AttentionBlocks) else [],
            "tree": [tables.own, *tables.levels] if isinstance(tables, TreeTables) else [],
        }[name]
        failures += [f"{name}: a call was not warmed" for c in calls if device not in c._device]
    return failures


def test_prepare_builds_once_and_warms_every_call():
    for failures in run_distributed(_prepare_on_each_rank, 2):
        assert not failures, failures


def test_prepare_from_a_background_thread():
    plan = ContextParallelPlan.contiguous(SEQ, 1)
    tree = CASES["tree"][1]
    params = ContextParallelParams.for_plan(plan, None, tree=tree)
    worker = threading.Thread(target=params.prepare)
    worker.start()
    worker.join()
    built = params._per_batch["attention_runs"]
    assert params.runs is built
