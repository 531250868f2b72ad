"""Rotary position embeddings at each local row's source position, and when megatron's are right.

Under CP a rank's rows are some positions of the sequence in its plan's order. Rotary
embeddings must be evaluated at each row's own position id, whatever the plan.
megatron-core's ``GPTModel`` cannot do that: it builds one table ``0 .. L-1`` and hands rank
``r`` the zigzag chunks ``r`` and ``2 * cp - 1 - r`` of it (or, on one rank, the first rows),
which is right for Megatron's own zigzag layout of one sequence and silently wrong for any
other plan, packed sequences included.

``rotary_at_positions`` evaluates the model's own ``RotaryEmbedding`` at arbitrary positions,
bit for bit the rows of megatron's table. ``megatron_table_positions`` says which positions
megatron's table gives a rank, so callers can tell when megatron's path is exact and refuse it
otherwise.

When every layer applies the rows of ``rotary_at_positions`` instead, ``GPTModel``'s own table
is dead work (and its CP slice calls ``pin_memory`` and ``.cuda()``, so the forward could not
run on a CPU-only machine): ``skip_table_length`` marks the length ``GPTModel`` asks the rotary
module for, and ``skip_marked_tables`` makes the module answer such a request with an empty
placeholder instead of building anything. Any other request (``GPTModel`` outside CP) is
served by megatron-core's own ``forward``, unchanged.

Host-side helpers only; no communication.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
from torch import Tensor

from megatron.context_parallel.comm.plan import ContextParallelPlan

__all__ = [
    "skip_table_length",
    "skip_marked_tables",
    "rotary_at_positions",
    "megatron_table_positions",
    "megatron_rotary_is_exact",
    "check_rotary_module",
    "rotary_table_length",
]


def check_rotary_module(rope) -> None:
    """Raises unless ``rope`` is megatron-core's plain ``RotaryEmbedding`` (or a subclass of it).

    YaRN (which also scales attention by its own factor) and multimodal RoPE (3-D positions)
    are evaluated differently; running them at source positions is not implemented.

    Raises:
        ValueError: ``rope`` is another kind of position embedding.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        MultimodalRotaryEmbedding,
        RotaryEmbedding,
    )

    kind = type(rope).__name__
    if isinstance(rope, MultimodalRotaryEmbedding) or not isinstance(rope, RotaryEmbedding):
        raise ValueError(
            f"rotary embeddings at source positions support megatron-core's RotaryEmbedding "
            f"only, got {kind}"
        )
    if kind.startswith("Yarn"):
        raise ValueError(f"rotary embeddings at source positions do not support {kind}")


def rotary_at_positions(rope, positions: Tensor) -> Tensor:
    """``rope``'s table rows at ``positions``: fp32 ``[n, 1, 1, dim]`` on ``positions.device``.

    Equal, bit for bit, to rows ``positions`` of ``rope.get_emb(L)`` for any ``L`` above them
    (the same inverse frequencies, interpolation factor and interleaving), without building the
    table and without moving ``rope.inv_freq``.

    Args:
        rope: megatron-core ``RotaryEmbedding`` of the model (``GPTModel.rotary_pos_emb``).
        positions: int ``[n]`` position ids, any order, repeats allowed.
    """
    inv_freq = rope.inv_freq.to(positions.device)
    seq = positions.to(inv_freq.dtype)
    if rope.seq_len_interpolation_factor is not None:
        seq = seq * (1 / rope.seq_len_interpolation_factor)
    freqs = torch.outer(seq, inv_freq)
    if rope.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def rotary_table_length(seq_len: int, cp_size: int) -> int:
    """The rotary table length to give megatron-core for a packed batch of ``seq_len`` tokens:
    ``seq_len`` rounded up to a multiple of ``2 * cp_size`` (at least that multiple).

    ``GPTModel`` sizes its rotary table from ``packed_seq_params.max_seqlen_q / kv`` and cuts it
    into ``2 * cp_size`` chunks, so any other multiple fails inside megatron-core before the
    layers run. The whole batch's length (not its longest sequence) makes the table's slice as
    long as each rank's rows whenever the plan's shards are equal, so a layer that applies it
    reaches the package's checks instead of a shape error.
    """
    step = 2 * cp_size
    return max(-(-int(seq_len) // step), 1) * step


def megatron_table_positions(table_len: int, cp_size: int, rank: int) -> Optional[Tensor]:
    """Positions of the rotary rows megatron-core hands CP rank ``rank`` (``sbhd`` input).

    ``RotaryEmbedding.forward`` builds rows ``0 .. table_len-1``; on more than one rank it keeps
    the zigzag chunks ``rank`` and ``2 * cp_size - 1 - rank`` of ``2 * cp_size`` equal chunks.
    Returns int64 ``[table_len / cp_size]`` (CPU), or None when megatron-core cannot slice that
    length at all.
    """
    if cp_size == 1:
        return torch.arange(table_len, dtype=torch.int64)
    if table_len % (2 * cp_size) != 0:
        return None
    chunk = table_len // (2 * cp_size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, dtype=torch.int64)
    last_start = (2 * cp_size - 1 - rank) * chunk
    return torch.cat([first, torch.arange(last_start, last_start + chunk, dtype=torch.int64)])


def megatron_rotary_is_exact(
    plan: ContextParallelPlan, position_ids: Tensor, table_len: int
) -> bool:
    """Whether megatron-core's rotary rows are every rank's rows' position ids.

    Args:
        plan: the batch's plan.
        position_ids: int ``[plan.seq_len]`` (CPU) position ids of the batch in source order.
        table_len: the length of the table megatron-core builds (``max_seqlen_q`` with packed
            params, the row count times CP without).

    Returns:
        True when, on every rank, ``position_ids`` of its rows are exactly
        ``megatron_table_positions(table_len, cp_size, rank)``: Megatron's zigzag layout of one
        sequence (or all of it, in order, on one rank) whose position ids are ``0 .. S-1``.
    """
    positions = position_ids.to("cpu", torch.int64)
    for r in range(plan.cp_size):
        expected = megatron_table_positions(table_len, plan.cp_size, r)
        mine = positions.index_select(0, plan.local_positions(r))
        if expected is None or not torch.equal(mine, expected):
            return False
    return True


class _SkippedTableLength(int):
    """A rotary table length that asks for no table (see ``skip_table_length``)."""


def skip_table_length(length: int) -> int:
    """``length``, marked so that a module set up by ``skip_marked_tables`` builds no table.

    An ``int`` in every other respect: give it as ``PackedSeqParams.max_seqlen_q / kv``,
    which ``GPTModel`` passes on as the rotary table's length.
    """
    return _SkippedTableLength(length)


def _forward_unless_marked(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
    if isinstance(max_seq_len, _SkippedTableLength):
        # Non-None, so layers still know the model uses rotary; empty, so a layer that applied
        # it instead of its own rows would fail on the shape rather than compute silently.
        return self.inv_freq.new_empty(0, 1, 1, 0)
    return type(self).forward(self, max_seq_len, offset, packed_seq, cp_group)


def skip_marked_tables(rope) -> None:
    """Makes ``rope`` (``GPTModel.rotary_pos_emb``) build no table for ``skip_table_length``
    lengths; every other call runs megatron-core's ``forward`` as before. Idempotent.

    Set on the instance (its ``forward``), so state dicts, other models and other calls are
    untouched.
    """
    check_rotary_module(rope)
    if getattr(rope.forward, "__func__", None) is not _forward_unless_marked:
        rope.forward = types.MethodType(_forward_unless_marked, rope)
