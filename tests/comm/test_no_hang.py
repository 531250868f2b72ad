"""Bad input never strands a rank: the matrix of README "Errors" on gloo ranks.

Each bad-input kind the README lists x which rank has it (the first, the last, all) x the first
call of a plan vs a later call x CP 2, 3, 4. In every case every rank must raise the same
``ValueError`` within the call, and then the ranks must still be in step: a good call right
after returns the right rows on every rank. A hang fails the case through the pool's hard
timeout instead of hanging the suite.

Plus the check that bookkeeping collectives follow the group's backend, not the input: with
the backend reported as NCCL, every collective a malformed call issues is on the CUDA device.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from _dist import DistributedPool

from megatron.context_parallel import (
    ContextParallelPlan,
    compute_forward_output,
    gather_from_context_parallel_region,
    scatter_to_context_parallel_region,
)

H, V = 4, 12

# kind -> (what the call is, the message every rank must raise)
KINDS = {
    "rows": ("gather", r"field 0 has \d+ rows along seq_dim but the plan gives CP rank"),
    "dtype": ("gather", r"different structure, dtypes or trailing shapes"),
    "trailing_shape": ("gather", r"different structure, dtypes or trailing shapes"),
    "field_structure": ("gather", r"different structure, dtypes or trailing shapes"),
    "seq_dim": ("gather", r"seq_dim 2 is out of range for field 0 with 2 dims"),
    "not_a_tensor": ("gather", r"field 1 is not a tensor"),
    "devices": ("gather", r"fields are on different devices: field 0 and field 1"),
    "plan": ("gather", r"ranks of the group use different plans"),
    "group_size": ("gather", r"the process group has \d ranks but the plan has cp_size"),
    "no_fields": ("gather", r"the structure holds no tensors"),
    "scatter_rows": ("scatter", r"the full tensor has \d+ rows along seq_dim but the plan's"),
    "head_rows": ("head", r"CP rank \d has \d+ hidden rows but the plan gives it"),
    "head_labels": ("head", r"labels must be \[seq_len\] = \[10\] in source order, got 9"),
    "head_top_k": ("head", rf"top_k must be an int in \[1, {V}\] \(the vocabulary\), got 13"),
    "head_field": ("head", r"unknown output field"),
}
WHO = ("first", "last", "all")


def _plan(world: int) -> ContextParallelPlan:
    """Uneven shards of 10 positions, the middle rank of CP 3 and 4 empty."""
    order = [7, 2, 9, 0, 4, 1, 8, 3, 6, 5]
    sizes = {2: [6, 4], 3: [6, 0, 4], 4: [5, 0, 3, 2]}[world]
    ranks, start = [], 0
    for n in sizes:
        ranks.append(order[start : start + n])
        start += n
    return ContextParallelPlan.from_rank_positions(ranks, seq_len=10)


def _full(seed: int, trailing=(H,), dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((10,) + trailing, generator=g).to(dtype)


_SINGLE: dict = {}


def _my_single_group(rank: int, world: int):
    """A one-rank group of this process (the head's TP group), made once per pool worker."""
    if world not in _SINGLE:
        _SINGLE[world] = [dist.new_group([r]) for r in range(world)][rank]
    return _SINGLE[world]


def _call(kind: str, rank: int, world: int, plan: ContextParallelPlan, bad: bool, device: str):
    """Makes the call of ``kind`` on ``device`` tensors, with this rank's input bad or good."""
    group = dist.group.WORLD
    full = _full(0).to(device)
    local = full[plan.local_positions(rank)]
    what = KINDS[kind][0]
    if what == "gather":
        fields = {"a": local, "b": _full(1, (), torch.int64).to(device)[plan.local_positions(rank)]}
        seq_dim = 0
        if bad:
            if kind == "rows":
                fields["a"] = torch.cat([local, local[:1] if len(local) else full[:1]])
            elif kind == "dtype":
                # Rank-dependent, so "all" means all ranks differ from one another.
                fields["a"] = local.to([torch.float64, torch.bfloat16, torch.int32][rank % 3])
            elif kind == "trailing_shape":
                fields["a"] = local.reshape(len(local), 2, H // 2) if rank % 2 else local[:, :2]
            elif kind == "field_structure":
                fields = {f"x{i}": local for i in range(rank + 3)}
            elif kind == "seq_dim":
                seq_dim = 2
                fields = {"a": local, "b": local}
            elif kind == "not_a_tensor":
                fields["b"] = local.tolist()
            elif kind == "devices":
                fields["b"] = torch.zeros(len(local), device="meta")
            elif kind == "plan":
                # Same shard sizes, positions rotated by a rank-dependent step: only the
                # fingerprint tells the plans apart (and with "all", every rank's differs).
                order = torch.cat([plan.local_positions(r) for r in range(world)])
                order = order.roll(rank + 1)
                shards = order.split(list(plan.counts))
                plan = ContextParallelPlan.from_rank_positions(list(shards), seq_len=10)
                fields["a"] = full[plan.local_positions(rank)]
            elif kind == "group_size":
                plan = ContextParallelPlan.contiguous(10, world + 1 + rank)
            elif kind == "no_fields":
                fields = {}
        return gather_from_context_parallel_region(fields, plan, group, seq_dim=seq_dim)
    if what == "scatter":
        return scatter_to_context_parallel_region(full[:-1] if bad else full, plan, group)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(V, H, generator=g).to(device)
    labels = torch.randint(0, V, (10,), generator=g).to(device)
    options = dict(fields=("target_logprobs", "top_k"), top_k=3)
    hidden = local
    if bad:
        if kind == "head_rows":
            hidden = torch.cat([local, full[:1]])
        elif kind == "head_labels":
            labels = labels[:-1]
        elif kind == "head_top_k":
            options["top_k"] = V + 1
        elif kind == "head_field":
            options["fields"] = ("target_logprobs", "logprobs")
    return compute_forward_output(
        hidden,
        weight,
        plan,
        labels=labels,
        cp_group=group,
        tp_group=_my_single_group(rank, world),
        **options,
    )


def _w_case(rank, world, kind, who, later, device):
    plan = _plan(world)
    bad_ranks = {"first": {0}, "last": {world - 1}, "all": set(range(world))}[who]
    if later:
        _call(kind, rank, world, plan, False, device)
    error = None
    try:
        _call(kind, rank, world, plan, rank in bad_ranks, device)
    except ValueError as exc:
        error = (type(exc).__name__, str(exc))
    # Still in step: a good gather right after returns every row on every rank.
    full = _full(5).to(device)
    out = gather_from_context_parallel_region(
        full[plan.local_positions(rank)], plan, dist.group.WORLD
    )
    assert torch.equal(out, full)
    return error


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(size, device="cpu"):
        if (size, device) not in made:
            # A hard per-case timeout: a rank left waiting fails its case in seconds. CUDA ranks
            # are spawned: a parent that asked whether CUDA exists cannot fork CUDA users.
            method = "spawn" if device == "cuda" else "fork"
            made[size, device] = DistributedPool(size, timeout=60, start_method=method)
        return made[size, device]

    yield get
    for pool in made.values():
        pool.close()


# CUDA tensors over gloo (ranks share one GPU) where there is one: the GPU machine runs both.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_bad_input_raises_on_every_rank(pools, world, kind, device):
    pattern = KINDS[kind][1]
    for who in WHO:
        for later in (False, True):
            errors = pools(world, device).run(_w_case, kind, who, later, device)
            case = (kind, who, "later" if later else "first", world, device)
            for rank, error in enumerate(errors):
                assert error is not None, f"rank {rank} did not raise: {case}"
                assert error[0] in ("InputError", "InputTypeError"), (case, rank, error)
                assert re.search(pattern, error[1]), (case, rank, error)
            # The same message everywhere (a rank may add a note on its own problem).
            texts = {re.sub(r" \(.*\)$", "", e[1]) for e in errors}
            assert len(texts) == 1, (case, errors)


class _Stop(Exception):
    """Raised by the spy once it has seen a collective: nothing may run on the fake device."""


def _w_bookkeeping_device(rank, world):
    """Backend reported as NCCL: a malformed call's collectives use the group's CUDA device.

    The spy lets the real ``collective_device`` pick the device (``cuda:0`` for NCCL), records
    it, and hands out ``meta`` in its place (this CPU build has no CUDA); every collective the
    call then issues must carry ``meta`` tensors, i.e. tensors on the device chosen from the
    backend. A call that picks a device from its (bad) input would issue CPU tensors.
    """
    from megatron.context_parallel.comm import groups

    real_backend, real_current = dist.get_backend, torch.cuda.current_device
    real_device, real_gather = groups.collective_device, groups.all_gather_into
    chosen, issued = [], []

    def device(group):
        chosen.append(real_device(group))
        return torch.device("meta")

    def gather(output, input, group):
        issued.append((output.device.type, input.device.type))
        raise _Stop

    dist.get_backend = lambda group=None: "nccl"
    torch.cuda.current_device = lambda: 0
    groups.collective_device, groups.all_gather_into = device, gather
    plan = _plan(world)
    local = _full(0)[plan.local_positions(rank)]
    group = dist.group.WORLD
    try:
        bad_calls = [
            lambda: gather_from_context_parallel_region({"a": local, "b": [1]}, plan, group),
            lambda: gather_from_context_parallel_region(local, plan, group, seq_dim=3),
            lambda: gather_from_context_parallel_region(local[:-1], plan, group),
            # CPU tensors on an NCCL group: a problem too, found before any data moves.
            lambda: gather_from_context_parallel_region(local, plan, group),
            lambda: scatter_to_context_parallel_region(local, plan, group),
        ]
        for call in bad_calls:
            chosen.clear()
            issued.clear()
            with pytest.raises(_Stop):
                call()
            assert chosen and all(d == torch.device("cuda", 0) for d in chosen), chosen
            assert issued == [("meta", "meta")], issued
    finally:
        dist.get_backend, torch.cuda.current_device = real_backend, real_current
        groups.collective_device, groups.all_gather_into = real_device, real_gather


def test_bookkeeping_collectives_follow_the_backend(pools):
    pools(2).run(_w_bookkeeping_device)


def _w_reduce(rank, world):
    """``reduce_over_data_parallel`` with one rank's input bad: every rank raises the same
    error before any reduction, and a good call right after still sums."""
    from megatron.context_parallel import reduce_over_data_parallel

    group = dist.group.WORLD
    bad = rank == world - 1
    good = torch.tensor([1.0, 2.0])
    calls = {
        "not_a_tensor": [1.0, 2.0] if bad else good,
        "shape": torch.ones(3) if bad else good,
        "dtype": good.double() if bad else good,
        "op": (good, dist.ReduceOp.MAX if bad else dist.ReduceOp.SUM),
    }
    seen = {}
    for name, call in calls.items():
        tensor, op = call if isinstance(call, tuple) else (call, dist.ReduceOp.SUM)
        try:
            reduce_over_data_parallel(tensor, op, group)
            seen[name] = None
        except ValueError as exc:
            seen[name] = (type(exc).__name__, str(exc))
    assert torch.equal(reduce_over_data_parallel(good, group=group), good * world)
    return seen


def test_reduce_over_data_parallel_raises_on_every_rank(pools):
    per_rank = pools(3).run(_w_reduce)
    assert per_rank[0] == per_rank[1] == per_rank[2], per_rank
    seen = per_rank[0]
    assert seen["not_a_tensor"] == ("InputTypeError", "rank 2: field 0 is not a tensor (got list)")
    for name in ("shape", "dtype", "op"):
        assert seen[name] is not None and seen[name][0] == "InputError", (name, seen)
        assert "ranks of the group made different calls" in seen[name][1], (name, seen)
