"""Per-shard statistics of a vocab-parallel output layer, without materialising logits.

Provisional torch implementation (every device); the fused kernels replace it.

``vocab_stats(hidden [n, H], weight [Vs, H], target int64 [n] | None, k, chunk_size)`` returns,
for the fp32 logits ``l = hidden @ weight.T`` (fp32 accumulation, never rounded to the input
dtype): ``row_max`` fp32 ``[n]``, ``sum_exp = sum_j exp(l_ij - row_max_i)`` fp32 ``[n]``,
``target_logit`` fp32 ``[n]`` (0 where the target is outside ``[0, Vs)``), the top-``k`` logits
fp32 ``[n, k]`` (descending) and their shard-local ids int64 ``[n, k]``.

``vocab_stats_backward(hidden, weight, row_max, grad_sum_exp, ids, grad_ids, chunk_size,
want_hidden, want_weight)`` returns ``(grad_hidden | None, grad_weight | None)`` for
``d_logits = grad_sum_exp * exp(l - row_max) + scatter(ids, grad_ids)`` (ids outside the shard
ignored, duplicates added). Precision rule: ``d_logits`` is rounded once to the input dtype (as
autograd of the plain matmul would), then each product accumulates in fp32 over its whole
reduction and is rounded once.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["vocab_stats", "vocab_stats_backward"]


def vocab_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: Optional[torch.Tensor],
    k: int,
    chunk_size: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See the module docstring."""
    n, shard = hidden.shape[0], weight.shape[0]
    device = hidden.device
    row_max = torch.empty(n, dtype=torch.float32, device=device)
    sum_exp = torch.empty(n, dtype=torch.float32, device=device)
    target_logit = torch.zeros(n, dtype=torch.float32, device=device)
    top_values = torch.empty(n, k, dtype=torch.float32, device=device)
    top_ids = torch.empty(n, k, dtype=torch.int64, device=device)
    w32 = weight.float()
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        logits = hidden[start:end].float() @ w32.t()
        row_max[start:end] = logits.amax(dim=-1)
        if target is not None:
            t = target[start:end]
            here = (t >= 0) & (t < shard)
            picked = logits.gather(1, t.clamp(0, shard - 1)[:, None]).squeeze(1)
            target_logit[start:end] = torch.where(here, picked, 0.0)
        if k:
            top_values[start:end], top_ids[start:end] = logits.topk(k, dim=-1)
        # In place: the chunk's logits become their exponentials, no second [c, Vs] tensor.
        sum_exp[start:end] = logits.sub_(row_max[start:end, None]).exp_().sum(dim=-1)
    return row_max, sum_exp, target_logit, top_values, top_ids


def vocab_stats_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    row_max: torch.Tensor,
    grad_sum_exp: torch.Tensor,
    ids: torch.Tensor,
    grad_ids: torch.Tensor,
    chunk_size: int,
    want_hidden: bool,
    want_weight: bool,
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """See the module docstring."""
    n, shard = hidden.shape[0], weight.shape[0]
    h32 = hidden.float()
    grad_h32 = torch.zeros_like(h32) if want_hidden else None
    grad_w = torch.empty_like(weight) if want_weight else None
    rows = torch.arange(n, device=hidden.device)[:, None].expand_as(ids)
    for start in range(0, shard, chunk_size):
        end = min(start + chunk_size, shard)
        w32 = weight[start:end].float()
        d = (h32 @ w32.t()).sub_(row_max[:, None]).exp_().mul_(grad_sum_exp[:, None])
        inside = (ids >= start) & (ids < end)
        flat = rows[inside] * (end - start) + (ids[inside] - start)
        d.view(-1).index_add_(0, flat, grad_ids[inside].float())
        d = d.to(hidden.dtype).float()
        if want_weight:
            grad_w[start:end] = (d.t() @ h32).to(weight.dtype)
        if want_hidden:
            grad_h32 += d @ w32
    grad_h = grad_h32.to(hidden.dtype) if want_hidden else None
    return grad_h, grad_w
