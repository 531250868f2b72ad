"""Context parallelism that callers never see: full-sequence outputs in source order.

Public API:
    ContextParallelPlan: which CP rank owns which source positions, in local row order.
    gather_from_context_parallel_region: CP shards -> full tensors in source order, every rank.
    scatter_to_context_parallel_region: full tensor -> this rank's rows (the inverse).
    reduce_over_data_parallel: all-reduce over the pure data-parallel group.
"""

from megatron.context_parallel.mappings import (
    gather_from_context_parallel_region,
    reduce_over_data_parallel,
    scatter_to_context_parallel_region,
)
from megatron.context_parallel.plan import ContextParallelPlan

__version__ = "0.1.0"

__all__ = [
    "ContextParallelPlan",
    "gather_from_context_parallel_region",
    "scatter_to_context_parallel_region",
    "reduce_over_data_parallel",
]
