"""Staging: the row tables a copy's ``DeviceGroup`` derives for all of its calls at once are, call
by call, the tables each call derives alone (``DeviceRuns`` without a group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention.test_runs import WINDOW_DRAWS, _drawn_plan, _sequence
from megatron.context_parallel.attention.blocks import AttentionBlocks
from megatron.context_parallel.attention.runs import AttentionRuns, copy_calls
from megatron.context_parallel.attention.staging import StagedTables

CPU = torch.device("cpu")


def _plan(seed: int, cp: int, seq_len: int, packed: bool, unowned: float = 0.0):
    """``test_runs``' random plan (positions dealt at random, each rank's rows in a random
    order, three random sequence cuts when ``packed``) and its packed sequence per position."""
    plan, cu = _drawn_plan(seed, cp, seq_len, packed, unowned)
    return plan, _sequence(seq_len, cu)


def _pieces(call: AttentionRuns, max_rows: int):
    """A backward's calls: the call's split parts (every causal call split) and the windows of
    the call and of each part."""
    parts = list(call.backward_split(margin=1.0) or ())
    return parts + [w for c in [call, *parts] for w in c.backward_windows(max_rows)]


def _check(calls) -> int:
    """Each call's derived device tables against those it derives alone; returns how many
    came from a group (a copy of one call has none)."""
    grouped = 0
    for call in calls:
        dev = call.on(CPU)
        grouped += dev.group is not None
        alone = dataclasses.replace(dev, group=None, _offsets={})
        for which, stride in (("q_rows", 3), ("kv_rows", 5), ("mat_rows", 7), ("q_rows", 1)):
            mine, theirs = dev.offsets(which, stride), alone.offsets(which, stride)
            assert mine.shape == theirs.shape and torch.equal(mine, theirs), (which, stride)
        pairs = [
            (dev.stats_index(call.max_q), alone.stats_index(call.max_q)),
            (dev.entry_rows(), alone.entry_rows()),
        ]
        if call.materialize:
            pairs.append((dev.kv_source, alone.kv_source))
        else:
            assert dev.kv_source is None
        for mine, theirs in pairs:
            assert mine.dtype == theirs.dtype == torch.int64 and torch.equal(mine, theirs)
    return grouped


@settings(max_examples=40, deadline=None)
@given(
    **WINDOW_DRAWS,
    unowned=st.sampled_from([0.0, 0.2]),
    group_rows=st.sampled_from([1, 2, 4]),
)
def test_a_groups_row_tables_are_each_calls_own(
    seed, cp, seq_len, packed, max_rows, unowned, group_rows
):
    """The run tables' call and its split parts (one copy, ``on``), the blocked layout's calls
    (one copy), and every backward part and window of either (``copy_calls``, one copy more):
    offsets at several strides, the statistics index, entry rows and key sources."""
    plan, sequence = _plan(seed, cp, seq_len, packed, unowned)
    for rank in range(cp):
        runs = AttentionRuns.build(plan, rank, sequence, merge_gap=1)
        runs.on(CPU)
        split = list(runs.backward_split() or ())
        _check([runs, *split])
        pieces = [p for c in [runs, *split] for p in _pieces(c, max_rows)]
        copy_calls(pieces, CPU)
        _check(pieces)
        if plan.counts[rank] == 0:
            continue
        blocks = AttentionBlocks.build(plan, rank, sequence, group_rows=group_rows)
        blocks.on(CPU)
        _check(blocks.calls())
        pieces = [p for c in blocks.calls() for p in _pieces(c, max_rows)]
        copy_calls(pieces, CPU)
        _check(pieces)


def test_copy_calls_copies_only_the_calls_not_on_the_device():
    """A call already on the device keeps its tables; the others come in one copy."""
    plan, sequence = _plan(3, 2, 64, True)
    runs = AttentionRuns.build(plan, 0, sequence, merge_gap=1)
    first = runs.on(CPU)
    windows = runs.backward_windows(8)
    assert len(windows) > 2
    copy_calls([runs, *windows, windows[0]], CPU)
    assert runs.on(CPU) is first
    groups = {id(w.on(CPU).group) for w in windows}
    assert len(groups) == 1 and None not in {w.on(CPU).group for w in windows}
    assert first.group is None or id(first.group) not in groups
    assert _check(windows) == len(windows)
    # A copy of one call derives its own tables: no group.
    alone = AttentionRuns.build(plan, 1, sequence, merge_gap=1)
    if not alone.backward_split():
        assert alone.on(CPU).group is None


def test_staged_calls_must_hold_the_per_entry_tables():
    """A dict outside the calls holding a per-entry table (or a call's dict lacking one) would
    shift every later call's region: refused."""
    plan, sequence = _plan(5, 2, 40, True)
    runs = [AttentionRuns.build(plan, r, sequence, merge_gap=1) for r in range(2)]
    call = [r._host_tables(call_only=True) for r in runs]
    stray = {"q_rows": torch.arange(3)}
    with pytest.raises(ValueError, match="per-entry tables"):
        StagedTables([stray, *call], calls=[None, *runs])
    partial = {k: v for k, v in call[0].items() if k != "kv_rows"}
    with pytest.raises(ValueError, match="per-entry tables"):
        StagedTables([partial, call[1]], calls=runs)
    StagedTables([{"other": torch.arange(2)}, *call], calls=[None, *runs])  # accepted
