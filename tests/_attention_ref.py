"""A dense stand-in for the fused attention kernel, and an oracle written from positions alone.

``ReferenceKernel`` has the interface of ``megatron.context_parallel._attention_cudnn`` (the
cuDNN kernel) and the same contract: each entry of the run tables is a bottom-right causal
block of its ``q_len`` query rows over its ``kv_len`` keys; the backward writes each entry's key
gradients whole (no accumulation across entries). Plugged into the fused path on the CPU, it
checks every table (spans, dummies, key copies, compact keys) against ``oracle_attention``,
which knows nothing of runs: each local row attends the owned positions of its sequence up to
its own.
"""

from __future__ import annotations

import torch


def _entry(q, k, v, scale):
    """Dense bottom-right causal attention of one entry: q [n, H, d], k/v [m, G, d]."""
    n, heads, _ = q.shape
    m, groups = k.shape[0], k.shape[1]
    k = k.repeat_interleave(heads // groups, dim=1)
    v = v.repeat_interleave(heads // groups, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) * scale
    rows = torch.arange(n, device=q.device)[:, None]
    cols = torch.arange(m, device=q.device)[None, :]
    scores = scores.masked_fill(cols > rows + (m - n), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(scores, dim=-1), v.double())
    return out, lse.transpose(0, 1)


class ReferenceKernel:
    """The fused kernel's contract in plain torch (float64 math, any device)."""

    # Read each entry's keys where the forward did (tests switch it on to check that path).
    shared_keys_in_backward = False

    @staticmethod
    def forward(q, kv, runs, dev, scale, want_stats):
        d = q.shape[-1]
        o = torch.zeros_like(q)
        stats = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
        for e in range(runs.entries):
            qs, ql = int(runs.q_start[e]), int(runs.q_len[e])
            ks, kl = int(runs.k_start[e]), int(runs.kv_len[e])
            keys = kv[ks : ks + kl]
            out, lse = _entry(q[qs : qs + ql], keys[..., :d], keys[..., d:], scale)
            o[qs : qs + ql] = out.to(o.dtype)
            stats[qs : qs + ql] = lse.float()
        return o, (stats if want_stats else None)

    @staticmethod
    def backward(q, kv, o, do, stats, runs, dev, scale, deterministic):
        d = q.shape[-1]
        dq = torch.zeros_like(q)
        # Rows no entry writes stay zero, as the cuDNN kernel's zero-initialised buffers do.
        dkv = kv.new_zeros((runs.mat_rows,) + tuple(kv.shape[1:]))
        shared = kv.shape[0] != runs.mat_rows
        for e in range(runs.entries):
            qs, ql = int(runs.q_start[e]), int(runs.q_len[e])
            ms, kl = int(runs.mat_start[e]), int(runs.kv_len[e])
            ks = int(runs.k_start[e]) if shared else ms
            qe = q[qs : qs + ql].detach().double().requires_grad_()
            ke = kv[ks : ks + kl].detach().double().requires_grad_()
            with torch.enable_grad():  # a Function's backward runs with grad mode off
                out, _ = _entry(qe, ke[..., :d], ke[..., d:], scale)
                gq, gk = torch.autograd.grad(out, (qe, ke), do[qs : qs + ql].double())
            dq[qs : qs + ql] = gq.to(dq.dtype)
            dkv[ms : ms + kl] = gk.to(dkv.dtype)  # written, not added: entries do not overlap
        return dq, dkv


class SharedKeysReferenceKernel(ReferenceKernel):
    """The same, reading overlapping key ranges in the backward (no per-entry copies)."""

    shared_keys_in_backward = True


def oracle_attention(query, keys, values, positions, sequence, owned, scale):
    """Causal attention by source position, from positions alone (float64).

    Args:
        query: ``[n, H, d]`` for the local rows at ``positions`` (int64 ``[n]``).
        keys, values: ``[S, G, d]`` in source order (rows nobody owns are ignored).
        sequence: int64 ``[S]``, the packed sequence of each position.
        owned: bool ``[S]``, whether some rank owns each position.
    """
    heads, groups = query.shape[1], keys.shape[1]
    k = keys.double().repeat_interleave(heads // groups, dim=1)
    v = values.double().repeat_interleave(heads // groups, dim=1)
    source = torch.arange(keys.shape[0], device=keys.device)
    allowed = (
        (sequence[None, :] == sequence[positions][:, None])
        & (source[None, :] <= positions[:, None])
        & owned[None, :]
    )
    scores = torch.einsum("nhd,shd->hns", query.double(), k) * scale
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v)
