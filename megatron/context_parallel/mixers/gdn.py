"""Gated DeltaNet under any CP plan: rows to head shards in source order, and back.

A Gated DeltaNet (GDN) layer mixes the sequence with a causal depthwise convolution and a gated
delta-rule recurrence, both of which need every row of a sequence, in order, on one device.
megatron-core's ``GatedDeltaNet`` gets them there by an all-to-all that assumes its own
load-balanced layout (every sequence cut into ``2 * cp`` equal chunks); for any other plan the
recurrence would run over rows in the wrong order. ``ContextParallelGatedDeltaNet`` keeps
megatron's parameters, projections and checkpoint layout and replaces that exchange:

1. the input projection runs on this rank's rows (plan order);
2. ONE all-to-all over the CP group sends every rank the columns of its heads (rank ``c`` gets
   the ``c``-th ``1/cp`` of the query, key, value, beta and alpha heads of this TP rank) of
   every owned row; the output gate (z) stays on the row's rank;
3. the convolution runs per packed sequence over whole sequences in SOURCE order: on CUDA a
   Triton kernel of the package (``gdn_conv``) reads each source row where the all-to-all put
   it, through the index tables, and writes its gradient back there (no reordered copy);
   elsewhere the package's row kernel (``row_ops.permute_rows``) reorders the rows first and plain
   torch convolves them;
4. the gated delta rule runs on the source-ordered result per packed sequence (``cu_seqlens``
   of the owned rows): fla's chunked kernel on CUDA, plain torch elsewhere;
5. the inverse reorder and ONE all-to-all back to row shards; there the gated output norm
   runs on the received head blocks, read as rows through a transposed view (it is per value
   head and per row, so the gate needs no exchange; on CUDA megatron's compiled norm reads the
   view in place) and the output projection on this rank's rows. At CP 1 the same without the
   all-to-alls.

Backward is the transpose: the same two all-to-alls of gradients, the same index tables. The
tables (``HeadShardRows``) are built once per batch from the plan on the host and shared by
every GDN layer through ``ContextParallelParams.per_batch``. Positions no rank owns are not in
the batch (as for attention): each sequence's recurrence runs over its owned positions.

Under a ``PrefixTree`` (``params.tree``) the exchange is the same (one all-to-all each way: the
head shards already hold every position in source order); only the mixing on them changes
(``TreeRows``). Each segment's convolution continues from the ``kernel - 1`` inputs that precede
it on its root path (its parent's last ones, through further ancestors when the parent is
shorter: ``tree.conv_tail_positions``), gathered by index in front of its rows, so their
gradient flows back to the parent's rows; its gated delta rule starts from its parent's final
recurrent state (roots from zeros), through which the gradient flows back as well. The rule runs
one segment at a time in packed order (parents first) in torch, and on CUDA as one fla varlen
call per tree depth (all segments of a depth together, their initial states gathered from the
previous depth's final states). The package's Triton convolution (``gdn_conv``) does not know
trees: under a tree the rows are put in source order first and convolved over the gathered
``[tail ++ segment]`` rows (fla's kernel on CUDA, torch elsewhere). A tree must have every
position owned by some rank (a ValueError names how many are not).

Parameter gradients: rank ``c`` computes the convolution, ``A_log`` and ``dt_bias`` gradients of
its heads only, and the projections' gradients of its own rows; their sum over the CP group
(Megatron's DDP reduces over DP x CP) is the single-device gradient.

``get_gated_delta_net_with_context_parallel_spec`` is its mixer spec from local modules (the
``G`` layer of ``hybrid.get_hybrid_stack_with_context_parallel_spec``). megatron-core's own
``GatedDeltaNet`` and ``MambaMixer`` are refused under plans they would get wrong by
``hybrid.check_layers``, before the model runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core import jit as _jit
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.ssm.gated_delta_net import common as _gdn_common
from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import Tensor

from megatron.context_parallel.comm.mappings import all_to_all_over_context_parallel_region
from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.comm.row_ops import permute_rows
from megatron.context_parallel.params import ContextParallelParams
from megatron.context_parallel.tree import PrefixTree

__all__ = [
    "ContextParallelGatedDeltaNet",
    "HeadShardRows",
    "TreeRows",
    "get_gated_delta_net_with_context_parallel_spec",
]

# fla's l2norm epsilon, which megatron's GatedDeltaNet applies to queries and keys.
_L2NORM_EPS = 1e-6


@dataclass(frozen=True)
class HeadShardRows:
    """Index tables of one batch for the head-shard layout of the sequence mixers.

    The all-to-all delivers every owned row to every rank in *receive order*: rank 0's rows
    (its plan order), then rank 1's, ... The tables put them in source order and back.

    Attributes:
        counts: rows per rank (``plan.counts``).
        to_source: int64 ``[owned]`` on the batch's device: for the ``i``-th owned position in
            ascending source order, its row in receive order.
        from_source: int64 ``[owned]``: the inverse permutation.
        cu_seqlens: int64 ``[k + 1]`` on the device: cumulative owned rows of the ``k`` packed
            sequences that own at least one row (empty ones are dropped).
        cu_seqlens_cpu: the same on the host (fla's kernels read it without a device sync).
        offsets: int64 ``[owned]`` on the device: each source-ordered row's index within its
            sequence's owned rows (the convolution's causal mask, torch's and ``gdn_conv``'s).
        tree: under a ``PrefixTree`` its tables (``TreeRows``; the packed sequences above are
            then the tree's segments), else None.
    """

    counts: Tuple[int, ...]
    to_source: Tensor
    from_source: Tensor
    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor
    offsets: Tensor
    tree: Optional["TreeRows"] = None

    @classmethod
    def build(
        cls,
        plan: ContextParallelPlan,
        cu_seqlens: Optional[Sequence[int]],
        device: torch.device,
    ) -> "HeadShardRows":
        """The tables for ``plan`` (host work once per batch, then one copy to ``device``).

        Args:
            plan: the batch's plan.
            cu_seqlens: cumulative lengths of the packed sequences (None: one sequence).
            device: where the index tensors go (the activations' device).
        """
        received = torch.cat([plan.local_positions(r) for r in range(plan.cp_size)])
        # The received positions are distinct: a scatter into the sequence orders them in one
        # linear pass (argsort took 70% of this build, ~1 ms, at 20k positions).
        row_of = torch.full((plan.seq_len,), -1, dtype=torch.int64)
        row_of[received] = torch.arange(received.numel(), dtype=torch.int64)
        is_owned = row_of >= 0
        to_source = row_of[is_owned]
        from_source = torch.empty_like(to_source)
        from_source[to_source] = torch.arange(to_source.numel(), dtype=torch.int64)
        owned = torch.nonzero(is_owned).flatten()
        bounds = torch.tensor([plan.seq_len] if cu_seqlens is None else list(cu_seqlens[1:]))
        # Sequences are contiguous ranges of positions, so the sorted owned positions come
        # grouped by sequence.
        sequence = torch.bucketize(owned, bounds, right=True)
        lengths = torch.bincount(sequence, minlength=bounds.numel())
        lengths = lengths[lengths > 0]
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        starts = torch.repeat_interleave(cu[:-1], lengths)
        offsets = torch.arange(owned.numel(), dtype=torch.int64) - starts
        return cls(
            counts=tuple(plan.counts),
            to_source=to_source.to(device),
            from_source=from_source.to(device),
            cu_seqlens=cu.to(device),
            cu_seqlens_cpu=cu,
            offsets=offsets.to(device),
        )

    @classmethod
    def build_for_tree(
        cls, plan: ContextParallelPlan, tree: PrefixTree, device: torch.device
    ) -> "HeadShardRows":
        """The tables for ``plan`` under ``tree``: packed sequences = the tree's segments, and
        the tree's own tables (``TreeRows``).

        Raises:
            ValueError: the tree's length is not the plan's, or some position is owned by no
                rank (naming how many); the same on every rank (plan and tree are).
        """
        tree.check_seq_len(plan.seq_len)
        unowned = plan.seq_len - sum(plan.counts)
        if unowned:
            raise ValueError(
                f"Gated DeltaNet under a PrefixTree needs every position owned by some rank: "
                f"{unowned} of the {plan.seq_len} positions are owned by none in {plan}"
            )
        rows = cls.build(plan, tree.starts + (tree.seq_len,), device)
        return dataclasses.replace(rows, tree=TreeRows.build(tree, device))

    @classmethod
    def for_params(cls, params: ContextParallelParams, device: torch.device) -> "HeadShardRows":
        """The batch's tables, built on the first GDN layer and shared by the others."""
        tree = params.tree
        if tree is not None:
            return params.per_batch(
                "head_shard_rows", lambda: cls.build_for_tree(params.plan, tree, device)
            )
        return params.per_batch(
            "head_shard_rows", lambda: cls.build(params.plan, params.source_cu_seqlens, device)
        )


@dataclass(frozen=True)
class _Packing:
    """Packed sequences of rows for a convolution: ``cu_seqlens`` (device and host) and each
    row's index within its sequence (``offsets``), as ``HeadShardRows`` has them."""

    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor
    offsets: Tensor


@dataclass(frozen=True)
class _TreeConv:
    """The convolution's rows under a tree for a tail of ``width`` inputs.

    Attributes:
        index: int64 ``[num_segments * width + n]`` on the device: the rows to convolve, segment
            by segment in packed order, each its ``width`` tail inputs (source-ordered rows,
            oldest first; ``n``, a zero row, where the root path has fewer) then its own rows.
        keep: int64 ``[n]``: for each source-ordered row, its place in ``index``.
        packing: ``[tail ++ segment]`` as the packed sequences of the gathered rows.
    """

    index: Tensor
    keep: Tensor
    packing: _Packing


@dataclass(frozen=True)
class _TreeLevel:
    """The segments of one tree depth as one varlen batch of fla's gated delta rule.

    Attributes:
        rows: int64 ``[m]`` on the device: the source-ordered rows of the depth's segments,
            segment by segment in packed order.
        cu_seqlens: int64 ``[k + 1]`` on the device: their cumulative lengths (``k`` segments).
        cu_seqlens_cpu: the same on the host.
        parent_slots: int64 ``[k]`` on the device: each segment's parent's index among the
            previous depth's segments (whose final states it starts from); None for the roots.
    """

    rows: Tensor
    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor
    parent_slots: Optional[Tensor]


@dataclass(frozen=True)
class TreeRows:
    """Index tables of one batch under a ``PrefixTree`` for the sequence mixers' head shards.

    Every position is owned, so the ``i``-th source-ordered row is position ``i``, and a segment
    is a contiguous range of rows. Built once per batch on the host (``HeadShardRows``), the
    convolution's tables once per tail width on first use.

    Attributes:
        tree: the batch's tree.
        device: where the tables go.
        levels: ``_TreeLevel`` per tree depth, roots first.
        level_inverse: int64 ``[n]`` on the device: for each source-ordered row its index in the
            levels' rows concatenated (the fla path's outputs back to source order).
    """

    tree: PrefixTree
    device: torch.device
    levels: Tuple[_TreeLevel, ...]
    level_inverse: Tensor
    _convs: Dict[int, _TreeConv] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, tree: PrefixTree, device: torch.device) -> "TreeRows":
        """The depth levels of ``tree`` (host work, then one copy of each table to ``device``)."""
        by_depth = [[] for _ in range(max(tree.depth) + 1)]
        for segment, depth in enumerate(tree.depth):
            by_depth[depth].append(segment)
        slot = {}
        levels, order = [], []
        for depth, segments in enumerate(by_depth):
            for i, segment in enumerate(segments):
                slot[segment] = i
            rows = torch.cat(
                [torch.arange(tree.starts[s], tree.starts[s] + tree.lengths[s]) for s in segments]
            )
            lengths = torch.tensor([tree.lengths[s] for s in segments], dtype=torch.int64)
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
            parents = None
            if depth > 0:
                parents = torch.tensor([slot[tree.parents[s]] for s in segments]).to(device)
            levels.append(_TreeLevel(rows.to(device), cu.to(device), cu, parents))
            order.append(rows)
        order = torch.cat(order)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), dtype=torch.int64)
        return cls(tree, device, tuple(levels), inverse.to(device))

    def conv(self, width: int) -> _TreeConv:
        """The convolution's tables for tails of ``width`` inputs (``kernel - 1``), built on
        first use and shared by the layers."""
        tables = self._convs.get(width)
        if tables is None:
            tables = self._build_conv(width)
            self._convs[width] = tables
        return tables

    def _build_conv(self, width: int) -> _TreeConv:
        tree = self.tree
        n = tree.seq_len
        tails = tree.conv_tail_positions(width)
        tails = torch.where(tails >= 0, tails, n)  # row n: the zero row
        starts = torch.tensor(tree.starts, dtype=torch.int64)
        lengths = torch.tensor(tree.lengths, dtype=torch.int64) + width
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        segment = tree.segment_index()
        rows = torch.arange(n, dtype=torch.int64)
        keep = cu[:-1][segment] + width + rows - starts[segment]
        index = torch.empty(int(cu[-1]), dtype=torch.int64)
        index[keep] = rows
        tail_slots = cu[:-1, None] + torch.arange(width, dtype=torch.int64)
        index[tail_slots.flatten()] = tails.flatten()
        offsets = torch.arange(index.numel(), dtype=torch.int64) - torch.repeat_interleave(
            cu[:-1], lengths
        )
        packing = _Packing(cu.to(self.device), cu, offsets.to(self.device))
        return _TreeConv(index.to(self.device), keep.to(self.device), packing)


def _l2_normalised(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in fp32 (fla's ``l2norm``)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + _L2NORM_EPS)).to(x.dtype)


def _causal_depthwise_conv(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], offsets: Tensor
) -> Tensor:
    """Causal depthwise convolution of packed sequences, without a loop over sequences.

    Args:
        x: ``[N, C]`` rows of the packed sequences in order.
        weight: ``[C, K]``; row ``t`` gets ``sum_s weight[:, K-1-s] * x[t-s]`` over the ``s``
            with ``t - s`` in its own sequence.
        bias: ``[C]`` or None.
        offsets: int64 ``[N]``, each row's index within its sequence.

    Returns:
        ``[N, C]`` of ``x``'s dtype (before the activation). Differentiable in all inputs.
    """
    width = weight.shape[1]
    out = x * weight[:, width - 1]
    for shift in range(1, min(width, x.shape[0] + 1)):
        earlier = F.pad(x[:-shift], (0, 0, shift, 0))
        inside = (offsets >= shift).unsqueeze(1)
        out = out + torch.where(inside, earlier, 0.0) * weight[:, width - 1 - shift]
    return out if bias is None else out + bias


class _SendBlocks(torch.autograd.Function):
    """This rank's projected rows -> the head blocks the all-to-all sends, and the gate.

    ``local`` ``[n, D]`` (columns: megatron's sections q, k, v, z, beta, alpha) ->
    ``blocks`` ``[cp * n, W]``, block ``c`` the ``c``-th ``1/cp`` of every section in ``spans``
    side by side (``spans``: ``(first column, width)`` of q, k, v, beta, alpha, each width
    divisible by ``cp``; ``W`` the sum of the widths over ``cp``), and ``gate`` ``[n, G]``,
    the columns of ``gate_span`` (z) as a view of ``local`` (no copy; not to be modified in
    place). The gate never travels: the gated norm is row-wise, so it runs on the rows' own rank
    after the way back and reads the view as megatron's own layer reads its split. Backward:
    one ``[n, D]`` gradient written by one copy per span and one for the gate's columns
    (autograd through a slice and ``cat`` would add two full-width gradients, and at
    Qwen3.5-27B's shape the projected rows are ~370 MB).
    """

    @staticmethod
    def forward(ctx, local: Tensor, spans, gate_span, cp: int):
        ctx.spans, ctx.gate_span, ctx.cp, ctx.width = spans, gate_span, cp, local.shape[1]
        first, width = gate_span
        return _rows_to_blocks(local, spans, cp), local[:, first : first + width]

    @staticmethod
    def backward(ctx, grad_blocks: Tensor, grad_gate: Tensor):
        n = grad_gate.shape[0]
        rows = grad_blocks.new_empty(n, ctx.width)
        _blocks_to_rows(grad_blocks, ctx.spans, ctx.cp, rows)
        gate = (ctx.gate_span,)
        _copy_spans(
            rows,
            grad_gate.to(rows.dtype).reshape(1, n, grad_gate.shape[1]),
            gate,
            1,
            to_blocks=False,
        )
        return rows, None, None, None


def _rows_to_blocks(rows: Tensor, spans: Sequence[Tuple[int, int]], cp: int) -> Tensor:
    """``[n, D]`` -> ``[cp * n, W]``: block ``c`` holds the ``c``-th ``1/cp`` of every span."""
    n, width = rows.shape[0], sum(w for _, w in spans) // cp
    blocks = rows.new_empty(cp, n, width)
    _copy_spans(rows, blocks, spans, cp, to_blocks=True)
    return blocks.view(cp * n, width)


def _blocks_to_rows(
    blocks: Tensor, spans: Sequence[Tuple[int, int]], cp: int, rows: Tensor
) -> None:
    """The inverse of ``_rows_to_blocks``, into ``rows`` ``[n, D]`` (columns outside the spans
    are left as they are)."""
    n = rows.shape[0]
    _copy_spans(rows, blocks.reshape(cp, n, blocks.shape[1]), spans, cp, to_blocks=False)


# Integer types by byte width, for copying several elements as one.
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _as_words(tensors: Sequence[Tensor], columns: Sequence[int]):
    """The tensors viewed with the widest integer element (<= 8 bytes) that every column
    count in ``columns`` and every tensor's layout allow, and the factor of that element over
    the tensors' own; or the tensors as they are (factor 1).

    torch copies a strided (non-contiguous) tensor one element at a time: 2 bytes for bf16,
    ~1.3 TB/s on an H100 where a plain copy runs at 2.8 (``benchmarks/probes``); the same copy
    in 8-byte words moves four bf16 at once."""
    size = tensors[0].element_size()
    for word in (8, 4, 2):
        factor = word // size
        if factor <= 1:
            break
        if all(c % factor == 0 for c in columns) and all(
            t.stride(-1) == 1
            and t.storage_offset() % factor == 0
            and all(s % factor == 0 for s in t.stride()[:-1])
            for t in tensors
        ):
            return [t.view(_WORDS[word]) for t in tensors], factor
    return list(tensors), 1


def _copy_spans(
    rows: Tensor, blocks: Tensor, spans: Sequence[Tuple[int, int]], cp: int, to_blocks: bool
) -> None:
    """Copy between ``rows`` ``[n, D]`` and ``blocks`` ``[cp, n, W]``, span by span (bitwise: in
    integer words where the layout allows, see ``_as_words``)."""
    columns = [c for first, width in spans for c in (first, width // cp)]
    (rows, blocks), factor = _as_words((rows, blocks), columns)
    blk = 0
    for first, width in spans:
        first, width = first // factor, width // factor
        part = width // cp
        in_rows = rows[:, first : first + width].unflatten(1, (cp, part)).transpose(0, 1)
        in_blocks = blocks[:, :, blk : blk + part]
        if to_blocks:
            in_blocks.copy_(in_rows)
        else:
            in_rows.copy_(in_blocks)
        blk += part


def _cpu_device() -> torch.device:
    return torch.device("cpu")


@contextlib.contextmanager
def _device_query_on_cpu():
    """Without CUDA, ``torch.cuda.current_device()`` answers the CPU inside this block.

    megatron-core's ``GatedDeltaNet.__init__`` (0.19.2, ``_GDNBase``) puts ``conv1d``,
    ``dt_bias`` and ``A_log`` on ``torch.cuda.current_device()`` (and ``reset_parameters``
    allocates there), which raises without CUDA. The layer's constructor runs megatron's inside
    this block, so a model with GDN layers builds on a CPU-only machine (with
    ``use_cpu_initialization``, as megatron's linear layers need there) with no patch. With
    CUDA it does nothing; without, any caller of the query in the block (on any thread) gets
    the CPU where it would otherwise have raised. The query is restored on the way out.
    """
    if torch.cuda.is_available():
        yield
        return
    query = torch.cuda.current_device
    torch.cuda.current_device = _cpu_device
    try:
        yield
    finally:
        torch.cuda.current_device = query


# megatron's gated norm without its jit_fuser's compile: the CPU path is the test oracle, and
# inductor on CPU needs a C++ toolchain and a compile per shape.
_eager_apply_gated_norm = getattr(
    GatedDeltaNet._apply_gated_norm, "_torchdynamo_orig_callable", GatedDeltaNet._apply_gated_norm
)


def _eager_gated_norm_of_blocks(layer: GatedDeltaNet, blocks: Tensor, gate: Tensor, cp: int):
    """megatron's gated norm (eager) of head blocks ``[cp * m, V / cp]`` and the gate ``[m, V]``
    of the same ``m`` rows, read as rows through a transposed view; returns ``[m, V]``."""
    m, width = gate.shape
    dv = layer.value_head_dim
    core = blocks.view(cp, m, width // (cp * dv), dv).transpose(0, 1)
    return _eager_apply_gated_norm(layer, core, gate.view(m, width // dv, dv)).view(m, width)


# The same compiled by megatron's jit_fuser (torch.compile) with the transposed view INSIDE the
# graph: the fused backward then writes the blocks' gradient in their own layout. On an H100
# at S = 20,436, CP 2 (benchmarks/probes/probe_gdn_copies.py, one run): megatron's norm on its
# own contiguous rows 0.61 ms fwd+bwd, this 0.74, megatron's compiled norm handed the view 0.80.
# One graph per CP size and a dynamic row count: 3 graphs over 20 random row counts and two
# layers, no recompiles. Where jit_fuser is not torch.compile (megatron's disable_jit_fuser,
# or an old torch's torch.jit.script, which cannot script a module argument) the eager
# function.
_compiled_gated_norm_of_blocks = (
    _jit.jit_fuser(_eager_gated_norm_of_blocks)
    if _jit.jit_fuser is torch.compile
    else _eager_gated_norm_of_blocks
)


class ContextParallelGatedDeltaNet(GatedDeltaNet):
    """megatron-core's ``GatedDeltaNet`` that runs under any ``ContextParallelPlan``.

    Same constructor, parameters and checkpoint layout as ``GatedDeltaNet`` (build it where a
    layer spec names ``GatedDeltaNet``). With ``packed_seq_params`` a ``ContextParallelParams``
    (what ``context_parallel_batch`` passes) it computes as the module docstring describes; with
    anything else it is megatron-core's ``GatedDeltaNet``.

    Inputs (params path): ``hidden_states`` ``[n, 1, H]``, this rank's ``n = plan.counts[rank]``
    rows in plan order plus the one padding row of an empty rank (its output is zero), or ``n /
    TP`` of them under sequence parallelism (the projections gather and scatter them). Returns
    ``(out [n, 1, H], bias)`` like ``GatedDeltaNet``.

    Raises:
        ValueError: the key or value heads of a TP rank do not divide by the CP size (at
            construction, and in forward for the params' group, on every rank alike: every rank
            has the same config and plan); selective recompute of the output norm; a batch
            dimension other than 1 or a row count the plan does not give this rank; under a
            ``PrefixTree``, positions no rank owns (before any collective, on every rank).

    Without CUDA it builds on the CPU with no patch (``use_cpu_initialization`` for megatron's
    linear layers): see ``_device_query_on_cpu`` and ``reset_parameters``.
    """

    def __init__(self, *args, **kwargs):
        with _device_query_on_cpu():
            super().__init__(*args, **kwargs)
        if self.recompute_norm_out:
            raise ValueError(
                f"ContextParallelGatedDeltaNet (layer {self.layer_number}) does not support "
                "recompute_modules 'gdn_norm_out'"
            )
        self.check_heads(self.cp_size)

    def reset_parameters(self) -> None:
        """megatron's ``reset_parameters``; for parameters on the CPU the same draws without its
        CUDA RNG tracker.

        megatron draws ``conv1d.weight`` (with ``conv_init``) and ``A_log`` inside
        ``get_cuda_rng_tracker().fork()``; for CPU tensors those draws come from the CPU
        generator either way, and without CUDA no tracker state can be added (the fork raises).
        So on the CPU: the same draws, in the same order, from the CPU generator (what megatron
        gives under an inference tracker, whose fork does nothing).
        """
        if self.A_log.device.type != "cpu":
            super().reset_parameters()
            return
        if not self.config.perform_initialization:
            return
        with torch.no_grad():
            if self.conv_init is not None:
                torch.nn.init.uniform_(self.conv1d.weight, -self.conv_init, self.conv_init)
            self.dt_bias.fill_(1.0)
            decay = torch.empty_like(self.A_log).uniform_(*self.A_init_range)
            self.A_log.copy_(torch.log(decay))

    def check_heads(self, cp_size: int) -> None:
        """ValueError naming the numbers unless this TP rank's key and value heads divide by
        ``cp_size``."""
        heads = (self.num_k_heads_local_tp, self.num_v_heads_local_tp)
        if cp_size > 1 and any(h % cp_size for h in heads):
            raise ValueError(
                f"Gated DeltaNet layer {self.layer_number}: CP {cp_size} needs the key and value "
                f"heads of each TP rank to divide by it; got {heads[0]} key heads and {heads[1]} "
                f"value heads per TP rank ({self.num_key_heads} and {self.num_value_heads} over "
                f"TP {self.tp_size})"
            )

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params=None,
        **kwargs,
    ):
        """``GatedDeltaNet.forward``; under ``ContextParallelParams`` for any plan (see class)."""
        if not isinstance(packed_seq_params, ContextParallelParams):
            return super().forward(
                hidden_states,
                attention_mask,
                inference_context=inference_context,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                inference_params=inference_params,
                **kwargs,
            )
        if inference_context is not None or inference_params is not None:
            raise ValueError("ContextParallelGatedDeltaNet does not support inference contexts")
        params = packed_seq_params
        plan = params.plan
        cp = plan.cp_size
        group = params.cp_group if params.cp_group is not None else self.pg_collection.cp
        if cp > 1:
            plan.rank_in(group)
        self.check_heads(cp)

        projected, _ = self.in_proj(hidden_states)
        rows = plan.counts[params.rank]
        if projected.shape[1] != 1 or projected.shape[0] != rows + params.padding_rows:
            raise ValueError(
                f"Gated DeltaNet layer {self.layer_number} got rows {tuple(projected.shape[:2])} "
                f"(sequence, batch) on rank {params.rank}; {plan} gives it {rows} rows "
                f"(+{params.padding_rows} padding) of batch 1"
            )
        tables = HeadShardRows.for_params(params, projected.device)
        local = projected[:rows, 0]

        if cp == 1:
            mine = permute_rows(local, tables.to_source, tables.from_source)
            qk, v, hv = self.qk_dim_local_tp, self.v_dim_local_tp, self.num_v_heads_local_tp
            qkv, gate, beta, alpha = torch.split(mine, [2 * qk + v, v, hv, hv], dim=1)
            core = self._mix(qkv, beta, alpha, tables, 0, 1)
            out = permute_rows(
                self._gated_norm(core, gate, 1), tables.from_source, tables.to_source
            )
        else:
            blocks, gate = _SendBlocks.apply(local, *self._send_spans(), cp)
            received = all_to_all_over_context_parallel_region(
                blocks, [rows] * cp, tables.counts, group
            )
            core = self._mix_received(received, tables, params.rank, cp)
            out = self._gated_norm(self._to_row_shard(core, rows, cp, group, tables), gate, cp)
        if params.padding_rows:
            out = torch.cat([out, out.new_zeros(params.padding_rows, out.shape[1])])
        return self.out_proj(out.unsqueeze(1))

    # ------------------------------------------------------------------ the exchange

    def _send_spans(self):
        """``(spans, gate_span)`` of the projected rows for ``_SendBlocks``: the ``(first
        column, width)`` of q, k, v, beta and alpha (what the mixing needs), and of z."""
        sections = list(self.in_proj_split_sections)  # q, k, v, z, beta, alpha
        starts = [sum(sections[:i]) for i in range(len(sections))]
        spans = tuple((starts[i], sections[i]) for i in (0, 1, 2, 4, 5))
        return spans, (starts[3], sections[3])

    def _received_widths(self, cp: int) -> Tuple[int, int, int]:
        """Widths of a received row's q + k + v, beta and alpha columns (head chunk of ``cp``)."""
        qk, v, hv = self.qk_dim_local_tp, self.v_dim_local_tp, self.num_v_heads_local_tp
        return (2 * qk + v) // cp, hv // cp, hv // cp

    def _to_row_shard(
        self, mixed: Tensor, rows: int, cp: int, group, tables: HeadShardRows
    ) -> Tensor:
        """``[owned, V / cp]`` this rank's heads, source order -> ``[cp * rows, V / cp]``: block
        ``c`` the head chunk ``c`` of this rank's rows (plan order), as the all-to-all delivers
        it; ``_gated_norm`` reads the blocks as rows."""
        back = permute_rows(mixed, tables.from_source, tables.to_source)
        return all_to_all_over_context_parallel_region(back, tables.counts, [rows] * cp, group)

    # ------------------------------------------------------------------ the mixing

    def _heads_of(self, param: Tensor, sections: Sequence[int], chunk: int, cp: int) -> Tensor:
        """Rows of ``param`` (dim 0) for head chunk ``chunk`` of ``cp`` within each section."""
        if cp == 1:
            return param
        parts = torch.split(param, list(sections), dim=0)
        return torch.cat([p.reshape(cp, -1, *p.shape[1:])[chunk] for p in parts], dim=0)

    def _conv_params(self, chunk: int, cp: int):
        """The convolution's ``weight`` ``[C, K]`` and ``bias`` (or None) of head chunk
        ``chunk`` of ``cp``: rows of the q, k and v sections."""
        conv_sections = [self.qk_dim_local_tp, self.qk_dim_local_tp, self.v_dim_local_tp]
        weight = self._heads_of(self.conv1d.weight[:, 0], conv_sections, chunk, cp)
        bias = self.conv1d.bias
        if bias is not None:
            bias = self._heads_of(bias, conv_sections, chunk, cp)
        return weight, bias

    def _mix_received(self, received: Tensor, tables: HeadShardRows, chunk: int, cp: int):
        """``_mix`` of the rows as the all-to-all delivers them: ``received`` ``[owned, W]``
        (columns q, k, v, beta, alpha of head chunk ``chunk``), grouped by sending rank.

        On CUDA with fla (the layer's CUDA path) the convolution reads them in source order
        through ``tables.to_source`` and writes their gradient back in place
        (``gdn_conv.gathered_causal_conv``), with no reordered copy; elsewhere, and under a
        tree (that kernel does not know trees), they are put in source order by the row kernel
        first."""
        widths = list(self._received_widths(cp))
        if (
            received.device.type == "cuda"
            and _gdn_common.HAVE_FLA
            and self.activation in ("silu", "swish", None)
            and tables.tree is None
        ):
            from megatron.context_parallel.mixers.gdn_conv import gathered_causal_conv

            weight, bias = self._conv_params(chunk, cp)
            qkv, rest = gathered_causal_conv(
                received, weight, bias, tables.to_source, tables.from_source, tables.offsets,
                widths[0], self.activation,
            )  # fmt: skip
            beta, alpha = torch.split(rest, widths[1:], dim=1)
            return self._rule(qkv, beta, alpha, tables, chunk, cp)
        mine = permute_rows(received, tables.to_source, tables.from_source)
        qkv, beta, alpha = torch.split(mine, widths, dim=1)
        return self._mix(qkv, beta, alpha, tables, chunk, cp)

    def _mix(
        self, qkv: Tensor, beta: Tensor, alpha: Tensor, tables: HeadShardRows, chunk: int, cp: int
    ) -> Tensor:
        """Convolution and gated delta rule of head chunk ``chunk`` over whole sequences.

        ``qkv`` ``[owned, (2 * qk + v) / cp]``, ``beta`` and ``alpha`` ``[owned, hv / cp]``, in
        source order (views of the received rows); returns the rule's output ``[owned, V /
        cp]`` (the gated norm runs where the gate is: ``forward``)."""
        weight, bias = self._conv_params(chunk, cp)
        return self._rule(self._convolve(qkv, weight, bias, tables), beta, alpha, tables, chunk, cp)

    def _rule(
        self, qkv: Tensor, beta: Tensor, alpha: Tensor, tables: HeadShardRows, chunk: int, cp: int
    ) -> Tensor:
        """The gates and the gated delta rule of head chunk ``chunk`` on the convolved (and
        activated) ``qkv`` ``[owned, (2 * qk + v) / cp]``, with ``beta`` and ``alpha`` ``[owned,
        hv / cp]``, all in source order; returns ``[owned, V / cp]``."""
        qk, v = self.qk_dim_local_tp // cp, self.v_dim_local_tp // cp
        hk, hv = self.num_k_heads_local_tp // cp, self.num_v_heads_local_tp // cp
        dk, dv = self.key_head_dim, self.value_head_dim
        n = qkv.shape[0]
        a_log = self._heads_of(self.A_log, [self.num_v_heads_local_tp], chunk, cp)
        dt_bias = self._heads_of(self.dt_bias, [self.num_v_heads_local_tp], chunk, cp)
        decay = -a_log.float().exp() * F.softplus(alpha.float() + dt_bias.float())
        beta = beta.sigmoid()
        query, key, value = torch.split(qkv, [qk, qk, v], dim=1)
        query, key = query.reshape(1, n, hk, dk), key.reshape(1, n, hk, dk)
        core = self._delta_rule(query, key, value.reshape(1, n, hv, dv), decay, beta, tables)
        return core.reshape(n, hv * dv)

    def _convolve(
        self, qkv: Tensor, weight: Tensor, bias: Optional[Tensor], tables: HeadShardRows
    ) -> Tensor:
        """Causal depthwise convolution and activation of ``[owned, C]`` source-ordered rows,
        per packed sequence: fla's kernel on CUDA, ``_causal_depthwise_conv`` elsewhere.

        Under a tree per segment over its tail inputs and its rows, gathered by index (a zero
        row where the root path has fewer inputs), keeping the segment rows' outputs: the
        gradient of a tail input flows back to its row in the parent (or further up)."""
        if tables.tree is not None:
            conv = tables.tree.conv(weight.shape[1] - 1)
            padded = torch.cat([qkv, qkv.new_zeros(1, qkv.shape[1])])
            gathered = padded.index_select(0, conv.index)
            out = self._convolve_packed(gathered, weight, bias, conv.packing)
            return out.index_select(0, conv.keep)
        return self._convolve_packed(qkv, weight, bias, tables)

    def _convolve_packed(self, qkv: Tensor, weight: Tensor, bias: Optional[Tensor], tables):
        """``_convolve`` of the packed sequences of ``tables`` (``cu_seqlens``,
        ``cu_seqlens_cpu``, ``offsets``: a ``HeadShardRows`` or a ``_Packing``)."""
        if qkv.device.type == "cuda" and _gdn_common.HAVE_FLA:
            out, _ = _gdn_common.causal_conv1d(
                x=qkv.unsqueeze(0),
                weight=weight,
                bias=bias,
                activation=self.activation,
                cu_seqlens=tables.cu_seqlens,
                cu_seqlens_cpu=tables.cu_seqlens_cpu,
            )
            return out[0]
        return self.act_fn(_causal_depthwise_conv(qkv, weight, bias, tables.offsets))

    def _delta_rule(self, query, key, value, decay, beta, tables: HeadShardRows) -> Tensor:
        """The gated delta rule per packed sequence: fla's chunked kernel on CUDA (grouped
        values, l2norm in the kernel), megatron-core's torch rule elsewhere.

        ``query``, ``key``: ``[1, owned, hk, dk]``; ``value``: ``[1, owned, hv, dv]``;
        ``decay`` (log space, fp32), ``beta``: ``[owned, hv]``. Returns ``[1, owned, hv, dv]``.
        Under a tree each segment starts from its parent's final state (``_delta_rule_tree``
        on CUDA).
        """
        if query.device.type == "cuda" and _gdn_common.HAVE_FLA:
            if tables.tree is not None:
                return self._delta_rule_tree(query, key, value, decay, beta, tables.tree)
            core, _ = _gdn_common.chunk_gated_delta_rule(
                query,
                key,
                value,
                g=decay.unsqueeze(0),
                beta=beta.unsqueeze(0),
                use_qk_l2norm_in_kernel=self.use_qk_l2norm,
                cu_seqlens=tables.cu_seqlens,
                cu_seqlens_cpu=tables.cu_seqlens_cpu,
            )
            return core
        return self._delta_rule_torch(query, key, value, decay, beta, tables)

    def _delta_rule_tree(self, query, key, value, decay, beta, tree: TreeRows) -> Tensor:
        """fla's chunked rule under a tree: one varlen call per depth, all segments of the depth
        together, each starting from its parent's final state (gathered from the previous
        depth's ``[k, hv, dk, dv]`` final states; roots from zeros). Arguments and result as
        ``_delta_rule``'s; the outputs go back to source order by one gather."""
        outs, final = [], None
        for level in tree.levels:
            rows = level.rows
            initial = None
            if level.parent_slots is not None:
                initial = final.index_select(0, level.parent_slots)
            out, final = _gdn_common.chunk_gated_delta_rule(
                query.index_select(1, rows),
                key.index_select(1, rows),
                value.index_select(1, rows),
                g=decay.index_select(0, rows).unsqueeze(0),
                beta=beta.index_select(0, rows).unsqueeze(0),
                initial_state=initial,
                output_final_state=True,
                use_qk_l2norm_in_kernel=self.use_qk_l2norm,
                cu_seqlens=level.cu_seqlens,
                cu_seqlens_cpu=level.cu_seqlens_cpu,
            )
            outs.append(out)
        return torch.cat(outs, dim=1).index_select(1, tree.level_inverse)

    def _delta_rule_torch(self, query, key, value, decay, beta, tables: HeadShardRows) -> Tensor:
        """megatron-core's torch chunked rule, one call per packed sequence (it takes no
        ``cu_seqlens``); queries and keys repeated to the value heads as megatron does. Under a
        tree one call per segment in packed order (parents first), each starting from its
        parent's final state."""
        if self.use_qk_l2norm:
            query, key = _l2_normalised(query), _l2_normalised(key)
        repeat = value.shape[2] // query.shape[2]
        if repeat > 1:
            query = query.repeat_interleave(repeat, dim=2)
            key = key.repeat_interleave(repeat, dim=2)
        bounds = tables.cu_seqlens_cpu.tolist()
        parents = None if tables.tree is None else tables.tree.tree.parents
        outs, finals = [], []
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            piece = slice(start, end)
            initial = None if parents is None or parents[i] < 0 else finals[parents[i]]
            out, final = torch_chunk_gated_delta_rule(
                query[:, piece],
                key[:, piece],
                value[:, piece],
                g=decay[None, piece],
                beta=beta[None, piece],
                # One row per chunk: the rule as a plain recurrence. Its forward substitution
                # inside longer chunks loses fp32 precision (A_log / dt_bias gradients of tiny
                # models off by 1e-5 to 3e-5 relative at chunk 64 or 8); this CPU path is the
                # GPU path's oracle, so it favours precision over speed.
                chunk_size=1,
                initial_state=initial,
                output_final_state=parents is not None,
            )
            outs.append(out)
            finals.append(final)
        return torch.cat(outs, dim=1)

    def _gated_norm(self, blocks: Tensor, gate: Tensor, cp: int) -> Tensor:
        """megatron's gated output norm (``_apply_gated_norm``: ``out_norm(core) * act(gate)``
        per value head, in the core's dtype) on the head blocks the way back delivers, giving
        rows.

        ``blocks`` ``[cp * m, V / cp]``: block ``c`` the rule's output for head chunk ``c`` of
        ``m`` rows (at CP 1 the rows themselves); ``gate`` ``[m, V]`` (any float dtype, a
        strided view of the projected rows) of the same rows. Returns ``[m, V]``. The norm is
        per value head and per row, so it reads the blocks through a transposed view: on CUDA
        compiled by megatron's ``jit_fuser`` with the view inside the graph (forward and backward
        read and write the blocks in place); elsewhere, and for an empty shard, megatron's eager
        norm (``_eager_apply_gated_norm``), where the view costs one copy each way.
        """
        if blocks.device.type == "cuda" and gate.shape[0] > 0:
            return _compiled_gated_norm_of_blocks(self, blocks, gate, cp)
        return _eager_gated_norm_of_blocks(self, blocks, gate, cp)


def get_gated_delta_net_with_context_parallel_spec() -> ModuleSpec:
    """The mixer spec of a GDN layer from megatron-core's local modules (no TransformerEngine).

    ``ContextParallelGatedDeltaNet`` with ``ColumnParallelLinear`` in, ``WrappedTorchNorm`` (the
    config's normalization, per value head) as output norm and ``RowParallelLinear`` out: the
    counterpart of ``hybrid_stack_spec``'s GDN mixer, whose projections are TE modules. The
    layer around it normalises its input (``input_layernorm``), which TE fuses into ``in_proj``.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return ModuleSpec(
        module=ContextParallelGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear
        ),
    )
