"""The per-batch carrier every CP layer of a micro-batch reads: ``ContextParallelParams``.

Built once per micro-batch (``ContextParallelParams.for_plan``, or for you by
``context_parallel_batch``) and handed to ``GPTModel.forward`` / ``HybridModel.forward`` as
``packed_seq_params``: the plan, this rank's source positions and sequence indices, the rotary
rows at the local position ids, and the per-batch tables the attention and mixer layers share
(built on first use, on the host, so the per-layer path has no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor

from megatron.context_parallel.attention.blocks import AttentionBlocks, build_attention_tables
from megatron.context_parallel.attention.fused import stage_backward
from megatron.context_parallel.attention.rotary import (
    check_rotary_module,
    megatron_rotary_is_exact,
    rotary_at_positions,
    rotary_table_length,
    skip_marked_tables,
    skip_table_length,
)
from megatron.context_parallel.attention.runs import AttentionRuns
from megatron.context_parallel.attention.tree_tables import TreeTables
from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.tree import PrefixTree

__all__ = ["ContextParallelParams", "default_position_ids"]


def _sequence_index(seq_len: int, cu_seqlens: Optional[Sequence[int]]) -> Tensor:
    """int64 ``[seq_len]`` (CPU): the packed sequence each source position belongs to."""
    if cu_seqlens is None:
        return torch.zeros(seq_len, dtype=torch.int64)
    cu = torch.as_tensor(list(cu_seqlens), dtype=torch.int64)
    if cu.numel() < 1 or int(cu[-1]) != seq_len:
        raise ValueError(f"cu_seqlens must end at seq_len {seq_len}, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int64), lengths)


def default_position_ids(seq_len: int, cu_seqlens: Optional[Sequence[int]] = None) -> Tensor:
    """int64 ``[seq_len]`` (CPU): ``0 .. len-1`` within each packed sequence (the whole batch
    when ``cu_seqlens`` is None), the positions a single device would use."""
    if cu_seqlens is None:
        return torch.arange(seq_len, dtype=torch.int64)
    starts = torch.as_tensor(list(cu_seqlens[:-1]), dtype=torch.int64)
    sequence = _sequence_index(seq_len, cu_seqlens)
    return torch.arange(seq_len, dtype=torch.int64) - starts[sequence]


def _owned_position_ids(plan: ContextParallelPlan, position_ids: Tensor, rank: int) -> Tensor:
    """Position ids of rank ``rank``'s rows, with the one padding row of an empty rank (id 0)."""
    if plan.counts[rank] == 0:
        return position_ids.new_zeros(1)
    return position_ids.index_select(0, plan.local_positions(rank, position_ids.device))


def _batch_cu_seqlens(
    plan: ContextParallelPlan, cu_seqlens, tree: Optional[PrefixTree]
) -> Optional[Tuple[int, ...]]:
    """The batch's cumulative sequence lengths (given or the plan's), checked against both."""
    if tree is not None:
        if not isinstance(tree, PrefixTree):
            raise TypeError(f"tree must be a PrefixTree, got {type(tree).__name__}")
        tree.check_seq_len(plan.seq_len)
        if cu_seqlens is not None or plan.cu_seqlens is not None:
            raise ValueError(
                "a PrefixTree batch takes no cu_seqlens (its roots are the sequences); got "
                f"cu_seqlens with {tree}"
            )
        return None
    if cu_seqlens is None:
        return plan.cu_seqlens
    if isinstance(cu_seqlens, Tensor):
        cu_seqlens = cu_seqlens.tolist()
    cu = tuple(int(x) for x in cu_seqlens)
    if plan.cu_seqlens is not None and cu != plan.cu_seqlens:
        raise ValueError(f"cu_seqlens {list(cu)} differ from the plan's {list(plan.cu_seqlens)}")
    return cu


def _root_index(tree: PrefixTree) -> Tensor:
    """int64 ``[seq_len]`` (CPU): the root segment's index among the roots, per position."""
    root_of = []
    order = {}
    for i, parent in enumerate(tree.parents):
        if parent == -1:
            order[i] = len(order)
            root_of.append(i)
        else:
            root_of.append(root_of[parent])
    per_segment = torch.tensor([order[r] for r in root_of], dtype=torch.int64)
    return per_segment[tree.segment_index()]


def _check_position_ids(position_ids, seq_len: int) -> None:
    if (
        not isinstance(position_ids, Tensor)
        or position_ids.dim() != 1
        or position_ids.shape[0] != seq_len
        or position_ids.is_floating_point()
        or position_ids.dtype == torch.bool
    ):
        raise ValueError(
            f"position_ids must be [seq_len] = [{seq_len}] integers in source order, "
            f"got {getattr(position_ids, 'shape', type(position_ids).__name__)}"
        )


@dataclass
class ContextParallelParams(PackedSeqParams):
    """Per-batch CP information for the package's attention modules, as ``packed_seq_params``.

    Build it with ``for_plan``. ``qkv_format`` stays ``"sbhd"`` so megatron-core keeps the
    local rows in ``[s, b, ...]`` layout; the packing is described by the plan's (or the given)
    ``cu_seqlens``. ``max_seqlen_q`` / ``max_seqlen_kv`` are ``rotary_table_length(seq_len,
    cp_size)`` (the batch rounded up to a multiple of ``2 * cp_size``): ``GPTModel`` sizes (and
    zigzag-slices) its own rotary table from them, a table ``ContextParallelSelfAttention`` then
    replaces.

    Attributes:
        plan: the batch's ``ContextParallelPlan`` (same on every CP rank).
        rank: this rank's index in ``cp_group`` (``0`` for a group of one).
        query_positions: int64 ``[counts[rank]]``, source position of each local row.
        key_positions: int64 ``[cp_size * max_count]``, source position of each all-gather slot
            (-1 for padding).
        query_sequence: int64 ``[counts[rank]]``, packed-sequence index of each local row.
        key_sequence: int64 ``[cp_size * max_count]``, packed-sequence index of each slot (-1 for
            padding).
        position_ids: int64 ``[rows]``, the position id of each local row (the padding row of an
            empty rank: 0); ``rows = counts[rank] + padding_rows``.
        rotary_pos_emb: fp32 ``[rows, 1, 1, dim]``, the model's rotary rows at ``position_ids``,
            or None when built without ``rotary`` (models without rotary embeddings).
        source_position_ids: int ``[seq_len]``, the position ids of the whole batch in source
            order, as given (read on the host only to tell whether megatron-core's own rotary
            table is exact, ``megatron_rotary_exact``).
        source_cu_seqlens: the batch's cumulative sequence lengths (the plan's or the given
            ones) on the host, or None for one sequence.
        padding_rows: 1 when this rank owns no position, else 0. megatron-core's layers cannot
            run zero rows, so an empty rank runs one padding row that attends to nothing and
            that no query sees (its slot is padding); the batch adds it to the input and the
            output processor drops it.
        tree: the batch's ``PrefixTree``, or None for flat packing. Under a tree
            ``source_cu_seqlens`` is None and the ``*_sequence`` fields hold each position's
            root (its tree), so grouping by sequence keeps a tree's rows together.
        source_segment: int64 ``[seq_len]`` (CPU), the tree segment of each position; None
            without a tree.
    """

    qkv_format: str = "sbhd"
    plan: Optional[ContextParallelPlan] = None
    rank: int = 0
    query_positions: Optional[Tensor] = None
    key_positions: Optional[Tensor] = None
    query_sequence: Optional[Tensor] = None
    key_sequence: Optional[Tensor] = None
    position_ids: Optional[Tensor] = None
    rotary_pos_emb: Optional[Tensor] = None
    source_position_ids: Optional[Tensor] = None
    source_sequence: Optional[Tensor] = None
    padding_rows: int = 0
    source_cu_seqlens: Optional[Tuple[int, ...]] = None
    tree: Optional[PrefixTree] = None
    source_segment: Optional[Tensor] = None
    _masks: Dict[bool, Tensor] = field(default_factory=dict, repr=False, compare=False)
    _exact: Optional[bool] = field(default=None, repr=False, compare=False)
    _per_batch: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def for_plan(
        cls,
        plan: ContextParallelPlan,
        cp_group: Optional[dist.ProcessGroup] = None,
        *,
        device: Union[str, torch.device] = "cpu",
        cu_seqlens: Optional[Sequence[int]] = None,
        position_ids: Optional[Tensor] = None,
        rotary=None,
        megatron_table: bool = True,
        tree: Optional[PrefixTree] = None,
    ) -> "ContextParallelParams":
        """The params for one batch sharded by ``plan`` (no collective).

        Args:
            plan: the CP plan of the batch.
            cp_group: the CP process group the plan is for; None for a single rank.
            device: where the index tensors go (the activations' device).
            cu_seqlens: cumulative lengths of packed sequences; defaults to ``plan.cu_seqlens``.
                Attention never crosses a sequence boundary.
            position_ids: int ``[seq_len]`` position ids of the whole batch in source order;
                default ``default_position_ids(seq_len, cu_seqlens)`` (``tree.position_ids()``
                under a tree). A CPU tensor avoids one device-to-host copy when megatron-core's
                rotary table has to be checked.
            rotary: the model's ``RotaryEmbedding`` (``GPTModel.rotary_pos_emb``) to evaluate at
                the local rows' position ids; None for models without rotary embeddings.
            megatron_table: False when every layer is ``ContextParallelSelfAttention``, which
                replaces ``GPTModel``'s own rotary table by these rows: ``GPTModel`` then
                builds no table at all (``rotary.skip_marked_tables``), saving its work per
                micro-batch and its CUDA-only calls. Only with ``rotary``.
            tree: a ``PrefixTree`` packing of the batch (shared prefixes): a query sees the
                keys of its segment's ancestors and of its own segment up to itself. Excludes
                ``cu_seqlens`` (the tree's roots are the sequences).

        Raises:
            ValueError: the group size differs from ``plan.cp_size``; ``cu_seqlens`` does not
                match the plan's (or does not end at ``plan.seq_len``); ``position_ids`` is not
                ``[seq_len]`` integers; ``rotary`` is not a plain ``RotaryEmbedding``; a tree
                whose ``seq_len`` differs from the plan's, or a tree with ``cu_seqlens``.
        """
        if not isinstance(plan, ContextParallelPlan):
            raise TypeError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
        # None means one rank here, even inside a larger job (CP 1 of a DP x TP run).
        rank = plan.rank_in(cp_group) if cp_group is not None else plan.rank_in_single()
        cu = _batch_cu_seqlens(plan, cu_seqlens, tree)
        sequence = _sequence_index(plan.seq_len, cu) if tree is None else _root_index(tree)
        device = torch.device(device)
        if position_ids is None:
            position_ids = (
                default_position_ids(plan.seq_len, cu) if tree is None else tree.position_ids()
            )
        else:
            _check_position_ids(position_ids, plan.seq_len)
        local_ids = _owned_position_ids(plan, position_ids.to(device, torch.int64), rank)
        rows = None
        if rotary is not None:
            check_rotary_module(rotary)
            rows = rotary_at_positions(rotary, local_ids)
        queries = plan.local_positions(rank)
        slots = plan.slot_positions("cpu")
        key_sequence = torch.where(slots >= 0, sequence[slots.clamp(min=0)], -1)
        table = rotary_table_length(plan.seq_len, plan.cp_size)
        if rows is not None and not megatron_table:
            skip_marked_tables(rotary)
            table = skip_table_length(table)
        return cls(
            plan=plan,
            rank=rank,
            cp_group=cp_group,
            max_seqlen_q=table,
            max_seqlen_kv=table,
            query_positions=queries.to(device),
            key_positions=slots.to(device),
            query_sequence=sequence[queries].to(device),
            key_sequence=key_sequence.to(device),
            position_ids=local_ids,
            rotary_pos_emb=rows,
            source_position_ids=position_ids,
            source_sequence=sequence,
            padding_rows=1 if plan.counts[rank] == 0 else 0,
            source_cu_seqlens=cu,
            tree=tree,
            source_segment=None if tree is None else tree.segment_index(),
        )

    @property
    def megatron_rotary_exact(self) -> bool:
        """Whether ``GPTModel``'s own rotary rows are right for every rank's rows of this batch.

        ``GPTModel`` hands each rank the zigzag chunks of a table ``0 .. max_seqlen_q - 1``
        (all of it on one rank); that is each row's rotary embedding only when every rank's
        position ids are exactly those rows: Megatron's zigzag layout of one sequence whose
        position ids are ``0 .. S-1``. Computed once, on the host.
        """
        if self._exact is None:
            self._exact = megatron_rotary_is_exact(
                self.plan, self.source_position_ids, self.max_seqlen_q
            )
        return self._exact

    def per_batch(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()`` on the first call for ``key``, the same object on every later one.

        For index tables that every layer of one kind needs for this batch (the sequence
        mixers' row orders): built once per batch, shared by the layers.
        """
        value = self._per_batch.get(key)
        if value is None:
            value = build()
            self._per_batch[key] = value
        return value

    @property
    def runs(self) -> Union[AttentionRuns, AttentionBlocks, TreeTables]:
        """This rank's tables for the fused attention: run tables, blocked ones for plans that
        scatter the rank's rows, or tree tables under a ``PrefixTree`` (built on first use per
        batch, on the host, and shared by every layer; see ``runs``, ``blocks`` and
        ``tree_tables``)."""
        if self.tree is not None:
            return self.per_batch(
                "attention_runs",
                lambda: TreeTables.build(
                    self.plan, self.rank, self.tree, padding_rows=self.padding_rows
                ),
            )
        return self.per_batch(
            "attention_runs",
            lambda: build_attention_tables(
                self.plan, self.rank, self.source_sequence, padding_rows=self.padding_rows
            ),
        )

    def prepare(
        self,
        device: Optional[Union[str, torch.device]] = None,
        *,
        heads: Optional[int] = None,
        head_dim: Optional[int] = None,
    ) -> "ContextParallelParams":
        """Builds this batch's attention tables now (host), lays them out for their copy, and
        copies them to ``device``.

        The first attention layer would build them otherwise, on the host while the GPU runs
        the layers before it. Call this ahead to take that work off the step: in a data-loader
        thread, or for the next micro-batch while the current one runs. Only the host work runs
        off the calling thread safely: the build, and the layout of every table in one pinned
        host buffer (``stage``), which leaves the first layer one host-to-device copy and the
        device tables it derives from it (a dozen ops per kind of table for all the calls of a
        copy). The copy itself (``device``) belongs on the thread that launches the step's
        kernels. Idempotent: later calls and the layers reuse the tables.

        Args:
            device: copy the tables there too (on the step's thread).
            heads, head_dim: the query heads of the layers' attention on this rank and their
                width; given both, the backward's parts and windows for the default kernel
                (``fused.stage_backward``) are built and laid out too, which the first layer's
                backward otherwise does (host work growing with the calls: a few ms for the
                blocked layout at 131,072).

        Returns:
            ``self``.
        """
        tables = self.runs
        tables.stage()  # every kernel call's tables with the batch's
        if heads is not None and head_dim is not None:
            stage_backward(tables, heads, head_dim)
        if device is not None:
            tables.on(torch.device(device))
        return self

    def allowed(self, causal: bool) -> Tensor:
        """bool ``[rows, cp_size * max_count]``: which slots each local query row may see.

        ``rows = counts[rank] + padding_rows``; a padding row sees nothing. Built on first use
        per batch and shared by every layer.
        """
        mask = self._masks.get(causal)
        if mask is None:
            if self.tree is not None:
                if not causal:
                    raise ValueError(
                        f"a PrefixTree batch ({self.tree}) needs causal attention; got a "
                        "non-causal mask type"
                    )
                mask = self.tree.visible(self.query_positions, self.key_positions)
            else:
                keys = self.key_positions.unsqueeze(0)
                mask = (keys >= 0) & (
                    self.query_sequence.unsqueeze(1) == self.key_sequence.unsqueeze(0)
                )
                if causal:
                    mask = mask & (keys <= self.query_positions.unsqueeze(1))
            if self.padding_rows:
                mask = torch.cat([mask, mask.new_zeros(self.padding_rows, mask.shape[1])])
            self._masks[causal] = mask
        return mask
