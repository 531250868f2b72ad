"""The public surface: ``megatron.context_parallel`` and its ``__all__`` stay as documented.

Every name resolves (the model-level ones load lazily), and the list is pinned, so a rename or a
dropped export is a deliberate change of this test rather than an accident of a refactor.
"""

import megatron.context_parallel as cp

PUBLIC = {
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
    "ContextParallelBatch",
    "context_parallel_batch",
    "context_parallel_forward",
    "default_plan",
    "ContextParallelSelfAttention",
    "ContextParallelAttention",
    "ContextParallelParams",
    "get_gpt_layer_with_context_parallel_spec",
    "get_hybrid_stack_with_context_parallel_spec",
    "ContextParallelHybridStack",
    "ContextParallelGatedDeltaNet",
    "HeadShardRows",
    "get_gated_delta_net_with_context_parallel_spec",
    "set_attention_backend",
    "AttentionRuns",
}


def test_all_is_pinned():
    assert set(cp.__all__) == PUBLIC
    assert len(cp.__all__) == len(set(cp.__all__))


def test_every_public_name_resolves():
    for name in cp.__all__:
        assert getattr(cp, name) is not None, name
    assert set(cp.__all__) <= set(dir(cp))
