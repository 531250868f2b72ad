"""Context parallelism that callers never see: full-sequence outputs in source order.

Public API:
    ContextParallelPlan: which CP rank owns which source positions, in local row order.
    PrefixTree, tree_plan, plan_balance: shared-prefix (tree) packing of a batch, its default
        plan (attention work and tokens balanced over the ranks) and that balance.
    gather_from_context_parallel_region: CP shards -> full tensors in source order, every rank.
    scatter_to_context_parallel_region: full tensor -> this rank's rows (the inverse).
    reduce_over_data_parallel: all-reduce over the pure data-parallel group.
    ForwardOutput, TopK, OutputOptions, compute_forward_output, make_output_processor: the
        output head (OutputOptions: the output options every entry point shares).
    InputError: the ValueError every rank of a call raises alike for any rank's bad input.
    context_parallel_batch, ContextParallelBatch: everything the model's forward needs on this
        rank for a plan (local ids and positions, packed_seq_params, output_processor).
    context_parallel_forward, default_plan: a megatron-core GPTModel or HybridModel forward
        under CP.
    ContextParallelSelfAttention, ContextParallelAttention, ContextParallelParams,
    get_gpt_layer_with_context_parallel_spec: megatron-core's local layer spec with rotary at
        source positions and a CP core attention for any plan (fused cuDNN on GPUs, dense on CPU).
    get_hybrid_stack_with_context_parallel_spec, ContextParallelHybridStack: the counterpart
        of megatron-core's hybrid_stack_spec for HybridModel under any plan (local modules).
    ContextParallelGatedDeltaNet, HeadShardRows, get_gated_delta_net_with_context_parallel_spec:
        megatron-core's Gated DeltaNet for any plan (rows to head shards in source order and
        back), its per-batch index tables, and its mixer spec from local modules.

The model-level names import megatron-core's transformer stack, so they load on first use;
``import megatron.context_parallel`` itself stays light.
"""

import importlib

from megatron.context_parallel.comm.errors import InputError
from megatron.context_parallel.comm.mappings import (
    gather_from_context_parallel_region,
    reduce_over_data_parallel,
    scatter_to_context_parallel_region,
)
from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.head.output import (
    FIELDS,
    IGNORE_INDEX,
    ForwardOutput,
    OutputOptions,
    TopK,
    compute_forward_output,
    make_output_processor,
)
from megatron.context_parallel.tree import PrefixTree, plan_balance, tree_plan

__version__ = "0.1.0"

_LAZY = {
    "ContextParallelBatch": "megatron.context_parallel.models.forward",
    "context_parallel_batch": "megatron.context_parallel.models.forward",
    "context_parallel_forward": "megatron.context_parallel.models.forward",
    "default_plan": "megatron.context_parallel.models.forward",
    "ContextParallelSelfAttention": "megatron.context_parallel.attention.layers",
    "ContextParallelAttention": "megatron.context_parallel.attention.layers",
    "ContextParallelParams": "megatron.context_parallel.params",
    "get_gpt_layer_with_context_parallel_spec": "megatron.context_parallel.attention.layers",
    "get_hybrid_stack_with_context_parallel_spec": "megatron.context_parallel.models.hybrid",
    "ContextParallelHybridStack": "megatron.context_parallel.models.hybrid",
    "ContextParallelGatedDeltaNet": "megatron.context_parallel.mixers.gdn",
    "HeadShardRows": "megatron.context_parallel.mixers.gdn",
    "get_gated_delta_net_with_context_parallel_spec": "megatron.context_parallel.mixers.gdn",
    "set_attention_backend": "megatron.context_parallel.attention.fused",
    "AttentionRuns": "megatron.context_parallel.attention.runs",
}

__all__ = [
    "ContextParallelPlan",
    "PrefixTree",
    "tree_plan",
    "plan_balance",
    "gather_from_context_parallel_region",
    "scatter_to_context_parallel_region",
    "reduce_over_data_parallel",
    "FIELDS",
    "IGNORE_INDEX",
    "ForwardOutput",
    "OutputOptions",
    "InputError",
    "TopK",
    "compute_forward_output",
    "make_output_processor",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'megatron.context_parallel' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
