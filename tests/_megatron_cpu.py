"""Run megatron-core's GPTModel / HybridModel on CPU in the gloo test workers; build tiny ones.

The package needs none of this: ``context_parallel_batch`` / ``context_parallel_forward`` and a
GPTModel's forward and backward under the package's layer spec run on CPU-only torch as they are
(``test_model.test_cpu_forward_and_backward_need_no_shim``). megatron-core's own pieces that the
tests also run name CUDA outright: its rotary table (``RotaryEmbedding.get_emb`` moves
``inv_freq`` to ``torch.cuda.current_device()``) and attention in the CP-1 references, and its
training machinery (``cpu_current_device`` lists where). Dropout regions fork the CUDA RNG
tracker; the tests use no dropout, and the inference flavour of the tracker forks as a no-op.

Nothing here is imported by the package; it only serves the tests.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "cpu_current_device",
    "init_parallel",
    "build_tiny_gpt",
    "global_name",
    "load_stage",
    "TINY",
]

# The tiny model of the end-to-end tests.
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_seq_len=128)
# The Gated DeltaNet layers ('G') of tiny hybrids: heads divide by CP 2, 3 and 4, two value heads
# per key head; SiLU as Qwen3.5 (and megatron's fla path) use.
TINY_GDN = dict(
    linear_num_key_heads=12,
    linear_num_value_heads=24,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


class _NoStream:
    """Stands in for ``torch.cuda.current_stream()``: CPU work is already in order."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _cpu_device(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and torch.device(device).type == "cuda":
        kwargs["device"] = "cpu"
    kwargs.pop("pin_memory", None)  # no pinned allocator without CUDA
    return kwargs


def _cpu_factory(factory):
    def factory_on_cpu(*args, **kwargs):
        return factory(*args, **_cpu_device(kwargs))

    factory_on_cpu.__wrapped__ = factory
    return factory_on_cpu


def _type_as_cuda(type_of):
    def type_name(self, *args, **kwargs):
        name = type_of(self, *args, **kwargs)
        if args or kwargs or not isinstance(name, str) or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    type_name.__wrapped__ = type_of
    return type_name


_INSTALLED = False


def cpu_current_device() -> None:
    """On a machine without CUDA, let megatron-core's CUDA-only calls run on the CPU.

    megatron-core 0.19.2 names CUDA outright on the paths these tests use. Each shim makes one
    such call mean "the CPU", which is where every tensor of these tests lives (gloo):

    * ``torch.cuda.current_device()`` (DDP's gradient buffers, megatron's rotary ``inv_freq``,
      p2p shape buffers, TP helpers) answers ``cpu``;
    * ``torch.zeros / empty / ones / full / tensor(..., device="cuda")`` (the schedules' token
      counter, the optimizers' flags) allocate on the CPU, and ``pin_memory=True`` (megatron's
      rotary CP slice, where a test still builds that table) is dropped: there is no pinned
      allocator without CUDA;
    * ``Tensor.cuda()`` (tied embeddings) returns the tensor unchanged;
    * ``torch.cuda.current_stream()`` (the DDP grad buffer) is a stream whose waits do
      nothing, and ``torch.cuda.synchronize()`` (p2p shape exchange) returns at once: gloo
      calls complete before they return;
    * ``Tensor.type()`` without arguments names a CPU tensor as its CUDA twin
      (``torch.cuda.FloatTensor``): the distributed optimizer sorts parameters by that name
      and refuses any other.

    Installed once per process; does nothing when CUDA exists. Nothing in the package relies
    on it: the package never calls CUDA on a CPU path.
    """
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    _INSTALLED = True
    torch.cuda.current_device = lambda: torch.device("cpu")
    for name in ("zeros", "empty", "ones", "full", "tensor"):
        setattr(torch, name, _cpu_factory(getattr(torch, name)))
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.type = _type_as_cuda(torch.Tensor.type)
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.synchronize = lambda *args, **kwargs: None


def init_parallel(tp: int = 1, cp: int = 1, pp: int = 1, vpp: Optional[int] = None) -> None:
    """(Re)initialises megatron's ``parallel_state`` on the running gloo world.

    The world is split into TP x CP x DP x PP (DP = world / (TP * CP * PP)), with ``vpp``
    virtual stages per pipeline rank (interleaved schedule) when given; earlier groups are
    destroyed, so one worker can run several layouts in turn.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    cpu_current_device()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
    )
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build_tiny_gpt(
    *,
    seed: int = 1234,
    reference: bool = False,
    position_embedding_type: str = "rope",
    num_query_groups: Optional[int] = None,
    num_layers: int = TINY["num_layers"],
    tied: bool = False,
    vp_stage: Optional[int] = None,
    pattern: Optional[str] = None,
    attention_output_gate: bool = False,
    num_experts: Optional[int] = None,
):
    """The tiny fp32 GPTModel or HybridModel (or this rank's pipeline stage of it).

    ``use_cpu_initialization`` builds each full weight from the CPU RNG and then keeps this TP
    rank's slice, so the same ``seed`` gives the same model for every TP / CP size. Pipeline
    stages draw fewer weights, so their values differ: copy them from a whole model
    (``load_stage``) to compare.

    Args:
        seed: torch seed set right before construction.
        reference: build megatron-core's own local spec (``DotProductAttention``, CP 1 only)
            instead of the context-parallel one.
        position_embedding_type: ``"rope"`` or ``"learned_absolute"``.
        num_query_groups: for GQA; None for plain multi-head attention.
        num_layers: transformer layers of the whole model.
        tied: share the input embedding and the output layer's weight.
        vp_stage: the virtual pipeline stage to build (interleaved schedule), or None.
        pattern: build megatron-core's ``HybridModel`` with this ``hybrid_layer_pattern``
            instead (``num_layers`` is ignored; ``|`` marks pipeline stages and is dropped on
            one stage). Its stack is ``get_hybrid_stack_with_context_parallel_spec()``; with
            ``reference`` its attention layers are megatron-core's ``SelfAttention`` and
            ``DotProductAttention`` instead of the package's.
        attention_output_gate: megatron's gated attention output (``config``).
        num_experts: experts of the MoE layers (``E`` in ``pattern``): top-2 routing without
            token dropping or auxiliary loss, megatron's ``allgather`` dispatcher (its
            ``alltoall`` one makes a CUDA stream), no linear biases (megatron's local experts
            add theirs in place on a view, which autograd refuses).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.context_parallel.attention.layers import get_gpt_layer_with_context_parallel_spec

    pp = ps.get_pipeline_model_parallel_world_size()
    if pattern is not None:
        if pp == 1:
            pattern = pattern.replace("|", "")
        num_layers = len(pattern.replace("|", ""))
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=TINY["hidden_size"],
        num_attention_heads=TINY["num_attention_heads"],
        num_query_groups=num_query_groups,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        pipeline_dtype=torch.float32 if pp > 1 else None,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        attention_output_gate=attention_output_gate,
    )
    if pattern is not None and "G" in pattern:
        for name, value in TINY_GDN.items():
            setattr(config, name, value)
        config.activation_func = torch.nn.functional.silu
    if num_experts is not None:
        config.num_moe_experts = num_experts
        config.moe_router_topk = 2
        config.moe_ffn_hidden_size = 32
        config.moe_token_dispatcher_type = "allgather"
        config.moe_router_load_balancing_type = "none"
        config.moe_aux_loss_coeff = 0.0
        config.add_bias_linear = False
    kwargs = dict(
        vocab_size=TINY["vocab_size"],
        max_sequence_length=TINY["max_seq_len"],
        position_embedding_type=position_embedding_type,
        share_embeddings_and_output_weights=tied,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )
    if pattern is not None:
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        config.is_hybrid_model = True
        model_class, spec = HybridModel, _hybrid_spec(reference)
        kwargs["hybrid_layer_pattern"] = pattern
    else:
        model_class = GPTModel
        spec = (
            get_gpt_layer_local_spec() if reference else get_gpt_layer_with_context_parallel_spec()
        )
    torch.manual_seed(seed)
    return model_class(config, spec, **kwargs)


def _hybrid_spec(reference: bool):
    """The package's hybrid stack spec; with ``reference``, megatron-core's own attention in
    its attention layers (``SelfAttention`` + ``DotProductAttention``, CP 1 only) and the tests'
    plain-torch Gated DeltaNet (``_gdn_ref``) in its GDN layers."""
    import dataclasses

    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron.context_parallel.models.hybrid import get_hybrid_stack_with_context_parallel_spec

    spec = get_hybrid_stack_with_context_parallel_spec()
    if not reference:
        return spec
    from _gdn_ref import PlainGatedDeltaNet

    gdn = spec.submodules.gdn_layer
    mixer = dataclasses.replace(gdn.submodules.self_attention, module=PlainGatedDeltaNet)
    gdn = dataclasses.replace(
        gdn, submodules=dataclasses.replace(gdn.submodules, self_attention=mixer)
    )
    spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, gdn_layer=gdn))
    layer = spec.submodules.attention_layer
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        module=SelfAttention,
        submodules=dataclasses.replace(attention.submodules, core_attention=DotProductAttention),
    )
    layer = dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention)
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, attention_layer=layer)
    )


def global_name(stage, name: str) -> str:
    """The whole model's name of ``stage``'s parameter ``name`` (layers renumbered globally;
    a tied output layer on a later stage is the input embedding's weight)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        layer = stage.decoder.layers[int(parts[2])]
        parts[2] = str(layer.layer_number - 1)
    if name == "output_layer.weight" and stage.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"
    return ".".join(parts)


def load_stage(stage, whole_state: dict) -> None:
    """Copies a whole model's parameters (``{name: tensor}``) into a pipeline stage of it."""
    with torch.no_grad():
        for name, p in stage.named_parameters():
            p.copy_(whole_state[global_name(stage, name)])
