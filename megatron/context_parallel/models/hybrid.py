"""megatron-core ``HybridModel`` under CP for any plan: the layer stack spec and the head.

``HybridModel`` (megatron/core/models/hybrid/) builds dense, MoE, Mamba and Gated DeltaNet
models from one layer pattern (``*`` attention, ``-`` MLP, ``E`` MoE, ``G`` GDN, ``M`` Mamba).
Two things keep it from the package's GPTModel path, and this module supplies both:

* **The stack.** megatron-core's ``hybrid_stack_spec`` is built from TransformerEngine modules,
  whose attention runs only its own fixed CP layouts. ``get_hybrid_stack_with_context_parallel_
  spec()`` is its counterpart from megatron-core's local modules: attention layers are the
  package's ``ContextParallelSelfAttention`` + ``ContextParallelAttention`` (rotary at source
  positions, any plan), MLP and MoE layers megatron's own (they act on each row alone, so any
  plan is right). ``ContextParallelHybridStack`` is ``HybridStack`` with a local final norm
  (megatron builds ``TENorm`` there, which needs TransformerEngine).
* **The head.** ``HybridModel.forward`` has no ``output_processor``: after the stack it always
  runs the full output layer. ``attach_head(model)`` (``context_parallel_batch`` calls it, once
  per model) registers two hooks on the ``HybridModel`` itself. The forward pre-hook takes the
  ``output_processor`` keyword out of the call and, for that call only, lets the model stop
  after its stack (``post_process`` off), so no vocabulary-wide logits are formed; the forward
  hook puts ``post_process`` back and hands the final hidden rows to the processor with the
  model's output layer, as ``GPTModel.forward`` does. The model stays megatron's class, called
  as ``model(**batch.forward_kwargs())`` through DDP, ``Float16Module``, pipeline stages and
  megatron's schedules; a call without ``output_processor`` is ``HybridModel.forward``
  unchanged.

Layers that cannot run a plan raise ``ValueError`` naming the plan and the layer before the
model runs (``check_layers``): the package's Gated DeltaNet runs any plan whose CP size divides
its heads; megatron-core's own ``GatedDeltaNet`` and Mamba mixer undo
Megatron's zigzag layout before their recurrence, so under CP they accept only
``ContextParallelPlan.zigzag`` of one sequence, and at any CP size they treat the batch as one
sequence (the package's params carry the packing in the plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

import torch
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from megatron.context_parallel.attention.layers import get_gpt_layer_with_context_parallel_spec
from megatron.context_parallel.comm.plan import ContextParallelPlan
from megatron.context_parallel.mixers.gdn import (
    ContextParallelGatedDeltaNet,
    get_gated_delta_net_with_context_parallel_spec,
)

__all__ = [
    "ContextParallelHybridStack",
    "ContextParallelHybridStackSubmodules",
    "get_hybrid_stack_with_context_parallel_spec",
    "attach_head",
    "is_hybrid_model",
    "check_layers",
    "attention_layers",
]


# ---------------------------------------------------------------------------------------------
# The stack.


@dataclass
class ContextParallelHybridStackSubmodules(HybridStackSubmodules):
    """``HybridStackSubmodules`` plus the final norm's module (megatron hard-codes ``TENorm``).

    Attributes:
        final_norm: builder of the norm after the last layer, called as
            ``final_norm(config=, hidden_size=, eps=)`` (``LayerNorm`` / ``RMSNorm`` by
            ``config.normalization``).
    """

    final_norm: Any = IdentityOp


class ContextParallelHybridStack(HybridStack):
    """megatron-core's ``HybridStack`` with its final norm built from the spec.

    Same constructor and forward as ``HybridStack``; ``submodules`` is a
    ``ContextParallelHybridStackSubmodules``. Only the final norm's module differs (megatron
    builds TransformerEngine's ``TENorm``, so the stack could not be built without TE).
    """

    def __init__(self, config, submodules, *args, post_layer_norm: bool = True, **kwargs):
        if not isinstance(submodules, ContextParallelHybridStackSubmodules):
            raise TypeError(
                "ContextParallelHybridStack needs ContextParallelHybridStackSubmodules, got "
                f"{type(submodules).__name__}"
            )
        # The parent would build TENorm; build none there and ours here.
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = build_module(
                submodules.final_norm,
                config=self.config,
                hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )


class _PendingLayer(torch.nn.Module):
    """Stands in for a layer kind the package does not run yet: building it raises."""

    symbol = "?"
    kind = "layer"

    def __init__(self, *args, **kwargs):
        raise ValueError(
            f"layer symbol {self.symbol!r} ({self.kind}) is not supported by "
            "get_hybrid_stack_with_context_parallel_spec() yet: its recurrence would run over "
            "a CP rank's rows in plan order instead of source order"
        )


class _PendingMamba(_PendingLayer):
    symbol, kind = Symbols.MAMBA, "Mamba"


def get_hybrid_stack_with_context_parallel_spec(
    *, normalization: Optional[str] = None, qk_layernorm: bool = False
) -> ModuleSpec:
    """The counterpart of megatron-core's ``hybrid_stack_spec`` for CP under any plan.

    Built from megatron-core's local modules (no TransformerEngine):

    * ``*``: ``TransformerLayer`` with a norm, ``ContextParallelSelfAttention`` (rotary at each
      row's source position; ``config.attention_output_gate`` as megatron's ``SelfAttention``
      applies it) and ``ContextParallelAttention`` (any plan);
    * ``-``: megatron's ``MLPLayer`` with a norm and the local ``MLP``;
    * ``E``: megatron's ``MoETransformerLayer`` with the local MoE (``SequentialMLP`` experts):
      routing is per token, so with dropless routing (no ``moe_expert_capacity_factor``) any
      plan is right; a capacity factor under CP raises (``check_layers``). Auxiliary
      load-balancing losses are megatron's own (each rank's tokens, global counts);
    * ``G``: ``TransformerLayer`` with a norm and ``ContextParallelGatedDeltaNet`` (megatron's
      GDN with its exchange replaced: rows to head shards in source order, convolution and
      gated delta rule per packed sequence, any plan; key and value heads per TP rank must
      divide by CP). megatron's TE spec fuses that norm into ``in_proj``;
    * ``M``: not yet; building a model whose pattern has it raises ``ValueError``.

    Args:
        normalization: ``"RMSNorm"`` or None / ``"LayerNorm"``, as for megatron's local GPT
            spec; the model's ``config.normalization`` must agree.
        qk_layernorm: normalise queries and keys per head in attention layers.

    Returns:
        A ``ModuleSpec`` of ``ContextParallelHybridStack`` for ``HybridModel(config, spec,
        ...)``.
    """
    dense = get_gpt_layer_with_context_parallel_spec(
        normalization=normalization, qk_layernorm=qk_layernorm
    ).submodules
    experts = get_gpt_layer_with_context_parallel_spec(
        normalization=normalization, num_experts=1, moe_grouped_gemm=False
    ).submodules
    norm = dense.input_layernorm
    attention_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=dense.self_attention,
            self_attn_bda=dense.self_attn_bda,
        ),
    )
    mlp_layer = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda
        ),
    )
    moe_layer = ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=experts.pre_mlp_layernorm, mlp=experts.mlp, mlp_bda=experts.mlp_bda
        ),
    )
    gdn_layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=get_gated_delta_net_with_context_parallel_spec(),
            self_attn_bda=dense.self_attn_bda,
        ),
    )
    return ModuleSpec(
        module=ContextParallelHybridStack,
        submodules=ContextParallelHybridStackSubmodules(
            mamba_layer=_PendingMamba,
            gdn_layer=gdn_layer,
            attention_layer=attention_layer,
            mlp_layer=mlp_layer,
            moe_layer=moe_layer,
            final_norm=norm,
        ),
    )


# ---------------------------------------------------------------------------------------------
# The model's layers under a plan.


def is_hybrid_model(model) -> bool:
    """Whether ``model`` (already unwrapped) is a megatron-core ``HybridModel`` or a stage."""
    return isinstance(model, HybridModel)


def attention_layers(hybrid) -> List[torch.nn.Module]:
    """The layers of ``hybrid``'s stack that hold softmax attention (pattern symbol ``*``)."""
    return [
        layer
        for symbol, layer in zip(hybrid.decoder.layer_type_list, hybrid.decoder.layers)
        if symbol == Symbols.ATTENTION
    ]


def _megatron_mixer(layer) -> Optional[str]:
    """The name of megatron-core's own GDN / Mamba module in ``layer``, or None.

    Exact types: a subclass (a CP module built on megatron's) states its own plan support.
    """
    from megatron.core.ssm.gated_delta_net.gdn import GatedDeltaNet
    from megatron.core.ssm.mamba_mixer import MambaMixer

    for module in (getattr(layer, "self_attention", None), getattr(layer, "mixer", None)):
        if type(module) in (GatedDeltaNet, MambaMixer):
            return type(module).__name__
    return None


def check_layers(hybrid, plan: ContextParallelPlan, cu_seqlens, tree=None) -> None:
    """ValueError naming the plan and the layer when a layer of ``hybrid`` would mix rows in
    the wrong order under ``plan``; TypeError for layer kinds the package cannot place.

    Attention layers are checked by the batch with the GPTModel rules; MLP layers act on each
    row alone, and so do MoE layers with dropless routing (with a capacity factor, each CP
    rank drops its own tokens: refused under CP). megatron-core's own ``GatedDeltaNet`` /
    ``MambaMixer`` get the batch as one sequence in Megatron's zigzag layout (they undo it
    before the recurrence), so: no packing (no tree of several segments either), and under
    CP exactly ``ContextParallelPlan.zigzag(S, cp)``; at CP 1 rows in source order.
    """
    decoder = hybrid.decoder
    for symbol, layer in zip(decoder.layer_type_list, decoder.layers):
        if symbol in (Symbols.DS_ATTENTION, Symbols.MLA):
            raise TypeError(
                f"layer {layer.layer_number} ({symbol!r}, {type(layer).__name__}): "
                "multi-latent and sparse attention do not run under the package's CP"
            )
        capacity = getattr(hybrid.config, "moe_expert_capacity_factor", None)
        if symbol == Symbols.MOE and plan.cp_size > 1 and capacity is not None:
            raise ValueError(
                f"layer {layer.layer_number} ('E', MoE) drops tokens beyond capacity factor "
                f"{capacity} per CP rank, so which tokens survive depends on the plan; got "
                f"{plan}. Run CP with dropless routing (moe_expert_capacity_factor=None)"
            )
        mixer = getattr(layer, "self_attention", None)
        if isinstance(mixer, ContextParallelGatedDeltaNet):
            # Any plan; its heads must split over this CP size (same config on every rank).
            mixer.check_heads(plan.cp_size)
            continue
        name = _megatron_mixer(layer)
        if name is None:
            continue
        packed = (cu_seqlens is not None and len(cu_seqlens) > 2) or (
            tree is not None and tree.num_segments > 1
        )
        if plan.cp_size == 1:
            expected = ContextParallelPlan.contiguous(plan.seq_len, 1)
        elif plan.seq_len % (2 * plan.cp_size) == 0:
            expected = ContextParallelPlan.zigzag(plan.seq_len, plan.cp_size)
        else:
            expected = None
        in_layout = expected is not None and all(
            torch.equal(plan.local_positions(r), expected.local_positions(r))
            for r in range(plan.cp_size)
        )
        if packed or not in_layout:
            layout = "one sequence, rows in order" if plan.cp_size == 1 else "zigzag"
            raise ValueError(
                f"layer {layer.layer_number} ({symbol!r}, megatron-core's {name}) runs its "
                f"recurrence over Megatron's {layout} layout of one sequence only; got {plan}"
                f"{' with packed sequences' if packed else ''}"
            )


# ---------------------------------------------------------------------------------------------
# The head.

_ATTACHED = "_context_parallel_head_hooks"


def _take_output_processor(model, args, kwargs):
    processor = kwargs.pop("output_processor", None)
    calls = getattr(model, _ATTACHED)
    # One entry per call in flight, so a nested call of the same model keeps its own.
    calls.append((processor, model.post_process))
    if processor is not None:
        model.post_process = False
    return args, kwargs


def _apply_output_processor(model, args, kwargs, output):
    processor, post_process = getattr(model, _ATTACHED).pop()
    model.post_process = post_process
    if processor is None or not post_process or output is None:
        return output
    output_weight = None
    if model.share_embeddings_and_output_weights:
        output_weight = model.shared_embedding_or_output_weight()
    return processor(
        hidden_states=output,
        output_layer=model.output_layer,
        output_weight=output_weight,
        config=model.config,
    )


def attach_head(model) -> None:
    """Lets ``model(..., output_processor=p)`` return ``p``'s result on a ``HybridModel``.

    Idempotent; ``context_parallel_batch`` calls it. ``model`` is the unwrapped
    ``HybridModel`` (or pipeline stage). With ``output_processor`` given, the call runs the
    embedding and the stack as ``HybridModel.forward`` does and, on the last stage, returns
    ``output_processor(hidden_states=[n, 1, H], output_layer=model.output_layer,
    output_weight=(the shared embedding weight or None), config=model.config)`` instead of
    running the output layer; earlier stages return the hidden rows as before. Without it the
    call is ``HybridModel.forward`` unchanged. Gradients flow through the processor as through
    any module output.
    """
    if not is_hybrid_model(model):
        raise TypeError(f"attach_head needs a megatron-core HybridModel, got {type(model)}")
    if getattr(model, "mtp_process", False):
        raise ValueError("multi-token prediction layers do not run under the package's CP head")
    if hasattr(model, _ATTACHED):
        return
    setattr(model, _ATTACHED, [])
    model.register_forward_pre_hook(_take_output_processor, with_kwargs=True)
    # always_call: an exception inside the forward still puts post_process back.
    model.register_forward_hook(_apply_output_processor, with_kwargs=True, always_call=True)
