"""Rotary rows at source positions, and when megatron-core's own rotary table is exact.

``rotary_at_positions`` must give, bit for bit, the rows of megatron-core's table for every
option of ``RotaryEmbedding`` that changes them; ``megatron_table_positions`` must name exactly
the rows megatron-core's CP slice hands each rank (checked against its own
``get_pos_emb_on_this_cp_rank``, in a forked worker because it needs the CPU shims).
"""

from __future__ import annotations

import _megatron_cpu as mc
import pytest
import torch
from _dist import run_distributed

from megatron.context_parallel.attention.rotary import (
    megatron_rotary_is_exact,
    megatron_table_positions,
    rotary_at_positions,
    rotary_table_length,
    skip_marked_tables,
    skip_table_length,
)
from megatron.context_parallel.comm.plan import ContextParallelPlan


def _rope(**kwargs):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=16, use_cpu_initialization=True, **kwargs)


def _table(rope, length):
    """megatron-core's table ``rope.get_emb(length)`` without its move to a CUDA device."""
    freqs = rope.get_freqs_non_repeated(length)
    if rope.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(length, -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


@pytest.mark.parametrize(
    "options",
    [
        dict(rotary_percent=1.0),
        dict(rotary_percent=0.5, rotary_interleaved=True),
        dict(rotary_percent=1.0, seq_len_interpolation_factor=4.0),
        dict(rotary_percent=1.0, rope_scaling=True, rotary_base=500000),
    ],
)
def test_rows_at_positions_equal_megatron_table_rows(options):
    rope = _rope(**options)
    positions = torch.randint(0, 300, (97,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(rotary_at_positions(rope, positions), _table(rope, 300)[positions])


def _megatron_slices(rank, world_size):
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    mc.cpu_current_device()

    class _Group:  # what get_pos_emb_on_this_cp_rank reads of a CP group
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    ok = []
    for cp in (2, 3, 4):
        length = 8 * cp
        table = torch.arange(length, dtype=torch.float32)[:, None, None, None]
        for r in range(cp):
            sliced = get_pos_emb_on_this_cp_rank(table, 0, _Group(cp, r))
            ok.append(torch.equal(sliced.flatten().long(), megatron_table_positions(length, cp, r)))
    return ok


def test_table_positions_are_megatron_cp_slices():
    (ok,) = run_distributed(_megatron_slices, 1)
    assert ok and all(ok)


def test_table_length_and_exactness():
    assert rotary_table_length(24, 2) == 24
    assert rotary_table_length(27, 2) == 28
    assert rotary_table_length(0, 3) == 6
    assert megatron_table_positions(26, 2, 0) is None  # megatron cannot slice it
    positions = torch.arange(24)
    assert megatron_rotary_is_exact(ContextParallelPlan.zigzag(24, 2), positions, 24)
    assert megatron_rotary_is_exact(ContextParallelPlan.contiguous(24, 1), positions, 24)
    # Right rows, other position ids; other layouts; a table of another length.
    assert not megatron_rotary_is_exact(ContextParallelPlan.zigzag(24, 2), positions + 1, 24)
    assert not megatron_rotary_is_exact(ContextParallelPlan.contiguous(24, 2), positions, 24)
    assert not megatron_rotary_is_exact(ContextParallelPlan.thd((0, 8, 24), 2), positions, 24)
    assert not megatron_rotary_is_exact(ContextParallelPlan.zigzag(24, 2), positions, 28)


def test_marked_lengths_build_no_table_and_other_calls_run_megatron(monkeypatch):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    calls = []

    def megatron_forward(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
        calls.append((self, max_seq_len, offset, packed_seq, cp_group))
        return "megatron's table"

    monkeypatch.setattr(RotaryEmbedding, "forward", megatron_forward)
    rope, other = _rope(rotary_percent=1.0), _rope(rotary_percent=1.0)
    skip_marked_tables(rope)
    skip_marked_tables(rope)  # idempotent
    placeholder = rope(skip_table_length(24), cp_group="cp")
    assert placeholder.shape == (0, 1, 1, 0) and calls == []
    # Any other call, and any other module, is megatron-core's own forward.
    assert rope(24, packed_seq=True, cp_group="cp") == "megatron's table"
    assert other(skip_table_length(24)) == "megatron's table"
    assert calls == [(rope, 24, 0, True, "cp"), (other, 24, 0, False, None)]
    assert "forward" not in other.__dict__ and set(rope.state_dict()) == set(other.state_dict())
