"""A reference context-parallel core attention for megatron-core's local layer spec.

``ContextParallelAttention`` takes the place of megatron-core's ``DotProductAttention`` (which
refuses ``context_parallel_size > 1``) as the ``core_attention`` of a GPT layer. It runs in
plain torch on any device and accepts any ``ContextParallelPlan``, uneven and empty shards
included:

1. the local keys and values are padded to ``plan.max_count`` rows and all-gathered over the CP
   group in one collective (backward: one reduce-scatter that sums dK, dV from every rank's
   queries and keeps this rank's rows);
2. the local queries attend to every gathered key, masked by *source* positions: causal by
   position, and only within the same packed sequence when the plan (or the batch) carries
   ``cu_seqlens``; padding slots are never attended.

It is the backend that makes CP testable without TransformerEngine; it does not try to compete
with ring attention (memory is ``O(local rows x all rows)`` per head).

How the module learns the batch: ``ContextParallelParams``, a ``PackedSeqParams`` subclass with
``qkv_format="sbhd"``, travels through ``GPTModel``'s decoder as ``packed_seq_params`` (megatron
only reshapes for ``"thd"``, so the local rows stay ``[s, b, ...]``). It carries the plan, the CP
group and the source positions / sequence indices of the query rows and of the gather slots, all
built once per batch on the host (``ContextParallelParams.for_plan``), so the per-layer path has
no host sync. ``megatron.context_parallel.model.context_parallel_forward`` builds it for you.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor

from megatron.context_parallel.mappings import gather_padded_from_context_parallel_region
from megatron.context_parallel.plan import ContextParallelPlan

__all__ = [
    "ContextParallelParams",
    "ContextParallelAttention",
    "get_gpt_layer_with_context_parallel_spec",
]


def _sequence_index(seq_len: int, cu_seqlens: Optional[Sequence[int]]) -> Tensor:
    """int64 ``[seq_len]`` (CPU): the packed sequence each source position belongs to."""
    if cu_seqlens is None:
        return torch.zeros(seq_len, dtype=torch.int64)
    cu = torch.as_tensor(list(cu_seqlens), dtype=torch.int64)
    if cu.numel() < 1 or int(cu[-1]) != seq_len:
        raise ValueError(f"cu_seqlens must end at seq_len {seq_len}, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int64), lengths)


@dataclass
class ContextParallelParams(PackedSeqParams):
    """Per-batch CP information for ``ContextParallelAttention``, passed as ``packed_seq_params``.

    Build it with ``for_plan``. ``qkv_format`` stays ``"sbhd"`` so megatron-core keeps the
    local rows in ``[s, b, ...]`` layout; the packing is described by ``cu_seqlens`` and the plan.

    Attributes:
        plan: the batch's ``ContextParallelPlan`` (same on every CP rank).
        rank: this rank's index in ``cp_group`` (``0`` for a group of one).
        query_positions: int64 ``[counts[rank]]``, source position of each local row.
        key_positions: int64 ``[cp_size * max_count]``, source position of each all-gather slot
            (-1 for padding).
        query_sequence: int64 ``[counts[rank]]``, packed-sequence index of each local row.
        key_sequence: int64 ``[cp_size * max_count]``, packed-sequence index of each slot (-1 for
            padding).
        sequence_cu_seqlens: the host-side ``cu_seqlens`` the mask was built from (or None).
        padding_rows: 1 when this rank owns no position, else 0. megatron-core's layers cannot
            run zero rows, so an empty rank runs one padding row that attends to nothing and
            that no query sees (its slot is padding); ``context_parallel_forward`` adds it to
            the input and drops it from the output.
    """

    qkv_format: str = "sbhd"
    plan: Optional[ContextParallelPlan] = None
    rank: int = 0
    query_positions: Optional[Tensor] = None
    key_positions: Optional[Tensor] = None
    query_sequence: Optional[Tensor] = None
    key_sequence: Optional[Tensor] = None
    sequence_cu_seqlens: Optional[Tuple[int, ...]] = None
    padding_rows: int = 0
    _masks: Dict[bool, Tensor] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def for_plan(
        cls,
        plan: ContextParallelPlan,
        cp_group: Optional[dist.ProcessGroup] = None,
        *,
        device: Union[str, torch.device] = "cpu",
        cu_seqlens: Optional[Sequence[int]] = None,
    ) -> "ContextParallelParams":
        """The params for one batch sharded by ``plan`` (host-side work only, no collective).

        Args:
            plan: the CP plan of the batch.
            cp_group: the CP process group the plan is for; None for a single rank.
            device: where the index tensors go (the activations' device).
            cu_seqlens: cumulative lengths of packed sequences; defaults to ``plan.cu_seqlens``.
                Attention never crosses a sequence boundary.

        Raises:
            ValueError: the group size differs from ``plan.cp_size``, or ``cu_seqlens`` does not
                match the plan's (or does not end at ``plan.seq_len``).
        """
        if not isinstance(plan, ContextParallelPlan):
            raise TypeError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
        # None means one rank here, even inside a larger job (CP 1 of a DP x TP run).
        rank = plan.rank_in(cp_group) if cp_group is not None else plan.rank_in_single()
        if cu_seqlens is None:
            cu = plan.cu_seqlens
        else:
            if isinstance(cu_seqlens, Tensor):
                cu_seqlens = cu_seqlens.tolist()
            cu = tuple(int(x) for x in cu_seqlens)
            if plan.cu_seqlens is not None and cu != plan.cu_seqlens:
                raise ValueError(
                    f"cu_seqlens {list(cu)} differ from the plan's {list(plan.cu_seqlens)}"
                )
        sequence = _sequence_index(plan.seq_len, cu)
        queries = plan.local_positions(rank)
        slots = plan.slot_positions("cpu")
        key_sequence = torch.where(slots >= 0, sequence[slots.clamp(min=0)], -1)
        device = torch.device(device)
        return cls(
            plan=plan,
            rank=rank,
            cp_group=cp_group,
            query_positions=queries.to(device),
            key_positions=slots.to(device),
            query_sequence=sequence[queries].to(device),
            key_sequence=key_sequence.to(device),
            sequence_cu_seqlens=cu,
            padding_rows=1 if plan.counts[rank] == 0 else 0,
        )

    def allowed(self, causal: bool) -> Tensor:
        """bool ``[rows, cp_size * max_count]``: which slots each local query row may see.

        ``rows = counts[rank] + padding_rows``; a padding row sees nothing. Built on first use
        per batch and shared by every layer.
        """
        mask = self._masks.get(causal)
        if mask is None:
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


class ContextParallelAttention(MegatronModule):
    """Core attention over a CP group for any plan: all-gather K, V; mask by source position.

    Drop-in for megatron-core's ``DotProductAttention`` as ``core_attention`` of a layer spec
    (same constructor). Inputs are this rank's rows in its plan order:

    * query ``[sq, b, np, hn]``, key / value ``[sq, b, ng, hn]`` (``np``, ``ng``: heads and query
      groups of this TP rank; ``sq = plan.counts[rank]``, possibly 0),
    * ``packed_seq_params``: a ``ContextParallelParams`` for the batch. It may be None only when
      the CP group has one rank; then rows are positions ``0 .. sq-1`` of one sequence and
      ``attention_mask`` (bool, True = masked, broadcastable to ``[b, np, sq, sq]``) is honoured
      like ``DotProductAttention`` does.

    Returns the context ``[sq, b, np * hn]``. Gradients: dQ stays local; dK, dV of every rank's
    queries are summed onto the owning rank by the reduce-scatter of the gather's backward.
    Supports causal and unmasked (``no_mask`` / ``padding`` without a mask) self-attention,
    GQA, dropout, fp32 / bf16 / fp16 (softmax in fp32). Sliding windows, softmax offsets and
    attention bias raise.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)

        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        # apply_query_key_layer_scaling divides the scale by layer_number and multiplies the
        # fp32 scores back by it in megatron; in exact arithmetic that is the plain scale.
        self.softmax_scale = (
            1.0 / math.sqrt(self.hidden_size_per_attention_head)
            if softmax_scale is None
            else softmax_scale
        )
        windowed = is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number
        )
        if windowed:
            raise ValueError(
                f"ContextParallelAttention does not support sliding windows "
                f"(window_size={config.window_size})"
            )
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"ContextParallelAttention supports softmax_type='vanilla' only, got "
                f"{config.softmax_type!r}"
            )
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Attention of the local queries against the keys of every CP rank (see the class)."""
        if attention_bias is not None:
            raise ValueError("ContextParallelAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding):
            raise ValueError(f"ContextParallelAttention does not support {mask_type}")
        causal = mask_type == AttnMaskType.causal
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                f"expected query/key/value as [s, b, heads, dim], got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
            raise ValueError(
                f"self-attention needs as many key/value rows as query rows, got "
                f"{query.shape[0]}, {key.shape[0]}, {value.shape[0]}"
            )

        if packed_seq_params is None:
            size = self.cp_group.size() if self.cp_group is not None else 1
            if size != 1:
                raise ValueError(
                    f"ContextParallelAttention on a CP group of {size} ranks needs "
                    "packed_seq_params=ContextParallelParams.for_plan(...) (see "
                    "megatron.context_parallel.model.context_parallel_forward)"
                )
            keys, values = key, value
            allowed = self._single_rank_mask(query, attention_mask, causal)
        elif isinstance(packed_seq_params, ContextParallelParams):
            params = packed_seq_params
            group = params.cp_group if params.cp_group is not None else self.cp_group
            plan = params.plan
            plan.rank_in(group)
            rows = plan.counts[params.rank] + params.padding_rows
            if query.shape[0] != rows:
                raise ValueError(
                    f"rank {params.rank} got {query.shape[0]} rows but the plan gives it "
                    f"{plan.counts[params.rank]} (+{params.padding_rows} padding; plan counts "
                    f"{plan.counts})"
                )
            if plan.max_count < rows:
                raise ValueError(f"a plan with no owned position cannot run (counts {plan.counts})")
            # One collective for K and V: they share rows, heads and dtype.
            kv = torch.cat([key, value], dim=-1)
            kv = gather_padded_from_context_parallel_region(kv, plan.max_count, group)
            keys, values = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
            allowed = params.allowed(causal)[None, None]
        else:
            raise TypeError(
                "ContextParallelAttention needs packed_seq_params to be a ContextParallelParams "
                f"(or None on one rank), got {type(packed_seq_params).__name__}"
            )
        return self._attend(query, keys, values, allowed)

    def _single_rank_mask(
        self, query: Tensor, attention_mask: Optional[Tensor], causal: bool
    ) -> Optional[Tensor]:
        """``[.., sq, sq]`` bool of allowed pairs for the params-less single-rank path."""
        if attention_mask is not None:
            return ~attention_mask.to(torch.bool)
        if not causal:
            return None
        n = query.shape[0]
        rows = torch.arange(n, device=query.device)
        return (rows.unsqueeze(0) <= rows.unsqueeze(1))[None, None]

    def _attend(
        self, query: Tensor, key: Tensor, value: Tensor, allowed: Optional[Tensor]
    ) -> Tensor:
        sq, b = query.shape[0], query.shape[1]
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 3, 0)  # [b, np, hn, sk]
        v = value.permute(1, 2, 0, 3)  # [b, np, sk, hn]
        scores = torch.matmul(q, k).float() * self.softmax_scale
        if allowed is not None:
            # The most negative finite value rather than -inf: a row with nothing allowed
            # (impossible for owned rows, which always see themselves) must not turn into NaN.
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        if self.training and self.attention_dropout.p > 0:
            if self.config.sequence_parallel:
                probs = self.attention_dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def get_gpt_layer_with_context_parallel_spec(**kwargs) -> ModuleSpec:
    """megatron-core's local GPT layer spec with ``ContextParallelAttention`` as core attention.

    Args:
        **kwargs: passed to ``megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec``
            (``qk_layernorm``, ``normalization``, ``num_experts``, ...). Multi-latent attention
            is not supported.

    Returns:
        A ``ModuleSpec`` of ``TransformerLayer`` whose self-attention uses the CP core attention.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention

    if kwargs.get("multi_latent_attention"):
        raise ValueError("get_gpt_layer_with_context_parallel_spec does not support MLA")
    spec = get_gpt_layer_local_spec(**kwargs)
    attention = spec.submodules.self_attention
    if attention.module is not SelfAttention:
        raise ValueError(f"expected SelfAttention in the local spec, got {attention.module}")
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(
            attention.submodules, core_attention=ContextParallelAttention
        ),
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )
