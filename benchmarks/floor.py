"""The attention floor the benchmarks compare against, shared by them.

The floor is causal SDPA over one whole sequence (cuDNN's on CUDA, torch's default elsewhere),
its time scaled by the share of visible query-key pairs of what is measured. A tree's visible
pairs: each row sees its position id + 1 keys.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch


def causal_sdpa_calls(
    length: int, heads: int, groups: int, dim: int, dtype: torch.dtype, device: torch.device
) -> Tuple[Callable, Callable, Callable, int]:
    """``(fwd, fwd_and_bwd, grads, kept_bytes)`` of causal SDPA over one sequence of ``length``
    tokens: q ``[1, heads, length, dim]``, k / v ``[1, groups, length, dim]`` (GQA), random, seeded
    by ``length``. ``fwd()`` returns the output (autograd recording), ``fwd_and_bwd()`` runs both
    and drops the gradients, ``grads()`` returns them; ``kept_bytes`` is what inputs, output and
    gradients hold (the rest of a call's peak is the floor's own extra memory)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device=device).manual_seed(length)
    q, k, v = (
        torch.randn(1, n, length, dim, device=device, generator=g).to(dtype).requires_grad_()
        for n in (heads, groups, groups)
    )
    do = torch.randn_like(q)

    def fwd():
        if torch.device(device).type == "cuda":
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True
                )
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )

    def grads():
        torch.autograd.backward(fwd(), do)
        out = (q.grad, k.grad, v.grad)
        q.grad = k.grad = v.grad = None
        return out

    def fwd_and_bwd():
        grads()

    row_bytes = q.numel() * q.element_size()
    kv_bytes = 2 * k.numel() * k.element_size()
    return fwd, fwd_and_bwd, grads, 2 * row_bytes + kv_bytes


def tree_visible_pairs(tree) -> int:
    """Query-key pairs a ``PrefixTree``'s mask allows: each row sees its position id + 1 keys."""
    return int((tree.position_ids() + 1).sum())
