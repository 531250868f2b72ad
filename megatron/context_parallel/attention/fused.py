"""Fused causal attention of one rank's rows over the gathered keys, for any CP plan.

``fused_attention(query, kv, runs, kernel, scale)`` computes, for every local query row, softmax
attention over the compact keys its run may see (``runs.AttentionRuns``), through a
varlen kernel that keeps no score matrix in memory. The data movement around the kernel lives
here (the query span buffer, the backward's per-entry key copies and the sum of their
gradients); the kernel is anything that meets ``kernel.AttentionKernel``:

* ``kernel.forward(q, kv, runs, dev, scale, want_stats) -> (o, stats)``
* ``kernel.backward(q, kv, o, do, stats, runs, dev, scale, deterministic) -> (dq, dkv)``

with the shapes of ``cudnn`` (the GPU kernel, cuDNN: ``cudnn.CudnnKernel``); ``dkv`` is split,
``[2, M, G, d]`` (key gradients, then value gradients), and is read into slot rows by
``sums``. The tests plug a dense per-entry kernel in on the CPU to check every table
against the dense attention.

``select_backend`` is the one place that picks dense or fused attention for a call, by
``settings.AttentionSettings.backend``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron.context_parallel.attention import cudnn as cudnn_kernel
from megatron.context_parallel.attention import sums
from megatron.context_parallel.attention.blocks import AttentionBlocks
from megatron.context_parallel.attention.kernel import AttentionKernel
from megatron.context_parallel.attention.runs import AttentionRuns, adopt_calls, stage_calls
from megatron.context_parallel.attention.settings import (
    current_attention_settings,
    set_attention_backend,
)
from megatron.context_parallel.attention.staging import StagedTables
from megatron.context_parallel.attention.tree_tables import TreeTables
from megatron.context_parallel.comm import row_ops

__all__ = [
    "fused_attention",
    "select_backend",
    "stage_backward",
    "set_attention_backend",
    "attention_backend",
]


def attention_backend() -> str:
    """The backend in effect (``AttentionSettings.backend``)."""
    return current_attention_settings().backend


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
    setting = current_attention_settings().backend
    if setting == "dense":
        return "dense"
    why = None
    if not cudnn_kernel.available(query.device):
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
    return row_ops.gather_rows(kv_slots, compact_slots)


def _keys_for(runs: AttentionRuns, kv: torch.Tensor, kernel: AttentionKernel) -> torch.Tensor:
    """The key buffer a kernel's backward reads: the compact keys, or each entry's own copy
    when entries overlap and the kernel cannot read overlapping ranges in place."""
    if not runs.materialize or kernel.shared_keys_in_backward:
        return kv
    return row_ops.gather_rows(kv, runs.on(kv.device).kv_source)


def _backward_cuts(kernel, runs: AttentionRuns, heads: int, dim: int):
    """The calls a kernel's backward of ``runs`` runs as: per part (the call itself, or its
    diagonal and prefix calls where ``split_backward`` finds the split worth it, the diagonal
    first), that part's windows (``backward_window_rows``; the part alone when it fits)."""
    split = runs.backward_split(kernel.split_margin) if kernel.split_backward else None
    # The diagonal call first: it holds every entry, so its windows tile the query rows and
    # write into an uninitialised buffer, where the prefix call's (entries without a prefix
    # left out) would leave rows to zero first.
    parts = (runs,) if split is None else split[::-1]
    rows = kernel.backward_window_rows(heads, dim)
    return [(p,) if rows is None else p.backward_windows(rows) for p in parts]


def _backward_calls(tables, kernel) -> list:
    """``(kernel, call)`` of every call a backward of ``tables`` differentiates (the blocked
    layout's level calls on ``kernel.for_levels()``)."""
    if isinstance(tables, TreeTables):
        return [(kernel, c) for c in (tables.own, *tables.levels) if c.entries]
    if isinstance(tables, AttentionBlocks):
        levels = kernel.for_levels()
        return [(kernel, c) for c, _, _ in tables.diagonal] + [(levels, c) for c in tables.levels]
    return [(kernel, tables)]


def stage_backward(
    tables, heads: int, head_dim: int, kernel: Optional[AttentionKernel] = None
) -> Tuple[list, Optional[StagedTables]]:
    """The backward's parts and windows of a batch's attention tables, and their tables staged
    for one copy (host work alone: a data-loader thread may run it, through
    ``ContextParallelParams.prepare``); built once per tables, heads, head dim and kernel.

    Args:
        tables: ``AttentionRuns``, ``AttentionBlocks`` or ``TreeTables`` (``fused_attention``'s).
        heads: query heads of the layers' attention on this rank; ``head_dim``: their width.
        kernel: the kernel the layers run (default ``cudnn.KERNEL``): its window budget and
            backward split decide the pieces.

    Returns:
        ``(pieces, staged)``: the calls the backward runs beyond those the tables' own copies
        hold (``AttentionRuns``), and their ``StagedTables`` (None when there are none).
    """
    kernel = cudnn_kernel.KERNEL if kernel is None else kernel
    key = ("backward", kernel, int(heads), int(head_dim))
    got = tables._derived.get(key)
    if got is None:
        # The calls the tables' own copy holds.
        held = {id(c) for c in tables._copied_calls() if c is not None}
        pieces = {}
        for k, call in _backward_calls(tables, kernel):
            for cut in _backward_cuts(k, call, heads, head_dim):
                pieces.update((id(p), p) for p in cut if id(p) not in held)
        pieces = list(pieces.values())
        staged = stage_calls(pieces) if pieces else None
        got = tables._derived[key] = (pieces, staged)
    return got


def _copy_backward(tables, kernel, q: torch.Tensor) -> None:
    """Copies the tables of every backward part and window of ``tables`` not on ``q``'s device
    yet, in one copy (``stage_backward``'s, made now unless made ahead): their row tables are
    then derived for all of them at once (``staging.DeviceGroup``), not call by call."""
    pieces, staged = stage_backward(tables, q.shape[1], q.shape[2], kernel)
    if any(q.device not in p._device for p in pieces):
        adopt_calls(pieces, staged.copy(q.device), q.device)


def _call_backward(kernel, q, keys, o, do, stats, runs: AttentionRuns, dev, *args):
    """``kernel.backward`` of one call: ``(dq [Tq, H, d], dkv [2, M, G, d])``.

    Run as pieces where the kernel asks for them: the prefix and diagonal calls
    (``split_backward``, where ``runs.backward_split`` finds a second call worth it), each cut
    into windows of its rows (``backward_window_rows``, ``runs.backward_windows``). The pieces
    write disjoint key-gradient rows of one buffer. The first call's windows (the diagonal's,
    when split) write their rows of the query gradient in place (``dq_out``); the second call's
    query gradients are added (in the inputs' type, one rounding a term as the split always
    did)."""
    cuts = _backward_cuts(kernel, runs, q.shape[1], q.shape[2])
    if cuts == [(runs,)]:
        return kernel.backward(q, keys, o, do, stats, runs, dev, *args)
    # Per-entry key copies are laid out like the key gradients: a window reads its rows.
    copies = runs.materialize and not kernel.shared_keys_in_backward
    dkv = kernel.key_gradients(keys, runs)
    dq = None
    if cuts[0][0].window is not None:
        # Rows outside every window of the first call are never written there.
        dq = (q.new_empty if _windows_tile(cuts[0], q.shape[0]) else q.new_zeros)(q.shape)
    for part, pieces in enumerate(cuts):
        for piece in pieces:
            pd = piece.on(q.device)
            if piece.window is None:
                dq_piece, _ = kernel.backward(q, keys, o, do, stats, piece, pd, *args, dkv_out=dkv)
                if dq is None:  # the first call's gradient (zero outside its entries) is the sum
                    dq = dq_piece
                else:
                    dq.add_(dq_piece)
                del dq_piece
                continue
            q_lo, q_hi, m_lo, m_hi = piece.window
            rows_of = slice(q_lo, q_hi)
            window_args = (
                q[rows_of], keys[m_lo:m_hi] if copies else keys, o[rows_of], do[rows_of],
                stats[rows_of], piece, pd, *args,
            )  # fmt: skip
            if part == 0:
                kernel.backward(*window_args, dkv_out=dkv[:, m_lo:m_hi], dq_out=dq[rows_of])
                continue
            dq_piece, _ = kernel.backward(*window_args, dkv_out=dkv[:, m_lo:m_hi])
            dq[rows_of] += dq_piece
            del dq_piece  # freed before the next window's call, whose workspace is the peak
    return dq, dkv


def _windows_tile(windows, rows: int) -> bool:
    """Whether the query rows of ``windows`` (``AttentionRuns.window``: ``q_lo, q_hi`` first,
    in order) are ``[0, rows)`` without a gap."""
    end = 0
    for w in windows:
        if w.window[0] != end:
            return False
        end = w.window[1]
    return end == rows


def _slot_gradients(dkeys: torch.Tensor, runs: AttentionRuns, dev) -> torch.Tensor:
    """The all-gather slots' gradient ``[slots, G, 2d]`` from the kernel's split key gradients
    ``[2, M, G, d]``: each slot's key copies summed (in fp32, rounded once)."""
    if runs.slots_are_rows:
        return sums.interleave(dkeys)
    return sums.slot_sums(dkeys, dev.slot_copies)


class _FusedAttention(torch.autograd.Function):
    """query ``[rows, H, d]``, all-gather slots ``[slots, G, 2d]`` -> context ``[rows, H, d]``.

    Backward: ``dquery`` (dummy and padding rows dropped) and the slots' gradient (each key's
    per-entry gradients summed; padding slots zero). No communication.
    """

    @staticmethod
    def forward(ctx, query, kv_slots, runs: AttentionRuns, kernel, scale, deterministic):
        dev = runs.on(query.device)
        q = query.contiguous() if runs.identity else row_ops.gather_rows(query, dev.span_source)
        kv = _compact_kv(kv_slots, dev.compact_slots)
        want_stats = any(ctx.needs_input_grad[:2])
        o, stats = kernel.forward(q, kv, runs, dev, scale, want_stats)
        out = o if runs.identity else row_ops.gather_rows(o, dev.local_to_span)
        ctx.runs, ctx.kernel, ctx.scale, ctx.deterministic = runs, kernel, scale, deterministic
        if want_stats:
            ctx.save_for_backward(q, kv, o, stats)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, o, stats = ctx.saved_tensors
        runs = ctx.runs
        dev = runs.on(q.device)
        _copy_backward(runs, ctx.kernel, q)
        if runs.identity:
            do = grad_out.contiguous()
        else:
            do = row_ops.gather_rows(grad_out.contiguous(), dev.span_source)
        dq, dkeys = _call_backward(
            ctx.kernel, q, _keys_for(runs, kv, ctx.kernel), o, do, stats, runs, dev, ctx.scale,
            ctx.deterministic,
        )  # fmt: skip
        dquery = dq if runs.identity else row_ops.gather_rows(dq, dev.local_to_span)
        return dquery, _slot_gradients(dkeys, runs, dev), None, None, None, None


class _BlockedAttention(torch.autograd.Function):
    """query ``[rows, H, d]``, all-gather slots ``[slots, G, 2d]`` -> context ``[rows, H, d]``
    through the blocked layout (``blocks``).

    Backward: every call differentiated against the final output and log-sum-exp; query and key
    gradients added in fp32 by the rows / keys each call touched; padding slots zero.
    """

    @staticmethod
    def forward(ctx, query, kv_slots, blocks: AttentionBlocks, kernel, scale, deterministic):
        dev = blocks.on(query.device)
        q = query.contiguous() if dev.order is None else row_ops.gather_rows(query, dev.order)
        kv = _compact_kv(kv_slots, dev.compact_slots)
        n, heads, _ = q.shape
        lse_d = q.new_empty((n, heads), dtype=torch.promote_types(q.dtype, torch.float32))
        o_d = torch.empty_like(q)
        for call, first, end in blocks.diagonal:
            cd = call.on(q.device)
            o_span, lse_span = kernel.forward(
                row_ops.gather_rows(q, cd.span_source), kv, call, cd, scale, True
            )
            o_d[first:end] = row_ops.gather_rows(o_span, cd.local_to_span)
            lse_d[first:end] = row_ops.gather_rows(lse_span, cd.local_to_span)
        if blocks.bulk is None:
            o, lse = o_d, lse_d
        else:
            o_b, lse_b = kernel.forward(q, kv, blocks.bulk, blocks.bulk.on(q.device), scale, True)
            if dev.has_bulk is not None:
                lse_b = lse_b.masked_fill(~dev.has_bulk, float("-inf"))
            o, lse = sums.merge(o_b, lse_b, o_d, lse_d)
        ctx.blocks, ctx.kernel, ctx.scale, ctx.deterministic = blocks, kernel, scale, deterministic
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(q, kv, o, lse)
        return o if dev.order is None else row_ops.gather_rows(o, dev.local_to_sorted)

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, o, lse = ctx.saved_tensors
        blocks, kernel = ctx.blocks, ctx.kernel
        dev = blocks.on(q.device)
        _copy_backward(blocks, kernel, q)
        grad_out = grad_out.contiguous()
        do = grad_out if dev.order is None else row_ops.gather_rows(grad_out, dev.order)
        acc = torch.promote_types(q.dtype, torch.float32)
        args = (ctx.scale, ctx.deterministic)
        # Each call's span buffers and gradients are freed before the next call: its workspace
        # on top of what is alive is the backward's peak (names still bound kept the last
        # diagonal's span alive through every level call). The diagonal calls run first, into
        # buffers of the inputs' type: groups' diagonals are disjoint ranges of sorted rows and
        # of compact keys, so each row and key has at most one diagonal term, written rather
        # than summed, and the fp32 accumulators of the level calls' sums are only allocated
        # once the span buffers are gone.
        dq_d = torch.zeros_like(q)
        dkv_d = torch.zeros_like(kv)
        for call, first, end in blocks.diagonal:
            cd = call.on(q.device)
            span = [row_ops.gather_rows(t, cd.span_source) for t in (q, o, do, lse)]
            dq_span, dkv_call = _call_backward(
                kernel, span[0], _keys_for(call, kv, kernel), span[1], span[2], span[3], call,
                cd, *args,
            )  # fmt: skip
            del span
            dq_d[first:end] = row_ops.gather_rows(dq_span, cd.local_to_span)
            dkv_d.index_copy_(0, cd.kv_source, sums.interleave(dkv_call))
            del dq_span, dkv_call
        dq, dkv = dq_d.to(acc), dkv_d.to(acc)
        del dq_d, dkv_d
        kernel = kernel.for_levels()  # the level calls run beside the fp32 sums
        for call in blocks.levels:
            cd = call.on(q.device)
            rows = cd.entry_rows()
            dq_call, dkv_call = _call_backward(
                kernel, q, _keys_for(call, kv, kernel), o, do, lse, call, cd, *args
            )
            sums.add_rows(dq, rows, dq_call, rows)
            sums.add_key_rows(dkv, cd.kv_source, dkv_call)
            del dq_call, dkv_call
        dq = dq.to(q.dtype)
        dquery = dq if dev.order is None else row_ops.gather_rows(dq, dev.local_to_sorted)
        dkv = dkv.to(kv.dtype)
        dslots = dkv if dev.slot_rows is None else row_ops.gather_rows(dkv, dev.slot_rows)
        return dquery, dslots, None, None, None, None


def _own_forward(q, kv, own: AttentionRuns, kernel, scale):
    """The own-segment causal part of a tree: ``(o, lse)`` in local row order."""
    dev = own.on(q.device)
    if own.entries == 0:
        lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
        return torch.zeros_like(q), lse
    q_span = q if own.identity else row_ops.gather_rows(q, dev.span_source)
    o, lse = kernel.forward(q_span, kv, own, dev, scale, True)
    if not own.identity:
        o, lse = row_ops.gather_rows(o, dev.local_to_span), row_ops.gather_rows(
            lse, dev.local_to_span
        )
    return o, lse


class _TreeAttention(torch.autograd.Function):
    """query ``[rows, H, d]``, all-gather slots ``[slots, G, 2d]`` -> context ``[rows, H, d]``
    under a tree packing (``tree_tables``): the own-segment causal part and one unmasked call
    per ancestor level, merged by log-sum-exp.

    Backward: every call differentiated against the final output and log-sum-exp; query and key
    gradients added in fp32 by the rows / keys each call touched; padding slots zero.
    """

    @staticmethod
    def forward(ctx, query, kv_slots, tables: TreeTables, kernel, scale, deterministic):
        dev = tables.on(query.device)
        q = query.contiguous()
        kv = _compact_kv(kv_slots, dev.compact_slots)
        o, lse = _own_forward(q, kv, tables.own, kernel, scale)
        for call, rows, part in zip(tables.levels, dev.level_rows, dev.level_slices):
            cd = call.on(q.device)
            if part is not None:  # the level's rows are one range of local rows: no gathers
                o_l, lse_l = kernel.forward(q[part], kv, call, cd, scale, True)
                # Into new buffers, then copied: the merge kernel may not write its inputs
                # (merged in place on an H100, the outputs came out wrong).
                o_m, lse_m = sums.merge(o_l, lse_l, o[part], lse[part])
                o[part] = o_m
                lse[part] = lse_m
                continue
            o_l, lse_l = kernel.forward(row_ops.gather_rows(q, rows), kv, call, cd, scale, True)
            o_m, lse_m = sums.merge(o_l, lse_l, o.index_select(0, rows), lse.index_select(0, rows))
            # In place: o and lse are this forward's own buffers (the kernel's outputs).
            o.index_copy_(0, rows, o_m)
            lse.index_copy_(0, rows, lse_m)
        ctx.tables, ctx.kernel, ctx.scale, ctx.deterministic = tables, kernel, scale, deterministic
        if any(ctx.needs_input_grad[:2]):
            ctx.save_for_backward(q, kv, o, lse)
        return o

    @staticmethod
    def backward(ctx, grad_out):
        q, kv, o, lse = ctx.saved_tensors
        tables, kernel = ctx.tables, ctx.kernel
        dev = tables.on(q.device)
        do = grad_out.contiguous()
        acc = torch.promote_types(q.dtype, torch.float32)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        args = (ctx.scale, ctx.deterministic)
        own = tables.own
        _copy_backward(tables, kernel, q)
        if own.entries:
            od = own.on(q.device)
            pieces = (q, o, do, lse)
            if not own.identity:
                pieces = [row_ops.gather_rows(t, od.span_source) for t in pieces]
            dq_own, dkv_own = _call_backward(
                kernel, pieces[0], _keys_for(own, kv, kernel), pieces[1], pieces[2], pieces[3],
                own, od, *args,
            )  # fmt: skip
            del pieces  # as in the blocked backward: no call's buffers outlive it
            if not own.identity:
                dq_own = row_ops.gather_rows(dq_own, od.local_to_span)
            # The accumulator starts as the own part's gradient (a copy: every row has one).
            dq = dq_own.to(acc, copy=True)
            for dst, src in dev.own_rounds:
                sums.add_key_rows(dkv, dst, dkv_own, src)
            del dq_own, dkv_own
        else:
            dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        for call, rows, part in zip(tables.levels, dev.level_rows, dev.level_slices):
            cd = call.on(q.device)
            if part is not None:
                sub = [t[part] for t in (q, o, do, lse)]
            else:
                sub = [row_ops.gather_rows(t, rows) for t in (q, o, do, lse)]
            dq_l, dkv_l = _call_backward(
                kernel, sub[0], _keys_for(call, kv, kernel), sub[1], sub[2], sub[3], call, cd,
                *args,
            )  # fmt: skip
            del sub
            if part is not None:
                dq[part] += dq_l
            else:
                sums.add_rows(dq, rows, dq_l)
            sums.add_key_rows(dkv, cd.kv_source, dkv_l)
            del dq_l, dkv_l
        dkv = dkv.to(kv.dtype)
        dslots = dkv if dev.slot_rows is None else row_ops.gather_rows(dkv, dev.slot_rows)
        return dq.to(q.dtype), dslots, None, None, None, None


def fused_attention(
    query: torch.Tensor,
    kv_slots: torch.Tensor,
    runs,
    scale: float,
    *,
    kernel: Optional[AttentionKernel] = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Causal attention of the local rows over the gathered keys, by the run tables.

    Args:
        query: ``[rows, H, d]``, this rank's rows in plan order (``runs.rows`` of them).
        kv_slots: ``[slots, G, 2d]``, keys then values of the padded all-gather over CP
            (``runs.slots`` rows: rank r's row i at ``r * max_count + i``), the same dtype;
            ``H`` must be a multiple of ``G``.
        runs: the batch's tables for this rank: ``AttentionRuns``, ``AttentionBlocks`` or, under
            a tree packing, ``TreeTables``.
        scale: softmax scale.
        kernel: the varlen kernel (default: ``cudnn.KERNEL``, cuDNN with its default options).
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
    if isinstance(runs, TreeTables):
        function = _TreeAttention
    elif isinstance(runs, AttentionBlocks):
        function = _BlockedAttention
    else:
        function = _FusedAttention
    return function.apply(
        query,
        kv_slots,
        runs,
        cudnn_kernel.KERNEL if kernel is None else kernel,
        float(scale),
        deterministic,
    )
