"""Building a batch's attention tables ahead of its forward (``ContextParallelParams.prepare``).

A trainer builds the next micro-batch's tables while the current one runs (a background thread
or a data-loader worker): ``prepare`` must build them exactly once, give the layers the same
object, and warm the device tables of every kernel call inside, for run, blocked and tree tables.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _attention_ref import WindowedSplitSharedKeysReferenceKernel
from _dist import run_distributed

from megatron.context_parallel import ContextParallelParams, ContextParallelPlan, PrefixTree
from megatron.context_parallel.attention import cudnn, tree_tables
from megatron.context_parallel.attention.blocks import AttentionBlocks, build_attention_tables
from megatron.context_parallel.attention.fused import fused_attention, stage_backward
from megatron.context_parallel.attention.runs import AttentionRuns
from megatron.context_parallel.attention.staging import StagedTables
from megatron.context_parallel.attention.tree_tables import TreeTables

SEQ = 2048
CPU = torch.device("cpu")


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
    # The host layout of the copy is done, every kernel call's tables in it: the layers only
    # copy.
    staged = built._derived.get("staged")
    assert staged is not None and not built._device
    assert len(staged.to(torch.device("cpu"))) == 1 + len(_calls(built)) + len(
        built.own.backward_split() or ()
    )
    runs = ContextParallelParams.for_plan(plan, None)
    worker = threading.Thread(target=runs.prepare)
    worker.start()
    worker.join()
    assert runs.runs._derived.get("staged") is not None and not runs.runs._device


def _same(a, b) -> bool:
    """Equal device tables: tensors (dtype and values), None, slices, lists and tuples of them,
    and the tensor fields of a ``DeviceRuns`` / ``DeviceBlocks`` / ``DeviceTreeTables``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if a is None or isinstance(a, slice):
        return a == b
    skip = ("runs", "group", "member")  # the host tables and the copy these came in
    fa = {n: v for n, v in vars(a).items() if not n.startswith("_") and n not in skip}
    fb = {n: v for n, v in vars(b).items() if not n.startswith("_") and n not in skip}
    return fa.keys() == fb.keys() and all(_same(fa[n], fb[n]) for n in fa)


def _calls(tables) -> list:
    if isinstance(tables, AttentionBlocks):
        return tables.calls()
    if isinstance(tables, TreeTables):
        return [tables.own, *tables.levels]
    return list(tables.backward_split() or ())


def _build(name):
    plan, tree, _ = CASES[name]
    if tree is not None:
        return TreeTables.build(plan, 0, tree)
    return build_attention_tables(plan, 0, torch.zeros(SEQ, dtype=torch.int64))


@pytest.mark.parametrize("name", ["runs", "blocks", "tree"])
def test_tables_staged_ahead_leave_the_layer_one_copy(monkeypatch, name):
    """``stage`` (run in a thread, as a data-loader's) does every host layout; ``on`` then only
    copies: with the host layout made to fail, it still gives the tables a fresh build gives,
    for the whole batch and the calls inside (the split backward's, the blocked layout's, the
    tree's own part and levels)."""
    staged = _build(name)

    worker = threading.Thread(target=staged.stage)
    worker.start()
    worker.join()

    def no_host_work(*args, **kwargs):
        raise AssertionError("host layout after staging")

    cpu = torch.device("cpu")
    with monkeypatch.context() as patched:
        patched.setattr(AttentionRuns, "_host_tables", no_host_work)
        patched.setattr(tree_tables, "_copy_rounds", no_host_work)
        patched.setattr(tree_tables, "_as_slice", no_host_work)
        mine = [staged.on(cpu)] + [c.on(cpu) for c in _calls(staged)]
    fresh = _build(name)
    theirs = [fresh.on(cpu)] + [c.on(cpu) for c in _calls(fresh)]
    assert len(mine) == len(theirs) > 1
    for a, b in zip(mine, theirs):
        assert _same(a, b)


def test_staged_tables_copy_every_table_once():
    """``StagedTables``: dicts of int64 tables (None kept, any shape) come back equal, the
    ``int32`` ones as int32, from one packed buffer."""
    g = torch.Generator().manual_seed(0)
    tables = [
        {"a": torch.randint(-5, 9, (7,), generator=g), "b": None, "n": torch.arange(3)},
        {"a": torch.randint(0, 9, (2, 3), generator=g), "n": torch.tensor([4, 5])},
        {"b": None},
    ]
    packed = StagedTables(tables, int32=("n",))
    assert packed.packed.numel() == 7 + 3 + 6 + 2
    out = packed.to(torch.device("cpu"))
    assert [list(t) for t in out] == [list(t) for t in tables]
    for mine, theirs in zip(out, tables):
        for name, value in theirs.items():
            if value is None:
                assert mine[name] is None
                continue
            assert mine[name].dtype == (torch.int32 if name == "n" else torch.int64)
            assert torch.equal(mine[name].long(), value)


@pytest.mark.parametrize("name", ["runs", "blocks", "tree"])
def test_the_backward_staged_ahead_leaves_it_one_copy(monkeypatch, name):
    """``stage_backward`` (in a thread, as ``prepare(heads=, head_dim=)`` runs it) cuts every
    backward call into its parts and windows and lays their tables out; the backward then only
    copies: with the host layout and the window cuts made to fail, a forward+backward gives
    exactly what it gives on a fresh build."""
    kernel, heads, dim = WindowedSplitSharedKeysReferenceKernel, 4, 8
    staged = _build(name)

    def stage_all():
        staged.stage()
        stage_backward(staged, heads, dim, kernel)

    worker = threading.Thread(target=stage_all)
    worker.start()
    worker.join()
    pieces, ahead = stage_backward(staged, heads, dim, kernel)
    assert len(pieces) >= 2 and ahead is not None

    g = torch.Generator().manual_seed(1)
    q = torch.randn(staged.rows, heads, dim, generator=g, dtype=torch.float64)
    kv = torch.randn(staged.slots, 2, 2 * dim, generator=g, dtype=torch.float64)
    grad = torch.randn(q.shape, generator=g, dtype=torch.float64)

    def run(tables):
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        out = fused_attention(qq, kk, tables, dim**-0.5, kernel=kernel)
        out.backward(grad)
        return out.detach(), qq.grad, kk.grad

    def no_host_work(*args, **kwargs):
        raise AssertionError("host layout after staging")

    with monkeypatch.context() as patched:
        patched.setattr(AttentionRuns, "_host_tables", no_host_work)
        patched.setattr(AttentionRuns, "_windows", no_host_work)
        patched.setattr(tree_tables, "_copy_rounds", no_host_work)
        mine = run(staged)
    assert all(CPU in p._device for p in pieces)
    for a, b in zip(mine, run(_build(name))):
        assert torch.equal(a, b)


def test_prepare_with_the_layer_shape_stages_the_backward():
    """``prepare(heads=, head_dim=)`` stages the default kernel's backward pieces once."""
    params = ContextParallelParams.for_plan(ContextParallelPlan.contiguous(SEQ, 1), None)
    params.prepare(heads=40, head_dim=128)
    first = stage_backward(params.runs, 40, 128)
    assert params.runs._derived[("backward", cudnn.KERNEL, 40, 128)] is first
    assert stage_backward(params.runs, 40, 128) is first


def test_staging_in_a_process_without_a_cuda_context_does_not_pin(monkeypatch):
    """A forked data-loader worker (or rank) of a process that used CUDA sees CUDA available but
    cannot start it: staging there must not ask for pinned memory (which starts CUDA; on this
    CPU build it raises), and the copy pins instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in CASES:
        tables = _build(name)
        assert not tables.stage().packed.is_pinned()
