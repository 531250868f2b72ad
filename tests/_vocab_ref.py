"""Independent references for the vocab-parallel head ops (tests and benchmarks share them).

Nothing here calls ``vocab_ops``' internals: the references are the definitions written out in
float64 (or the naive bf16 autograd a trainer would write), plus the one-shard autograd Function
that composes ``vocab_stats`` / ``vocab_stats_backward`` the way the head does.
"""

from __future__ import annotations

import torch

from megatron.context_parallel.head.vocab_ops import vocab_stats, vocab_stats_backward

IGNORE = -100


def stats_fp64(hidden, weight, target, k):
    """The forward's definition in float64: (row_max, sum_exp, target_logit, top values, ids)."""
    logits = hidden.double() @ weight.double().t()
    vocab = weight.shape[0]
    row_max = logits.amax(dim=1)
    sum_exp = torch.exp(logits - row_max[:, None]).sum(dim=1)
    if target is None:
        picked = torch.zeros_like(row_max)
    else:
        here = (target >= 0) & (target < vocab)
        picked = logits.gather(1, target.clamp(0, vocab - 1)[:, None]).squeeze(1)
        picked = torch.where(here, picked, 0.0)
    values, ids = logits.topk(k, dim=1)
    return row_max, sum_exp, picked, values, ids, logits


def backward_fp64(hidden, weight, row_max, grad_sum_exp, ids, grad_ids):
    """Autograd in float64 of the scalar whose logits-gradient is the backward's definition.

    ``F = sum_i g_s[i] * sum_j exp(l_ij - row_max_i) + sum_{i,c} grad_ids[i,c] * l[i, ids[i,c]]``
    (row_max held constant, ids outside the shard dropped) has
    ``dF/dl = g_s * exp(l - row_max) + scatter(grad_ids)``, so its hidden / weight gradients are
    exactly ``d_logits @ weight`` and ``d_logits.T @ hidden``.
    """
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    logits = h @ w.t()
    vocab = weight.shape[0]
    total = (grad_sum_exp.double()[:, None] * torch.exp(logits - row_max.double()[:, None])).sum()
    if ids.numel():
        here = (ids >= 0) & (ids < vocab)
        picked = logits.gather(1, ids.clamp(0, max(vocab - 1, 0)))
        total = total + torch.where(here, grad_ids.double() * picked, 0.0).sum()
    gh, gw = torch.autograd.grad(total, (h, w), allow_unused=True)
    return (
        gh if gh is not None else torch.zeros_like(h),
        gw if gw is not None else torch.zeros_like(w),
    )


class ShardLogprobs(torch.autograd.Function):
    """Target log-probs and top-k log-probs of one vocabulary shard, as the head composes them.

    Forward: ``m, s, t, v, ids = vocab_stats(...)``; ``lse = m + log(s)``; target log-prob
    ``t - lse`` (0.0 where the label is outside the shard, e.g. -100); top-k log-probs
    ``v - lse``. Backward: the row's summed upstream gradient ``G`` reaches ``s`` as
    ``-G * exp(m - lse)``; the target and top-k gradients reach their logits directly.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, k, fwd_chunk, bwd_chunk):
        vocab = weight.shape[0]
        m, s, t, v, ids = vocab_stats(hidden, weight, labels, k, fwd_chunk)
        lse = m + torch.log(s)
        valid = (labels >= 0) & (labels < vocab)
        target_lp = torch.where(valid, t - lse, 0.0)
        top_lp = v - lse[:, None]
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(hidden, weight, labels, valid, m, lse, ids)
        ctx.bwd_chunk = bwd_chunk
        return target_lp, top_lp, ids

    @staticmethod
    def backward(ctx, grad_target, grad_top, _grad_ids):
        hidden, weight, labels, valid, m, lse, ids = ctx.saved_tensors
        n = hidden.shape[0]
        if grad_target is None:
            grad_target = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        if grad_top is None:
            grad_top = torch.zeros(ids.shape, dtype=torch.float32, device=hidden.device)
        g_t = torch.where(valid, grad_target.float(), 0.0)
        total = g_t + grad_top.float().sum(dim=1)
        g_s = -total * torch.exp(m - lse)
        all_ids = torch.cat([torch.where(valid, labels, -1)[:, None], ids], dim=1)
        all_grads = torch.cat([g_t[:, None], grad_top.float()], dim=1)
        gh, gw = vocab_stats_backward(
            hidden,
            weight,
            m,
            g_s,
            all_ids,
            all_grads,
            ctx.bwd_chunk,
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
        )
        return gh, gw, None, None, None, None


def shard_logprobs(hidden, weight, labels, k=0, fwd_chunk=None, bwd_chunk=None):
    """(target log-probs fp32 [n], top-k log-probs fp32 [n, k], top-k ids int64 [n, k])."""
    return ShardLogprobs.apply(hidden, weight, labels, k, fwd_chunk, bwd_chunk)


def logprobs_fp64(hidden, weight, labels, top_ids=None):
    """float64 log-softmax of the exact logits, at the labels (0.0 where ignored) and top ids."""
    logits = hidden.double() @ weight.double().t()
    logp = torch.log_softmax(logits, dim=1)
    vocab = weight.shape[0]
    valid = (labels >= 0) & (labels < vocab)
    target = torch.where(valid, logp.gather(1, labels.clamp(0, vocab - 1)[:, None]).squeeze(1), 0.0)
    top = logp.gather(1, top_ids) if top_ids is not None else None
    return target, top


def naive_logprobs(hidden, weight, labels):
    """What a trainer writes: bf16 logits, fp32 log_softmax, gather (autograd end to end)."""
    logits = hidden @ weight.t()
    logp = torch.log_softmax(logits.float(), dim=1)
    vocab = weight.shape[0]
    valid = (labels >= 0) & (labels < vocab)
    picked = logp.gather(1, labels.clamp(0, vocab - 1)[:, None]).squeeze(1)
    return torch.where(valid, picked, 0.0)


def rel_err(got, ref) -> float:
    """``||got - ref|| / ||ref||`` in float64 (0 when both are empty or zero)."""
    ref = ref.double()
    den = ref.norm().item()
    num = (got.double() - ref).norm().item()
    return num / den if den else num
