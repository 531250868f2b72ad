"""Run megatron-core's GPTModel on CPU in the gloo test workers, and build a tiny one.

megatron-core assumes CUDA in a few places on the paths these tests use:

* ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``, and a few
  tensor-parallel helpers allocate on it. ``cpu_current_device()`` makes that call answer
  ``cpu`` (CPU-only torch raises instead), so those tensors simply stay on the CPU.
* Dropout regions fork the CUDA RNG tracker. The tests use no dropout; the inference flavour of
  the tracker forks as a no-op, so no CUDA generator state is ever touched.

Nothing here is imported by the package; it only serves the tests.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["cpu_current_device", "init_parallel", "build_tiny_gpt", "TINY"]

# The tiny model of the end-to-end tests.
TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_seq_len=128)


def cpu_current_device() -> None:
    """On a machine without CUDA, make ``torch.cuda.current_device()`` return the CPU device."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")


def init_parallel(tp: int = 1, cp: int = 1) -> None:
    """(Re)initialises megatron's ``parallel_state`` on the running gloo world.

    The world is split into TP x CP x DP (DP = world / (TP * CP)); earlier groups are destroyed,
    so one worker can run several layouts in turn.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    cpu_current_device()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build_tiny_gpt(
    *,
    seed: int = 1234,
    reference: bool = False,
    position_embedding_type: str = "rope",
    num_query_groups: Optional[int] = None,
):
    """The tiny fp32 GPTModel, identical (before TP sharding) on every rank and layout.

    ``use_cpu_initialization`` builds each full weight from the CPU RNG and then keeps this TP
    rank's slice, so the same ``seed`` gives the same model for every TP / CP size.

    Args:
        seed: torch seed set right before construction.
        reference: build megatron-core's own local spec (``DotProductAttention``, CP 1 only)
            instead of the context-parallel one.
        position_embedding_type: ``"rope"`` or ``"learned_absolute"``.
        num_query_groups: for GQA; None for plain multi-head attention.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.context_parallel.attention import get_gpt_layer_with_context_parallel_spec

    config = TransformerConfig(
        num_layers=TINY["num_layers"],
        hidden_size=TINY["hidden_size"],
        num_attention_heads=TINY["num_attention_heads"],
        num_query_groups=num_query_groups,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        context_parallel_size=ps.get_context_parallel_world_size(),
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    spec = get_gpt_layer_local_spec() if reference else get_gpt_layer_with_context_parallel_spec()
    torch.manual_seed(seed)
    return GPTModel(
        config,
        spec,
        vocab_size=TINY["vocab_size"],
        max_sequence_length=TINY["max_seq_len"],
        position_embedding_type=position_embedding_type,
    )
