"""Attention for megatron-core's local layer spec under any CP plan, through ``GPTModel.forward``.

Two modules replace their megatron-core counterparts in a GPT layer spec
(``get_gpt_layer_with_context_parallel_spec``):

* ``ContextParallelSelfAttention`` (for ``SelfAttention``) applies rotary embeddings at each
  local row's *source* position, taken from the batch's ``ContextParallelParams``, instead of
  the table ``GPTModel`` slices in Megatron's zigzag order (right for that layout only).
* ``ContextParallelAttention`` (for ``DotProductAttention``, which refuses
  ``context_parallel_size > 1``) accepts any ``ContextParallelPlan``, uneven and empty shards
  included:

  1. the local keys and values are padded to ``plan.max_count`` rows and all-gathered over the
     CP group in one collective (backward: one reduce-scatter that sums dK, dV from every
     rank's queries and keeps this rank's rows);
  2. the local queries attend to every gathered key by *source* position: causal, and only
     within the same packed sequence when the plan (or the batch) carries ``cu_seqlens``, and
     under a ``PrefixTree`` only the keys of the query's segment and its ancestors; padding
     slots are never attended. On CUDA (fp16 / bf16, causal, dropout 0) this is a
     fused attention with no score matrix (``fused_attention``: the batch's run tables,
     ``runs``, over cuDNN's varlen kernel); otherwise, and as the tests' oracle, the
     dense computation in plain torch (memory ``O(local rows x all rows)`` per head). Tree
     batches run fused through ``tree_tables``.
     ``fused.select_backend`` decides, per call.

How the modules learn the batch: ``ContextParallelParams``, a ``PackedSeqParams`` subclass with
``qkv_format="sbhd"``, travels through ``GPTModel.forward`` as ``packed_seq_params`` (megatron
only reshapes for ``"thd"``, so the local rows stay ``[s, b, ...]``). It carries the plan, the CP
group, the rotary rows of the local rows and the source positions / sequence indices of the
query rows and of the gather slots, all built once per batch (``ContextParallelParams.for_plan``;
``context_parallel_batch`` builds it for you), so the per-layer
path has no host sync.

Where a combination cannot be right it raises ``ValueError`` naming the plan and the module
rather than computing on wrong positions: ``ContextParallelAttention`` under megatron-core's own
``SelfAttention`` (which applies ``GPTModel``'s zigzag-sliced rotary table) accepts only plans
for which that table is exact, and ``ContextParallelSelfAttention`` refuses
``ContextParallelParams`` with any core attention other than ``ContextParallelAttention``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide
from torch import Tensor

from megatron.context_parallel.attention.blocks import AttentionBlocks
from megatron.context_parallel.attention.fused import fused_attention, select_backend
from megatron.context_parallel.attention.runs import AttentionRuns
from megatron.context_parallel.comm.mappings import gather_padded_from_context_parallel_region
from megatron.context_parallel.params import ContextParallelParams

__all__ = [
    "ContextParallelSelfAttention",
    "ContextParallelAttention",
    "get_gpt_layer_with_context_parallel_spec",
]


def _check_shapes(query: Tensor, key: Tensor, value: Tensor) -> None:
    """ValueError unless query, key and value are ``[s, b, heads, dim]`` with equal ``s``."""
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
    GQA, dropout, fp32 / bf16 / fp16 (softmax in fp32). Causal calls on CUDA in fp16 / bf16
    with ``b == 1`` take the fused path (``fused.select_backend``), which refuses
    dropout > 0 with a ValueError (``set_attention_backend("dense")`` keeps the dense path).
    Sliding windows, softmax offsets and attention bias raise.

    Rotary embeddings are applied before this module, by its self-attention. Under
    ``ContextParallelSelfAttention`` they are right for any plan (that module sets
    ``rotary_at_source_positions``); under megatron-core's own ``SelfAttention`` they come from
    ``GPTModel``'s zigzag-sliced table, so only plans for which that table is exact
    (``ContextParallelParams.megatron_rotary_exact``) run, and any other plan raises.
    """

    # Set by ContextParallelSelfAttention, which applies rotary rows at source positions.
    rotary_at_source_positions: bool = False

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
        _check_shapes(query, key, value)
        if packed_seq_params is None:
            size = self.cp_group.size() if self.cp_group is not None else 1
            if size != 1:
                raise ValueError(
                    f"ContextParallelAttention on a CP group of {size} ranks needs "
                    "packed_seq_params=ContextParallelParams.for_plan(...) (see "
                    "megatron.context_parallel.models.forward.context_parallel_batch)"
                )
            allowed = self._single_rank_mask(query, attention_mask, causal)
            return self._attend(query, key, value, allowed)
        if not isinstance(packed_seq_params, ContextParallelParams):
            raise TypeError(
                "ContextParallelAttention needs packed_seq_params to be a ContextParallelParams "
                f"(or None on one rank), got {type(packed_seq_params).__name__}"
            )
        params = packed_seq_params
        group = params.cp_group if params.cp_group is not None else self.cp_group
        self._check_params(query, params, group)
        # One collective for K and V: they share rows, heads and dtype.
        kv = torch.cat([key, value], dim=-1)
        kv = gather_padded_from_context_parallel_region(kv, params.plan.max_count, group)
        if causal and self._backend(query) == "cudnn":
            return self._fused(query, kv, params.runs)
        keys, values = kv.split([key.shape[-1], value.shape[-1]], dim=-1)
        return self._attend(query, keys, values, params.allowed(causal)[None, None])

    def _check_params(self, query: Tensor, params: ContextParallelParams, group) -> None:
        """ValueError unless this rank's rows, the plan and the rotary source fit the batch."""
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
        if not self.rotary_at_source_positions and not params.megatron_rotary_exact:
            raise ValueError(
                f"ContextParallelAttention (layer {self.layer_number}) runs under a "
                "self-attention that applies GPTModel's own rotary table, which megatron-core "
                f"slices in zigzag order: wrong for the rows of {plan}. Build the layers with "
                "get_gpt_layer_with_context_parallel_spec() (ContextParallelSelfAttention "
                "applies rotary at source positions)"
            )

    def _backend(self, query: Tensor) -> str:
        dropout = self.attention_dropout.p if self.training else 0.0
        head_dim = self.hidden_size_per_attention_head
        return select_backend(query, head_dim, query.shape[1], dropout)

    def _fused(
        self, query: Tensor, kv_slots: Tensor, runs: Union[AttentionRuns, AttentionBlocks]
    ) -> Tensor:
        """The fused path: the run tables' kernel over the gathered slots (b == 1 here)."""
        sq = query.shape[0]
        context = fused_attention(
            query.flatten(1, 2),
            kv_slots.flatten(1, 2),
            runs,
            self.softmax_scale,
            deterministic=bool(getattr(self.config, "deterministic_mode", False)),
        )
        return context.view(sq, 1, self.hidden_size_per_partition)

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


class ContextParallelSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` with rotary embeddings at each row's source position.

    Same constructor and forward as ``SelfAttention``. When ``packed_seq_params`` is a
    ``ContextParallelParams`` and ``GPTModel`` passes a rotary table (rotary models), that table
    (megatron's zigzag slice) is replaced by the params' ``rotary_pos_emb``: the model's own
    rotary rows evaluated at every local row's position id, right for any plan. Layers that
    megatron-core runs without rotary (``no_rope_freq``) still get none. Any other
    ``packed_seq_params`` (None, TransformerEngine's THD params) passes through unchanged, so
    the module behaves exactly like ``SelfAttention`` outside CP.

    Raises (in forward, on every rank alike: the checks read only the batch's params):
        ValueError: ``ContextParallelParams`` with a core attention other than
            ``ContextParallelAttention`` (TransformerEngine would compute on its own fixed
            layout); or params without rotary rows for a plan where megatron-core's table is
            wrong (build them with ``rotary=model.rotary_pos_emb``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.core_attention, ContextParallelAttention):
            self.core_attention.rotary_at_source_positions = True

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        key_value_states: Optional[Tensor] = None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos: Optional[Tensor] = None,
        rotary_pos_sin: Optional[Tensor] = None,
        rotary_pos_cos_sin: Optional[Tensor] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        sequence_len_offset: Optional[int] = None,
        *,
        inference_params=None,
    ):
        """``SelfAttention.forward`` with the rotary rows of ``ContextParallelParams``."""
        if isinstance(packed_seq_params, ContextParallelParams):
            rotary_pos_emb = self._rotary_at_source_positions(rotary_pos_emb, packed_seq_params)
        return super().forward(
            hidden_states,
            attention_mask,
            key_value_states=key_value_states,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            inference_params=inference_params,
        )

    def _rotary_at_source_positions(self, table, params: ContextParallelParams):
        if not isinstance(self.core_attention, ContextParallelAttention):
            raise ValueError(
                f"ContextParallelParams (plan {params.plan}) need ContextParallelAttention as "
                f"core attention; layer {self.layer_number} has "
                f"{type(self.core_attention).__name__}, which would compute on its own fixed "
                "row layout (pass its own packed_seq_params instead)"
            )
        if table is None:
            return None  # no rotary embeddings in this model
        if params.rotary_pos_emb is not None:
            return params.rotary_pos_emb
        if params.megatron_rotary_exact:
            return table
        raise ValueError(
            f"ContextParallelParams for {params.plan} carry no rotary rows, and GPTModel's own "
            "rotary table (sliced in zigzag order) is wrong for these rows; build the params "
            "with ContextParallelParams.for_plan(..., rotary=model.rotary_pos_emb) or "
            "megatron.context_parallel.models.forward.context_parallel_batch"
        )


def get_gpt_layer_with_context_parallel_spec(**kwargs) -> ModuleSpec:
    """megatron-core's local GPT layer spec with the package's attention modules.

    ``ContextParallelSelfAttention`` replaces ``SelfAttention`` (rotary at source positions)
    and ``ContextParallelAttention`` replaces the core attention (any plan: fused cuDNN
    attention on GPUs, the dense computation on CPU).

    Args:
        **kwargs: passed to ``megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec``
            (``qk_layernorm``, ``normalization``, ``num_experts``, ...). Multi-latent attention
            is not supported.

    Returns:
        A ``ModuleSpec`` of ``TransformerLayer`` whose self-attention is the package's.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if kwargs.get("multi_latent_attention"):
        raise ValueError("get_gpt_layer_with_context_parallel_spec does not support MLA")
    spec = get_gpt_layer_local_spec(**kwargs)
    attention = spec.submodules.self_attention
    if attention.module is not SelfAttention:
        raise ValueError(f"expected SelfAttention in the local spec, got {attention.module}")
    attention = dataclasses.replace(
        attention,
        module=ContextParallelSelfAttention,
        submodules=dataclasses.replace(
            attention.submodules, core_attention=ContextParallelAttention
        ),
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )
