"""The C++ builders of the attention tables (csrc/host/) against the torch-op reference.

``attention.runs`` and ``attention.blocks`` define every table by torch ops; the package
builds them in C++ where ``megatron.context_parallel._host`` is built (every install with torch,
CI included). Each test builds the same batch both ways and asks for equal tables: every
attribute, and every per-call device table, with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention.test_runs import PLAN_DRAWS, RUN_TABLE_DRAWS, _drawn_plan, _sequence
from megatron.context_parallel import ContextParallelPlan, _extension
from megatron.context_parallel.attention.blocks import (
    AttentionBlocks,
    _block_cost,
    _blocks_cost,
    _run_cost,
    _tile_cost,
    build_attention_tables,
)
from megatron.context_parallel.attention.runs import AttentionRuns, CompactKeys
from megatron.context_parallel.attention.staging import _GroupLayout

OPS = _extension.host_tables()


def test_the_builders_are_built():
    # A development or CI install builds them with the package (setup.py); without them every
    # comparison below would be skipped, so their absence fails here once.
    assert OPS is not None, f"megatron.context_parallel._host: {_extension._host_state}"


def _both(monkeypatch, build, *args, **kwargs):
    """``build(*args, **kwargs)`` with the C++ builders, then with the torch reference."""
    native = build(*args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(_extension, "host_tables", lambda: None)
        reference = build(*args, **kwargs)
    return native, reference


def _assert_same(a, b, where):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {a} != {b}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (AttentionRuns, AttentionBlocks)):
        _assert_same(_fields(a), _fields(b), where)
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"


def _key_fields(keys: CompactKeys) -> dict:
    return {f: getattr(keys, f) for f in _KEY_FIELDS}


_KEY_FIELDS = ("slots", "count", "of_position", "sequence", "sequence_start")


def _fields(tables):
    out = {k: v for k, v in vars(tables).items() if k not in ("_device", "plan")}
    if isinstance(tables, AttentionRuns):
        out["device"] = tables._host_tables()
    return out


@pytest.mark.skipif(OPS is None, reason="host builders not built")
@settings(max_examples=120, deadline=None)
@given(**RUN_TABLE_DRAWS)
def test_run_tables_equal_the_reference(
    seed, cp, seq_len, packed, unowned, merge_gap, longest_first
):
    plan, cu = _drawn_plan(seed, cp, seq_len, packed, unowned)
    _assert_runs_equal(plan, _sequence(seq_len, cu), merge_gap, longest_first)


def _assert_runs_equal(plan, sequence, merge_gap=64, longest_first=True):
    """Every rank's compact keys, run tables, run cost and chosen layout of ``plan``, built by
    the C++ builders and by the torch reference, are equal."""
    with pytest.MonkeyPatch.context() as mp:
        keys = _both(mp, CompactKeys, plan, sequence)
        _assert_same(*(_key_fields(k) for k in keys), "keys")
        for rank in range(plan.cp_size):
            padding = 1 if plan.counts[rank] == 0 else 0
            native, reference = _both(
                mp, AttentionRuns.build, plan, rank, sequence, padding_rows=padding,
                merge_gap=merge_gap, longest_first=longest_first,
            )  # fmt: skip
            _assert_same(native, reference, f"rank {rank}")
            costs = _both(mp, _run_cost, plan, rank, sequence, keys[0])
            assert costs[0] == costs[1], f"run cost, rank {rank}"
            chosen = _both(mp, build_attention_tables, plan, rank, sequence)
            _assert_same(chosen[0], chosen[1], f"chosen, rank {rank}")


# A plan for the blocked layout's comparisons (``_drawn_plan``): up to three ranks over up to 90
# positions, packed or not, some unowned.
BLOCK_PLAN_DRAWS = dict(
    PLAN_DRAWS,
    cp=st.integers(1, 3),
    seq_len=st.integers(1, 90),
    unowned=st.sampled_from([0.0, 0.2]),
)


@pytest.mark.skipif(OPS is None, reason="host builders not built")
@settings(max_examples=80, deadline=None)
@given(**RUN_TABLE_DRAWS, margin=st.sampled_from([0.5, 1.0, 1.1, 1.5]))
def test_backward_split_equals_the_reference(
    seed, cp, seq_len, packed, unowned, merge_gap, longest_first, margin
):
    # The split backward's prefix and diagonal calls (C++ split_tables) against the torch ops
    # that define them: every attribute, kernel sizes included, and every device table.
    plan, cu = _drawn_plan(seed, cp, seq_len, packed, unowned)
    sequence = _sequence(seq_len, cu)

    def split(rank):
        padding = 1 if plan.counts[rank] == 0 else 0
        runs = AttentionRuns.build(
            plan, rank, sequence, padding_rows=padding, merge_gap=merge_gap,
            longest_first=longest_first,
        )  # fmt: skip
        return runs.backward_split(margin)

    with pytest.MonkeyPatch.context() as mp:
        for rank in range(cp):
            native, reference = _both(mp, split, rank)
            assert (native is None) == (reference is None), f"rank {rank}"
            for part, (a, b) in enumerate(zip(native or (), reference or ())):
                _assert_same(a, b, f"rank {rank} part {part}")


@pytest.mark.skipif(OPS is None, reason="host builders not built")
@settings(max_examples=120, deadline=None)
@given(
    **BLOCK_PLAN_DRAWS,
    group_rows=st.sampled_from([1, 2, 3, 5, 128]),
    span_budget=st.sampled_from([None, 1, 7, 10**6]),
)
def test_block_tables_equal_the_reference(
    seed, cp, seq_len, packed, unowned, group_rows, span_budget
):
    plan, cu = _drawn_plan(seed, cp, seq_len, packed, unowned)
    sequence = _sequence(seq_len, cu)
    with pytest.MonkeyPatch.context() as mp:
        for rank in range(cp):
            if plan.counts[rank] == 0:
                continue
            native, reference = _both(
                mp, AttentionBlocks.build, plan, rank, sequence, group_rows=group_rows,
                span_budget=span_budget,
            )  # fmt: skip
            _assert_same(native, reference, f"rank {rank}")
            for i, (a, b) in enumerate(zip(native.calls(), reference.calls())):
                _assert_same(a._host_tables(), b._host_tables(), f"rank {rank} call {i}")
            # The per-entry tables of calls copied as one group (C++ group_tables), for these
            # calls and for a run call with its split.
            runs = AttentionRuns.build(plan, rank, sequence)
            for calls in (native.calls(), [runs, *(runs.backward_split(1.0) or ())]):
                for row_maps in (False, True):
                    layout = _GroupLayout(list(enumerate(calls)), row_maps)
                    tables = _both(mp, layout.host_tables)
                    _assert_same(*tables, f"rank {rank}, group of {len(calls)}, {row_maps}")


@pytest.mark.skipif(OPS is None, reason="host builders not built")
@pytest.mark.parametrize(
    "plan",
    [
        ContextParallelPlan.zigzag(4096, 2),
        ContextParallelPlan.contiguous(4096, 4),
        ContextParallelPlan.thd(torch.tensor([0, 512, 1536, 4096]), 2),
    ],
    ids=["zigzag", "contiguous", "thd"],
)
def test_named_plans_equal_the_reference(plan, monkeypatch):
    sequence = _sequence(plan.seq_len, plan.cu_seqlens)
    for rank in range(plan.cp_size):
        native, reference = _both(monkeypatch, AttentionRuns.build, plan, rank, sequence)
        _assert_same(native, reference, f"rank {rank}")


@pytest.mark.skipif(OPS is None, reason="host builders not built")
@settings(max_examples=80, deadline=None)
@given(ids=st.lists(st.integers(0, 4), max_size=60), ordered=st.booleans())
def test_sequence_starts_restart_at_every_change(ids, ordered):
    # Each position's sequence start: the first position of its run of equal ids, whether the
    # ids never decrease (galloping) or come in any order (a pass).
    ids = sorted(ids) if ordered else ids
    expected = [0] * len(ids)
    for k in range(1, len(ids)):
        expected[k] = k if ids[k] != ids[k - 1] else expected[k - 1]
    out = OPS.sequence_starts(torch.tensor(ids, dtype=torch.int64))
    assert out.tolist() == expected


@pytest.mark.skipif(OPS is None, reason="host builders not built")
def test_bad_inputs_raise_naming_the_table():
    source = torch.tensor([0, 1, -1, 2])
    with pytest.raises(RuntimeError, match="compact_keys: 4 positions but 3 sequence ids"):
        OPS.compact_keys(source, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="compact_keys: row_source: expected int64"):
        OPS.compact_keys(source.int(), torch.zeros(4, dtype=torch.int64))
    keys = OPS.compact_keys(source, torch.zeros(4, dtype=torch.int64))
    unowned = torch.tensor([1, 2])  # nobody owns position 2: it maps to position 1's key
    with pytest.raises(RuntimeError, match="rank_keys: local position 2 is not an owned position"):
        OPS.rank_keys(unowned, keys[1], keys[3])
    with pytest.raises(RuntimeError, match="rank_keys: position 4 out of range"):
        OPS.rank_keys(torch.tensor([0, 4]), keys[1], keys[3])
    # Every position owned: each position is its own key (empty of_position), 5 past the keys.
    with pytest.raises(RuntimeError, match="rank_keys: position 5 out of range"):
        OPS.rank_keys(torch.tensor([5]), torch.empty(0, dtype=torch.int64), keys[3])
    sorted_keys = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="run_tables: 2 rank keys for 3 local rows"):
        OPS.run_tables(torch.tensor([0, 1, 3]), keys[1], sorted_keys, torch.empty(0).long(),
                       keys[2], keys[3], 0, 64, True)  # fmt: skip
    with pytest.raises(RuntimeError, match="block_tables: 4 key slots for 3 keys"):
        OPS.block_tables(sorted_keys, torch.empty(0).long(), source, keys[3], 2, 8, 4, False)
    # Rank keys are checked before they index a table: ascending, within the keys, and local
    # rows within the rows.
    for bad in ([1, 0], [0, 3], [-1, 0]):
        with pytest.raises(RuntimeError, match="run_cost: rank keys: the sorted keys must ascend"):
            OPS.run_cost(torch.tensor(bad), keys[3], 64, 128)
        with pytest.raises(RuntimeError, match="block_cost: rank keys: the sorted keys must"):
            OPS.block_cost(torch.tensor(bad), keys[3], 2, 128)
    with pytest.raises(RuntimeError, match="block_tables: rank keys: a local row outside"):
        OPS.block_tables(sorted_keys, torch.tensor([0, 2]), keys[0], keys[3], 2, 8, 4, False)
    # Rows out of key order are read position by position, each checked.
    with pytest.raises(RuntimeError, match="run_tables: position 7 out of range"):
        OPS.run_tables(torch.tensor([7, 0]), keys[1], sorted_keys, torch.tensor([1, 0]),
                       keys[2], keys[3], 0, 64, True)  # fmt: skip


@pytest.mark.skipif(OPS is None, reason="host builders not built")
@settings(max_examples=60, deadline=None)
@given(
    entries=st.lists(st.tuples(st.integers(1, 700), st.integers(0, 900)), max_size=12),
    causal=st.booleans(),
    tile=st.sampled_from([1, 64, 128]),
)
def test_tile_cost_equals_the_reference(entries, causal, tile):
    q_len = torch.tensor([q for q, _ in entries], dtype=torch.int64)
    kv_len = q_len + torch.tensor([extra for _, extra in entries], dtype=torch.int64)
    with pytest.MonkeyPatch.context() as mp:
        native, reference = _both(mp, _tile_cost, q_len, kv_len, causal, tile)
    assert native == reference


# ``_dealt_blocks``' numbers: block sizes that cut runs far apart, at the 64-row merge gap
# exactly (63-row blocks between) and within packed sequences.
DEALT_BLOCK_DRAWS = dict(
    seed=st.integers(0, 2**16),
    cp=st.integers(1, 4),
    seq_len=st.integers(1, 3000),
    block=st.sampled_from([1, 17, 21, 63, 64, 200]),
    sequences=st.integers(1, 12),
    unowned=st.booleans(),
)


def _dealt_blocks(seed, cp, seq_len, block, sequences, unowned, ordered=False):
    """A plan of ``block``-position blocks dealt at random over ``cp`` ranks (and, with
    ``unowned``, nobody), each rank's positions shuffled (in position order with ``ordered``),
    over ``sequences`` packed sequences cut at random: ``(plan, sequence)``."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(1, seq_len, (sequences - 1,), generator=g) if seq_len > 1 else None
    cu = None if cuts is None else (0, *sorted(set(cuts.tolist())), seq_len)
    owner = torch.randint(0, cp + int(unowned), (-(-seq_len // block),), generator=g)
    owner = owner.repeat_interleave(block)[:seq_len]
    ranks = [torch.nonzero(owner == r).flatten() for r in range(cp)]
    if not ordered:
        ranks = [p[torch.randperm(p.numel(), generator=g)] for p in ranks]
    plan = ContextParallelPlan.from_rank_positions(ranks, seq_len, cu)
    return plan, _sequence(seq_len, cu)


@pytest.mark.skipif(OPS is None, reason="host builders not built")
@settings(max_examples=60, deadline=None)
@given(**DEALT_BLOCK_DRAWS, ordered=st.booleans(), merge_gap=st.sampled_from([1, 3, 64]))
def test_dealt_blocks_equal_the_reference(
    seed, cp, seq_len, block, sequences, unowned, ordered, merge_gap
):
    # Runs of positions cut anywhere, in position order (the C++ builders then read the keys
    # piece by piece, galloping over long runs of consecutive keys) or not.
    plan, sequence = _dealt_blocks(seed, cp, seq_len, block, sequences, unowned, ordered)
    _assert_runs_equal(plan, sequence, merge_gap)


@pytest.mark.skipif(OPS is None, reason="host builders not built")
@settings(max_examples=40, deadline=None)
@given(**DEALT_BLOCK_DRAWS)
def test_run_cost_reads_what_the_run_tables_hold(seed, cp, seq_len, block, sequences, unowned):
    # The layout choice's one pass (C++ run_cost) against the run tables themselves, built by
    # the torch reference: blocks of positions dealt at random over the ranks (and nobody), so
    # runs are cut far apart, at the 64-row merge gap exactly (63-row blocks between) and within
    # packed sequences.
    plan, sequence = _dealt_blocks(seed, cp, seq_len, block, sequences, unowned)
    keys = CompactKeys(plan, sequence)
    with pytest.MonkeyPatch.context() as mp:
        for rank in range(cp):
            if plan.counts[rank] == 0:
                continue
            mp.setattr(_extension, "host_tables", lambda: None)
            runs = AttentionRuns.build(plan, rank, sequence, keys=keys)
            expected = (_tile_cost(runs.q_len, runs.kv_len, True), runs.work)
            mp.undo()
            assert _run_cost(plan, rank, sequence, keys) == expected, f"rank {rank}"


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    cp=st.integers(1, 4),
    seq_len=st.integers(1, 3000),
    block=st.sampled_from([1, 17, 64, 200]),
    sequences=st.integers(1, 12),
    group_rows=st.sampled_from([1, 5, 128, 300]),
    native=st.booleans(),
)
def test_block_cost_reads_what_the_blocked_tables_hold(
    seed, cp, seq_len, block, sequences, group_rows, native
):
    # The layout choice reads the blocked layout's cost from its groups (C++ block_cost, or the
    # torch reference) instead of laying it out: the same number as the blocked tables' own
    # forward calls, built by the reference, on blocks of positions dealt at random.
    plan, sequence = _dealt_blocks(seed, cp, seq_len, block, sequences, False)
    keys = CompactKeys(plan, sequence)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_extension, "host_tables", lambda: None)
        for rank in range(cp):
            if plan.counts[rank] == 0:
                continue
            blocks = AttentionBlocks.build(plan, rank, sequence, group_rows=group_rows, keys=keys)
            expected = _blocks_cost(blocks)
            if native and OPS is not None:
                mp.undo()
            assert _block_cost(plan, rank, keys, group_rows) == expected, f"rank {rank}"
            mp.setattr(_extension, "host_tables", lambda: None)


def test_device_tables_are_the_host_tables_in_one_copy():
    # ``on`` moves every call's tables in one packed copy; the kernel's lengths arrive as
    # int32 [batch, 1, 1, 1], everything else as the host's int64 tables.
    plan, cu = _drawn_plan(7, 2, 300, True, 0.1)
    sequence = _sequence(plan.seq_len, cu)
    blocks = AttentionBlocks.build(plan, 0, sequence, group_rows=4, span_budget=40)
    runs = AttentionRuns.build(plan, 1, sequence)
    for call in blocks.calls() + [runs]:
        host, dev = call._host_tables(), call.on("cpu")
        for name, value in host.items():
            moved = getattr(dev, name)
            if value is None:
                assert moved is None, name
            elif name in ("seq_len_q", "seq_len_kv"):
                assert moved.dtype == torch.int32 and moved.shape == (call.batch, 1, 1, 1)
                assert torch.equal(moved.flatten().long(), value), name
            else:
                assert moved.dtype == torch.int64 and torch.equal(moved, value), name
    dev = blocks.on("cpu")
    assert len(blocks.levels) > 1 and len(blocks.diagonal) > 1
    # A level call's rows, made on the device: its entries' query rows, entry by entry.
    for call in blocks.levels:
        rows = [q + j for q, n in zip(call.q_start.tolist(), call.q_len.tolist()) for j in range(n)]
        assert call.on("cpu").entry_rows().tolist() == rows
    if blocks.has_bulk is not None:
        assert torch.equal(dev.has_bulk.flatten(), blocks.has_bulk)


def test_the_statistics_index_is_each_entrys_query_rows_padded():
    # The backward reads the forward's [rows, H] statistics padded to [batch, max_q] slots; the
    # index of those slots is made on the device from the entries' starts and lengths. Built
    # here entry by entry from the host tables, with padding entries and a max_q over the
    # longest entry (a shared kernel shape).
    plan, cu = _drawn_plan(11, 3, 400, True, 0.1)
    sequence = _sequence(plan.seq_len, cu)
    blocks = AttentionBlocks.build(plan, 0, sequence, group_rows=4, span_budget=40)
    for call in blocks.calls() + [AttentionRuns.build(plan, r, sequence) for r in range(3)]:
        for max_q in (call.max_q, 2 * call.max_q):
            expected = torch.full((call.batch, max_q), -1, dtype=torch.int64)
            for e in range(call.entries):
                start, rows = int(call.q_start[e]), int(call.q_len[e])
                expected[e, :rows] = torch.arange(start, start + rows)
            index = call.on("cpu").stats_index(max_q)
            assert torch.equal(index, expected.flatten()), call.describe()
