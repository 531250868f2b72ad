"""Fused causal attention of one rank's rows over the gathered keys, for any CP plan.

``fused_attention(query, kv, runs, kernel, scale)`` computes, for every local query row, softmax
attention over the compact keys its run may see (``attention_runs.AttentionRuns``), through a
varlen kernel that keeps no score matrix in memory. The data movement around the kernel lives
here (the query span buffer, the backward's per-entry key copies and the sum of their
gradients); the kernel is pluggable:

* ``kernel.forward(q, kv, runs, dev, scale, want_stats) -> (o, stats)``
* ``kernel.backward(q, kv, o, do, stats, runs, dev, scale, deterministic) -> (dq, dkv)``

with the shapes of ``_attention_cudnn`` (the GPU kernel, cuDNN); ``dkv`` is split,
``[2, M, G, d]`` (key gradients, then value gradients), and is read into slot rows by
``_attention_sums``. The tests plug a dense per-entry kernel in on the CPU to check every table
against the dense attention.

``select_backend`` is the one place that picks dense or fused attention for a call.
"""

from __future__ import annotations

import torch

from megatron.context_parallel import _attention_cudnn, _attention_sums, ops
from megatron.context_parallel.attention_blocks import AttentionBlocks
from megatron.context_parallel.attention_runs import AttentionRuns

__all__ = [
    "fused_attention",
    "select_backend",
    "set_attention_backend",
    "attention_backend",
]

_BACKENDS = ("auto", "dense", "cudnn")
_SETTING = ["auto"]


def set_attention_backend(name: str) -> None:
    """Choose the backend of ``ContextParallelAttention`` for this process.

    Args:
        name: ``"auto"`` (default: cuDNN's fused attention for fp16 / bf16 CUDA tensors when
            ``nvidia-cudnn-frontend`` is installed, else the dense computation), ``"dense"``
            (always the dense computation: the CPU path and the reference) or ``"cudnn"``
            (always fused; raises where it cannot run).
    """
    if name not in _BACKENDS:
        raise ValueError(f"attention backend must be one of {_BACKENDS}, got {name!r}")
    _SETTING[0] = name


def attention_backend() -> str:
    """The setting of ``set_attention_backend``."""
    return _SETTING[0]


def select_backend(query: torch.Tensor, head_dim: int, batch: int, dropout: float) -> str:
    """``"cudnn"`` or ``"dense"`` for one call (the one dispatch point).

    Args:
        query: the call's query (its device and dtype decide).
        head_dim: the head dimension.
        batch: micro-batch entries per row (``b`` of ``[s, b, ...]``); the fused path takes 1.
        dropout: the attention dropout probability in effect (0 outside training).

    Raises:
        ValueError: the fused path was asked for (``"cudnn"``) but cannot run this call, or would
            run it (``"auto"``) with dropout > 0, which it does not implement.
    """
    setting = _SETTING[0]
    if setting == "dense":
        return "dense"
    why = None
    if not _attention_cudnn.available(query.device):
        why = (
            "it needs a CUDA tensor and nvidia-cudnn-frontend "
            "(pip install 'megatron-context-parallel[attention]')"
        )
    elif query.dtype not in (torch.float16, torch.bfloat16):
        why = f"cuDNN's attention takes fp16 / bf16, not {query.dtype}"
    elif head_dim % 8 or head_dim > 128:
        why = f"head dim {head_dim} is not a multiple of 8 up to 128"
    elif batch != 1:
        why = f"it takes one packed batch ([s, 1, ...]), got b = {batch}"
    if why is not None:
        if setting == "cudnn":
            raise ValueError(f"fused attention cannot run this call: {why}")
        return "dense"
    if dropout > 0:
        raise ValueError(
            f"the fused attention path has no dropout (attention_dropout = {dropout}); set "
            "config.attention_dropout = 0, or set_attention_backend('dense') to run the dense "
            "computation (memory O(rows x sequence) per head)"
        )
    return "cudnn"


def _compact_kv(kv_slots: torch.Tensor, compact_slots) -> torch.Tensor:
    """The gathered keys / values in compact key order (the slots themselves when ``None``)."""
    if compact_slots is None:
        return kv_slots.contiguous()
    return ops.gather_rows(kv_slots, compact_slots)


def _keys_for(runs: AttentionRuns, kv: torch.Tensor, kernel) -> torch.Tensor:
    """The key buffer a kernel's backward reads: the compact keys, or each entry's own copy
    when entries overlap and the kernel cannot read overlapping ranges in place."""
    if not runs.materialize or getattr(kernel, "shared_keys_in_backward", False):
        return kv
    return ops.gather_rows(kv, runs.on(kv.device).kv_source)


def _slot_gradients(dkeys: torch.Tensor, runs: AttentionRuns, dev) -> torch.Tensor:
    """The all-gather slots' gradient ``[slots, G, 2d]`` from the kernel's split key gradients
    ``[2, M, G, d]``: each slot's key copies summed (in fp32, rounded once)."""
    if runs.slot_copies is None:
        return _attention_sums.interleave(dkeys)
    return _attention_sums.slot_sums(dkeys, dev.slot_copies)


class _FusedAttention(torch.autograd.Function):
    """query ``[rows, H, d]``, all-gather slots ``[slots, G, 2d]`` -> context ``[rows, H, d]``.

    Backward: ``dquery`` (dummy and padding rows dropped) and the slots' gradient (each key's
    per-entry gradients summed; padding slots zero). No communication.
    """

    @staticmethod
    def forward(ctx, query, kv_slots, runs: AttentionRuns, kernel, scale, deterministic):
        dev = runs.on(query.device)
        q = query.contiguous() if runs.identity else ops.gather_rows(query, dev.span_source)
        kv = _compact_kv(kv_slots, dev.compact_slots)
        want_stats = any(ctx.needs_input_grad[:2])
        o, stats = kernel.forward(q, kv, runs, dev, scale, want_stats)
        out = o if runs.identity else ops.gather_rows(o, dev.local_to_span)
        ctx.runs, ctx.kernel, ctx.scale, ctx.deterministic = runs, kernel, scale, deterministic
        if want_stats:
            ctx.save_for_backward(q, kv, o, stats)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, o, stats = ctx.saved_tensors
        runs = ctx.runs
        dev = runs.on(q.device)
        if runs.identity:
            do = grad_out.contiguous()
        else:
            do = ops.gather_rows(grad_out.contiguous(), dev.span_source)
        dq, dkeys = ctx.kernel.backward(
            q, _keys_for(runs, kv, ctx.kernel), o, do, stats, runs, dev, ctx.scale,
            ctx.deterministic,
        )  # fmt: skip
        dquery = dq if runs.identity else ops.gather_rows(dq, dev.local_to_span)
        return dquery, _slot_gradients(dkeys, runs, dev), None, None, None, None


class _BlockedAttention(torch.autograd.Function):
    """query ``[rows, H, d]``, all-gather slots ``[slots, G, 2d]`` -> context ``[rows, H, d]``
    through the blocked layout (``attention_blocks``).

    Backward: every call differentiated against the final output and log-sum-exp; query and key
    gradients added in fp32 by the rows / keys each call touched; padding slots zero.
    """

    @staticmethod
    def forward(ctx, query, kv_slots, blocks: AttentionBlocks, kernel, scale, deterministic):
        dev = blocks.on(query.device)
        q = query.contiguous() if dev.order is None else ops.gather_rows(query, dev.order)
        kv = _compact_kv(kv_slots, dev.compact_slots)
        n, heads, _ = q.shape
        lse_d = q.new_empty((n, heads), dtype=torch.promote_types(q.dtype, torch.float32))
        o_d = torch.empty_like(q)
        for call, first, end in blocks.diagonal:
            cd = call.on(q.device)
            o_span, lse_span = kernel.forward(
                ops.gather_rows(q, cd.span_source), kv, call, cd, scale, True
            )
            o_d[first:end] = ops.gather_rows(o_span, cd.local_to_span)
            lse_d[first:end] = ops.gather_rows(lse_span, cd.local_to_span)
        if blocks.bulk is None:
            o, lse = o_d, lse_d
        else:
            o_b, lse_b = kernel.forward(q, kv, blocks.bulk, blocks.bulk.on(q.device), scale, True)
            if dev.has_bulk is not None:
                lse_b = lse_b.masked_fill(~dev.has_bulk, float("-inf"))
            o, lse = _attention_sums.merge(o_b, lse_b, o_d, lse_d)
        ctx.blocks, ctx.kernel, ctx.scale, ctx.deterministic = blocks, kernel, scale, deterministic
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(q, kv, o, lse)
        return o if dev.order is None else ops.gather_rows(o, dev.local_to_sorted)

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, o, lse = ctx.saved_tensors
        blocks, kernel = ctx.blocks, ctx.kernel
        dev = blocks.on(q.device)
        grad_out = grad_out.contiguous()
        do = grad_out if dev.order is None else ops.gather_rows(grad_out, dev.order)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        args = (ctx.scale, ctx.deterministic)
        for call, first, end in blocks.diagonal:
            cd = call.on(q.device)
            span = [ops.gather_rows(t, cd.span_source) for t in (q, o, do, lse)]
            dq_span, dkv_call = kernel.backward(
                span[0], _keys_for(call, kv, kernel), span[1], span[2], span[3], call, cd, *args
            )
            dq[first:end] += ops.gather_rows(dq_span, cd.local_to_span)
            _attention_sums.add_key_rows(dkv, cd.kv_source, dkv_call)
        for call, rows in zip(blocks.levels, dev.touched):
            cd = call.on(q.device)
            dq_call, dkv_call = kernel.backward(
                q, _keys_for(call, kv, kernel), o, do, lse, call, cd, *args
            )
            _attention_sums.add_rows(dq, rows, dq_call, rows)
            _attention_sums.add_key_rows(dkv, cd.kv_source, dkv_call)
        dq = dq.to(q.dtype)
        dquery = dq if dev.order is None else ops.gather_rows(dq, dev.local_to_sorted)
        dkv = dkv.to(kv.dtype)
        dslots = dkv if dev.slot_rows is None else ops.gather_rows(dkv, dev.slot_rows)
        return dquery, dslots, None, None, None, None


def fused_attention(
    query: torch.Tensor,
    kv_slots: torch.Tensor,
    runs,
    scale: float,
    *,
    kernel=None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Causal attention of the local rows over the gathered keys, by the run tables.

    Args:
        query: ``[rows, H, d]``, this rank's rows in plan order (``runs.rows`` of them).
        kv_slots: ``[slots, G, 2d]``, keys then values of the padded all-gather over CP
            (``runs.slots`` rows: rank r's row i at ``r * max_count + i``), the same dtype;
            ``H`` must be a multiple of ``G``.
        runs: the batch's tables for this rank: ``AttentionRuns`` or ``AttentionBlocks``.
        scale: softmax scale.
        kernel: the varlen kernel (default: cuDNN).
        deterministic: ask the kernel for a deterministic backward.

    Returns:
        ``[rows, H, d]``; padding rows are zero. Gradients flow to ``query`` and ``kv_slots``
        (padding slots get zero).
    """
    if query.shape[0] != runs.rows or kv_slots.shape[0] != runs.slots:
        raise ValueError(
            f"fused attention got {query.shape[0]} query rows and {kv_slots.shape[0]} key "
            f"slots, but the run tables are for {runs.rows} and {runs.slots}"
        )
    function = _BlockedAttention if isinstance(runs, AttentionBlocks) else _FusedAttention
    return function.apply(
        query,
        kv_slots,
        runs,
        _attention_cudnn if kernel is None else kernel,
        float(scale),
        deterministic,
    )
