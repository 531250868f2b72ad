"""gather / scatter / reduce mappings on gloo ranks, against references built without them.

The reference for a gather is the full tensor itself: every rank's shard is cut out of a
full tensor with plain advanced indexing, so the expected output is that full tensor with
the rows no rank owns set to zero.
"""

import pytest
import torch
import torch.distributed as dist
from _dist import DistributedPool, WorkerError
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core import parallel_state  # noqa: F401  (imported once, before workers fork)

from megatron.context_parallel import (
    ContextParallelPlan,
    gather_from_context_parallel_region,
    reduce_over_data_parallel,
    scatter_to_context_parallel_region,
)

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int64,
    torch.bool,
    torch.int32,
    torch.uint8,
    torch.complex64,
]


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(size):
        if size not in made:
            made[size] = DistributedPool(size)
        return made[size]

    yield get
    for pool in made.values():
        pool.close()


def _full_tensor(seq_len, trailing, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn((seq_len,) + tuple(trailing), generator=g, dtype=torch.float64) * 50
    if dtype == torch.bool:
        return values > 0
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    if not dtype.is_floating_point:
        return values.to(torch.int64).to(dtype)
    return values.to(dtype)


def _expected(full, plan, seq_dim=0):
    out = full.clone()
    mask = ~plan.owned_mask()
    index = [slice(None)] * full.dim()
    index[seq_dim] = mask
    out[tuple(index)] = 0
    return out


def _shard(full, plan, rank, seq_dim=0):
    index = [slice(None)] * full.dim()
    index[seq_dim] = plan.local_positions(rank)
    return full[tuple(index)].clone()


# ------------------------------------------------------------------------------ workers


def _w_gather_fields(rank, world, plan, specs, seq_dim, noncontiguous):
    """Gathers a dict of fields; asserts each equals the reference exactly, dtype included."""
    fields, expected = {}, {}
    for name, (trailing, dtype, seed) in specs.items():
        full = _full_tensor(plan.seq_len, trailing, dtype, seed)
        if seq_dim == 1:
            full = full.unsqueeze(0).expand(2, *full.shape).clone()
            full[1] = full[1].flip(0) if full.shape[1] else full[1]
        local = _shard(full, plan, rank, seq_dim)
        if noncontiguous:
            # Same values, transposed storage: exercises the strided packing path.
            local = local.transpose(0, -1).contiguous().transpose(0, -1)
            assert local.dim() < 2 or not local.is_contiguous() or local.numel() <= 1
        fields[name] = local
        expected[name] = _expected(full, plan, seq_dim)
    out = gather_from_context_parallel_region(fields, plan, dist.group.WORLD, seq_dim=seq_dim)
    assert isinstance(out, dict) and list(out) == list(fields)
    for k in fields:
        assert out[k].dtype == expected[k].dtype, (plan, seq_dim, k)
        assert torch.equal(out[k], expected[k]), (plan, seq_dim, noncontiguous, k)


def _w_structures_and_count(rank, world, plan):
    """Tuple/list/tensor structures; every gather = one exchange + one data all-gather."""
    from megatron.context_parallel.comm import groups

    calls = []
    real = {n: getattr(groups, n) for n in ("all_gather_into", "reduce_scatter_into", "all_reduce")}

    def counting(name):
        def call(output, *args, **kwargs):
            calls.append((name, output.dtype))
            return real[name](output, *args, **kwargs)

        return call

    group = dist.group.WORLD
    a = _full_tensor(plan.seq_len, (3,), torch.float32, 1)
    b = _full_tensor(plan.seq_len, (), torch.int64, 2)
    c = _full_tensor(plan.seq_len, (2, 5), torch.bfloat16, 3)
    d = _full_tensor(plan.seq_len, (7,), torch.bool, 4)
    e = _full_tensor(plan.seq_len, (), torch.float64, 5)
    for n in real:
        setattr(groups, n, counting(n))
    try:
        first = gather_from_context_parallel_region(_shard(a, plan, rank), plan, group)
        tup = gather_from_context_parallel_region(
            (_shard(b, plan, rank), _shard(c, plan, rank)), plan, group
        )
        lst = gather_from_context_parallel_region(
            [_shard(d, plan, rank), _shard(e, plan, rank), _shard(a, plan, rank)], plan, group
        )
        mixed = gather_from_context_parallel_region(
            {k: _shard(v, plan, rank) for k, v in dict(a=a, b=b, c=c, d=d, e=e).items()},
            plan,
            group,
        )
    finally:
        for n, fn in real.items():
            setattr(groups, n, fn)
    assert torch.equal(first, _expected(a, plan))
    assert isinstance(tup, tuple)
    assert torch.equal(tup[0], _expected(b, plan)) and torch.equal(tup[1], _expected(c, plan))
    assert isinstance(lst, list)
    assert torch.equal(lst[0], _expected(d, plan)) and torch.equal(lst[1], _expected(e, plan))
    for k, v in dict(a=a, b=b, c=c, d=d, e=e).items():
        assert torch.equal(mixed[k], _expected(v, plan))
    # Per gather: the int64 exchange of every rank's verdict, then ONE byte all-gather of all
    # fields; on every call, the first and the later ones alike.
    assert calls == [("all_gather_into", torch.int64), ("all_gather_into", torch.uint8)] * 4


def _w_backward(rank, world, plan, output_grad, seq_dim):
    """Gradients of weighted sums against the analytic answer."""
    group = dist.group.WORLD
    trailing = (3,)
    full = _full_tensor(plan.seq_len, trailing, torch.float64, 11)
    if seq_dim == 1:
        full = full.unsqueeze(0).repeat(2, 1, 1)
    local = _shard(full, plan, rank, seq_dim).requires_grad_()
    ints_full = _full_tensor(plan.seq_len, (), torch.int64, 3)
    if seq_dim == 1:
        ints_full = ints_full.unsqueeze(0).repeat(2, 1)
    ints = _shard(ints_full, plan, rank, seq_dim)
    out = gather_from_context_parallel_region(
        {"x": local, "i": ints},
        plan,
        group,
        seq_dim=seq_dim,
        context_parallel_output_grad=output_grad,
    )
    assert not out["i"].requires_grad
    # Rank-dependent weights when the consumers differ, shared weights otherwise.
    weights = [_full_tensor(plan.seq_len, trailing, torch.float64, 100 + r) for r in range(world)]
    if seq_dim == 1:
        weights = [w.unsqueeze(0).repeat(2, 1, 1) for w in weights]
    mine = weights[rank] if output_grad else weights[0]
    (out["x"] * mine).sum().backward()
    total = sum(weights) if output_grad else weights[0]
    expected = _shard(total, plan, rank, seq_dim)
    torch.testing.assert_close(local.grad, expected, rtol=1e-12, atol=1e-12)


def _w_scatter(rank, world, plan, seq_dim):
    group = dist.group.WORLD
    full = _full_tensor(plan.seq_len, (4,), torch.float64, 21)
    if seq_dim == 1:
        full = full.unsqueeze(0).repeat(3, 1, 1)
    full.requires_grad_()
    local = scatter_to_context_parallel_region(full, plan, group, seq_dim=seq_dim)
    same = torch.equal(local, _shard(full.detach(), plan, rank, seq_dim))
    weights = _full_tensor(plan.seq_len, (4,), torch.float64, 22)
    if seq_dim == 1:
        weights = weights.unsqueeze(0).repeat(3, 1, 1)
    (local * _shard(weights, plan, rank, seq_dim)).sum().backward()
    assert same
    # Every rank's own rows come back in the full gradient; unowned rows get nothing.
    assert torch.equal(full.grad, _expected(weights, plan, seq_dim))


def _w_from_local_positions(rank, world, ranks, seq_len):
    plan = ContextParallelPlan.from_local_positions(ranks[rank], dist.group.WORLD, seq_len)
    assert plan == ContextParallelPlan.from_rank_positions(ranks, seq_len)
    full = _full_tensor(plan.seq_len, (2,), torch.float32, 5)
    out = gather_from_context_parallel_region(_shard(full, plan, rank), plan, dist.group.WORLD)
    assert torch.equal(out, _expected(full, plan))


# ------------------------------------------------------------------------------ tests


def test_cp1_without_distributed():
    plan = ContextParallelPlan.from_rank_positions([[3, 0, 2]], seq_len=5)
    full = _full_tensor(5, (2,), torch.float32, 0)
    local = _shard(full, plan, 0).requires_grad_()
    out = gather_from_context_parallel_region(local, plan)
    assert torch.equal(out, _expected(full, plan))
    out.sum().backward()
    assert torch.equal(local.grad, torch.ones(3, 2))
    back = scatter_to_context_parallel_region(full, plan)
    assert torch.equal(back, local.detach())
    assert torch.equal(reduce_over_data_parallel(torch.tensor([2.0])), torch.tensor([2.0]))
    with pytest.raises(TypeError, match="field 0 is not a tensor"):
        reduce_over_data_parallel([2.0])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_constructor_every_dtype(pools, world):
    plans = [
        ContextParallelPlan.zigzag(8 * world, world),
        ContextParallelPlan.contiguous(4 * world + 1, world),
        ContextParallelPlan.contiguous(4 * world, world),
        ContextParallelPlan.thd([0, 2 * world, 2 * world, 8 * world], world),
        ContextParallelPlan.from_rank_positions(
            [[9, 1, 4]] + [[]] * (world - 2) + [[0, 7]], seq_len=12
        ),
    ]
    specs = {str(d): ((3,), d, i) for i, d in enumerate(DTYPES)}
    specs["vector"] = ((), torch.float32, 50)
    specs["wide"] = ((2, 9), torch.bfloat16, 51)
    specs["zero_width"] = ((0,), torch.float32, 52)
    for plan in plans:
        for seq_dim, nc in [(0, False), (0, True), (1, False), (1, True)]:
            pools(world).run(_w_gather_fields, plan, specs, seq_dim, nc)


def _w_no_reorder_on_source_ordered_slots(rank, world, plan):
    """Equal contiguous shards: the all-gather buffer is returned as is, no scatter_rows."""
    from megatron.context_parallel.comm import row_ops as ops

    real = ops.scatter_rows
    calls = []
    ops.scatter_rows = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        for dtype, trailing in [(torch.bfloat16, (5,)), (torch.float32, ()), (torch.bool, (3,))]:
            full = _full_tensor(plan.seq_len, trailing, dtype, 7)
            out = gather_from_context_parallel_region(
                _shard(full, plan, rank), plan, dist.group.WORLD
            )
            assert torch.equal(out, full), dtype
        assert not calls, "a source-ordered single field went through scatter_rows"
        # Two fields must be unpacked, so the reorder runs: the check above can fail.
        pair = (_shard(full, plan, rank), _shard(full, plan, rank))
        gather_from_context_parallel_region(pair, plan, dist.group.WORLD)
        assert calls
    finally:
        ops.scatter_rows = real


@pytest.mark.parametrize("world", [2, 3])
def test_single_field_on_source_ordered_slots_skips_the_reorder(pools, world):
    plan = ContextParallelPlan.contiguous(4 * world, world)
    assert plan.slots_in_source_order
    pools(world).run(_w_no_reorder_on_source_ordered_slots, plan)


@st.composite
def random_plans(draw, world):
    seq_len = draw(st.integers(0, 24))
    perm = draw(st.permutations(list(range(seq_len))))
    owned = draw(st.integers(0, seq_len))
    owner = draw(st.lists(st.integers(0, world - 1), min_size=owned, max_size=owned))
    ranks = [[p for p, o in zip(perm[:owned], owner) if o == r] for r in range(world)]
    return ContextParallelPlan.from_rank_positions(ranks, seq_len=seq_len)


@pytest.mark.parametrize("world", [2, 3])
def test_random_plans_property(pools, world):
    specs = {
        "h": ((5,), torch.bfloat16, 1),
        "lp": ((), torch.float32, 2),
        "tok": ((3,), torch.int64, 3),
        "m": ((), torch.bool, 4),
    }

    @settings(max_examples=25, deadline=None, database=None)
    @given(random_plans(world), st.sampled_from([0, 1]))
    def check(plan, seq_dim):
        pools(world).run(_w_gather_fields, plan, specs, seq_dim, False)

    check()


def test_one_exchange_and_one_data_collective_per_gather(pools):
    plan = ContextParallelPlan.from_rank_positions([[4, 0, 2], [5]], seq_len=7)
    pools(2).run(_w_structures_and_count, plan)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("output_grad", [False, True])
def test_backward_matches_analytic(pools, world, output_grad):
    plans = [
        ContextParallelPlan.zigzag(4 * world, world),
        ContextParallelPlan.from_rank_positions(
            [[]] + [[2 * r + 1, 2 * r] for r in range(world - 1)], seq_len=2 * world + 1
        ),
    ]
    for plan in plans:
        for seq_dim in (0, 1):
            pools(world).run(_w_backward, plan, output_grad, seq_dim)


def _w_output_grad_with_an_unused_field(rank, world, plan):
    """output_grad=True, a loss that leaves one field unused on some ranks only: no hang."""
    a = _full_tensor(plan.seq_len, (2,), torch.float64, 1)
    b = _full_tensor(plan.seq_len, (3,), torch.float64, 2)
    la = _shard(a, plan, rank).requires_grad_()
    lb = _shard(b, plan, rank).requires_grad_()
    out = gather_from_context_parallel_region(
        (la, lb), plan, dist.group.WORLD, context_parallel_output_grad=True
    )
    loss = out[0].sum() + (out[1].sum() if rank == 0 else 0.0)
    loss.backward()
    assert torch.equal(la.grad, torch.full_like(la, float(world)))
    assert torch.equal(lb.grad, torch.ones_like(lb))


def test_output_grad_when_a_rank_leaves_a_field_unused(pools):
    plan = ContextParallelPlan.zigzag(12, 3)
    pools(3).run(_w_output_grad_with_an_unused_field, plan)


@pytest.mark.parametrize("world", [2, 4])
def test_scatter_and_its_backward(pools, world):
    plans = [
        ContextParallelPlan.zigzag(4 * world, world),
        ContextParallelPlan.from_rank_positions([[5, 1]] + [[]] * (world - 2) + [[0]], 7),
    ]
    for plan in plans:
        for seq_dim in (0, 1):
            pools(world).run(_w_scatter, plan, seq_dim)


def test_from_local_positions_builds_the_same_plan(pools):
    ranks = [[6, 2], [], [0, 1, 5]]
    pools(3).run(_w_from_local_positions, ranks, None)
    pools(3).run(_w_from_local_positions, ranks, 9)


def _w_verify(rank, world):
    plan = ContextParallelPlan.zigzag(8, world)
    assert plan.verify(dist.group.WORLD) is plan
    assert plan.verify(dist.group.WORLD) is plan  # stateless: again, the same
    other = ContextParallelPlan.contiguous(8, world) if rank == 1 else plan
    with pytest.raises(ValueError, match="ranks of the group use different plans"):
        other.verify(dist.group.WORLD)
    wrong = ContextParallelPlan.zigzag(12, world + 1) if rank == 0 else plan
    with pytest.raises(ValueError, match="rank 0: the process group has 2 ranks but the plan"):
        wrong.verify(dist.group.WORLD)


def test_plan_verify_is_an_explicit_collective(pools):
    pools(2).run(_w_verify)


def test_pool_reports_worker_failures(pools):
    with pytest.raises(WorkerError, match="rank 1"):
        pools(2).run(_w_fail_on_rank_one)


def _w_fail_on_rank_one(rank, world):
    if rank == 1:
        raise RuntimeError("boom")
    return rank


def _w_parallel_state_grid(rank, world):
    """DP2 x CP2 through megatron-core: default groups and the DP-only reduction."""
    from megatron.core import parallel_state as ps

    # parallel_state needs no CUDA shim here: its groups follow the gloo default backend.
    ps.initialize_model_parallel(context_parallel_size=2)
    try:
        cp_rank = ps.get_context_parallel_rank()
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=False)
        plan = ContextParallelPlan.zigzag(8, 2)
        # Each DP replica has its own batch; both CP ranks of a replica share it.
        full = _full_tensor(8, (2,), torch.float32, 10 + dp_rank)
        out = gather_from_context_parallel_region(_shard(full, plan, cp_rank), plan)
        gathered_ok = torch.equal(out, full)
        local = scatter_to_context_parallel_region(full, plan)
        scattered_ok = torch.equal(local, _shard(full, plan, cp_rank))
        loss = out.double().sum()
        summed = reduce_over_data_parallel(loss)
        expected = sum(
            _full_tensor(8, (2,), torch.float32, 10 + d).double().sum() for d in range(2)
        )
        dp_ok = torch.allclose(summed, expected)
        maxed = reduce_over_data_parallel(torch.tensor([float(dp_rank)]), dist.ReduceOp.MAX)
    finally:
        ps.destroy_model_parallel()
    return gathered_ok, scattered_ok, dp_ok, float(maxed), cp_rank, dp_rank


def test_parallel_state_default_groups(pools):
    results = pools(4).run(_w_parallel_state_grid)
    assert {(r[4], r[5]) for r in results} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for gathered_ok, scattered_ok, dp_ok, maxed, _, _ in results:
        assert gathered_ok and scattered_ok and dp_ok and maxed == 1.0
