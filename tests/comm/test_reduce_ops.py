"""``reduce_over_data_parallel`` applies the ``op`` it is given, over the group it is given.

The other tests of it reduce values for which SUM and MAX agree (or only ever SUM), so an
implementation that ignored ``op`` passed them. Here every rank holds different values with
mixed signs, chosen so that SUM, PRODUCT, MIN, MAX (and the bitwise ops on integers) all give
different answers, and each result is compared exactly with the reduction computed here.
"""

from __future__ import annotations

import functools
import operator

import pytest
import torch
import torch.distributed as dist
from _dist import DistributedPool

from megatron.context_parallel import reduce_over_data_parallel

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    made = DistributedPool(WORLD)
    yield made
    made.close()


def _float_values(rank: int) -> torch.Tensor:
    # Per element, the ranks' values differ in sign and size: for every element the sum, the
    # product, the minimum and the maximum are four different numbers (checked below).
    table = torch.tensor(
        [
            [3.0, -2.0, 0.5, 7.0],
            [-1.0, 4.0, 1.5, 2.0],
            [2.0, 5.0, -0.25, 3.0],
            [6.0, -3.0, 2.0, -1.0],
        ]
    )
    return table[:, rank]


def _int_values(rank: int) -> torch.Tensor:
    table = torch.tensor([[12, 5, 9, 6], [10, 3, 14, 7], [7, 11, 6, 13]], dtype=torch.int64)
    return table[:, rank]


def _expected(values, op):
    stack = torch.stack(values)
    if op == dist.ReduceOp.SUM:
        return stack.sum(0)
    if op == dist.ReduceOp.PRODUCT:
        return stack.prod(0)
    if op == dist.ReduceOp.MIN:
        return stack.min(0).values
    if op == dist.ReduceOp.MAX:
        return stack.max(0).values
    combine = {
        dist.ReduceOp.BAND: operator.and_,
        dist.ReduceOp.BOR: operator.or_,
        dist.ReduceOp.BXOR: operator.xor,
    }[op]
    return functools.reduce(combine, values)


FLOAT_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX)
INT_OPS = FLOAT_OPS + (dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR)


def test_the_chosen_values_tell_every_op_apart():
    for values, ops in (
        ([_float_values(r) for r in range(WORLD)], FLOAT_OPS),
        ([_int_values(r) for r in range(WORLD)], INT_OPS),
    ):
        results = [_expected(values, op) for op in ops]
        for i in range(len(ops)):
            for j in range(i + 1, len(ops)):
                # Every element differs between any two ops, so no op can stand in for another.
                assert torch.all(results[i] != results[j]), (ops[i], ops[j], results)


def _w_each_op(rank, world):
    group = dist.group.WORLD
    out = {}
    for kind, make, ops in (("float", _float_values, FLOAT_OPS), ("int", _int_values, INT_OPS)):
        for op in ops:
            tensor = make(rank)
            before = tensor.clone()
            got = reduce_over_data_parallel(tensor, op, group)
            assert torch.equal(tensor, before), "the input was modified"
            assert got.data_ptr() != tensor.data_ptr()
            out[(kind, str(op))] = got
    # The default op is SUM.
    out["default"] = reduce_over_data_parallel(_float_values(rank), group=group)
    return out


def test_each_op_is_applied(pool):
    per_rank = pool.run(_w_each_op)
    for kind, make, ops in (("float", _float_values, FLOAT_OPS), ("int", _int_values, INT_OPS)):
        values = [make(r) for r in range(WORLD)]
        for op in ops:
            want = _expected(values, op)
            for rank, got in enumerate(per_rank):
                assert got[(kind, str(op))].dtype == want.dtype
                assert torch.equal(got[(kind, str(op))], want), (kind, op, rank, got, want)
    want_sum = _expected([_float_values(r) for r in range(WORLD)], dist.ReduceOp.SUM)
    for got in per_rank:
        assert torch.equal(got["default"], want_sum)


def _grid_value(cp_rank: int, dp_rank: int) -> torch.Tensor:
    # Differs along CP too, so a reduction over all ranks (or over CP) gives other numbers.
    return torch.tensor([10.0 * dp_rank + cp_rank + 1.0, -(3.0**dp_rank) - cp_rank])


def _w_data_parallel_subgroup(rank, world):
    # A DP 2 x CP 2 grid as megatron lays it out (CP innermost): the pure DP groups are the
    # ranks with one CP rank, {0, 2} and {1, 3}. Every rank creates every group, in one order.
    cp_rank, dp_rank = rank % 2, rank // 2
    dp_groups = [dist.new_group([c, c + 2]) for c in range(2)]
    mine = _grid_value(cp_rank, dp_rank)
    got = {str(op): reduce_over_data_parallel(mine, op, dp_groups[cp_rank]) for op in FLOAT_OPS}
    return cp_rank, dp_rank, got


def test_data_parallel_subgroup_and_op(pool):
    """Over a subgroup the op applies to that group's ranks only (megatron-core's default pure
    DP group is resolved in tests/comm/test_mappings.py::test_parallel_state_default_groups)."""
    results = pool.run(_w_data_parallel_subgroup)
    assert {(cp, dp) for cp, dp, _ in results} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    for cp_rank, _, got in results:
        peers = [_grid_value(cp_rank, d) for d in range(2)]
        everyone = [_grid_value(c, d) for c in range(2) for d in range(2)]
        for op in FLOAT_OPS:
            want = _expected(peers, op)
            assert not torch.equal(want, _expected(everyone, op))
            assert torch.equal(got[str(op)], want), (cp_rank, op, got)
