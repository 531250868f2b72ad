"""The blocked attention layout's elementwise passes: the log-sum-exp merge and gradient sums.

Both are memory-bound, so each is one pass over its rows (a Triton kernel on CUDA) instead of
torch's chain of casts, products and temporaries; the CPU (and any call Triton cannot take)
runs the same arithmetic in torch.

* ``merge(o_b, lse_b, o_d, lse_d)``: softmax attention over the union of two disjoint key
  sets from each set's output ``[n, H, d]`` and log-sum-exp ``[n, H]`` (``lse_b`` may be -inf:
  no keys there). Weights in fp32; the output in ``o_d``'s dtype.
* ``add_rows(acc, dst, src, src_rows)``: ``acc[dst[i]] += src[src_rows[i]]`` (or ``src[i]``),
  ``acc`` fp32 (float64 for float64 inputs), ``src`` any float dtype; ``dst`` must not repeat.

The kernel's key gradients arrive split, ``[2, M, G, d]`` (dK then dV, any strides with the
last one 1; see ``cudnn.CudnnOptions.separate_key_gradients``), while the all-gather slots hold
each row as ``[G, 2d]`` (per group, key then value). Two passes read them in place, so no pass
interleaves them first:

* ``slot_sums(keys, copies)``: ``out[s] = sum_j keys[copies[j, s]]`` as ``[slots, G, 2d]`` rows
  (``-1``: nothing), summed in fp32 and rounded once to ``keys``' dtype.
* ``add_key_rows(acc, dst, keys, src_rows)``: ``acc[dst[i]] += keys[src_rows[i]]`` (or
  ``keys[i]``), ``acc`` ``[N, G, 2d]`` fp32; ``dst`` must not repeat.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["merge", "add_rows", "slot_sums", "add_key_rows", "interleave"]

try:  # Triton ships with CUDA builds of torch; CPU-only installs may lack it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on installs without Triton
    triton = None


def _use_triton(*tensors: torch.Tensor) -> bool:
    return triton is not None and all(t.is_cuda for t in tensors)


if triton is not None:

    @triton.jit
    def _merge_kernel(
        o_b, lse_b, o_d, lse_d, o, lse, vectors, D: tl.constexpr, BLOCK: tl.constexpr
    ):
        # One program: BLOCK (row, head) vectors of length D.
        v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = v < vectors
        a = tl.load(lse_b + v, mask=live, other=float("-inf"))
        b = tl.load(lse_d + v, mask=live, other=0.0)
        top = tl.maximum(a, b)  # b is finite: every row attends its own key
        wa = tl.exp(a - top)
        wb = tl.exp(b - top)
        total = wa + wb
        tl.store(lse + v, top + tl.log(total), mask=live)
        cols = tl.arange(0, D)
        at = v[:, None] * D + cols[None, :]
        both = live[:, None]
        x = tl.load(o_b + at, mask=both, other=0.0).to(tl.float32)
        y = tl.load(o_d + at, mask=both, other=0.0).to(tl.float32)
        out = (x * (wa / total)[:, None]) + (y * (wb / total)[:, None])
        tl.store(o + at, out.to(o.dtype.element_ty), mask=both)

    @triton.jit
    def _add_rows_kernel(
        acc, dst, src, src_rows, width, HAS_SRC_ROWS: tl.constexpr, BLOCK: tl.constexpr
    ):
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = cols < width
        row = tl.load(dst + i).to(tl.int64)
        if HAS_SRC_ROWS:
            s = tl.load(src_rows + i).to(tl.int64)
        else:
            s = i.to(tl.int64)
        x = tl.load(src + s * width + cols, mask=live, other=0.0).to(acc.dtype.element_ty)
        y = tl.load(acc + row * width + cols, mask=live, other=0.0)
        tl.store(acc + row * width + cols, y + x, mask=live)

    @triton.jit
    def _key_columns(c, s_half, s_group, D: tl.constexpr):
        # Column c of a [G, 2d] row: group c // 2d, key (0) or value (1) half, element c % d.
        return (c // (2 * D)) * s_group + ((c // D) % 2) * s_half + c % D

    @triton.jit
    def _slot_sums_kernel(
        out, keys, copies, slots, count, width, s_half, s_row, s_group,
        D: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        slot = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < width
        at = _key_columns(c, s_half, s_group, D)
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in range(count):
            row = tl.load(copies + j * slots + slot)
            x = tl.load(keys + row * s_row + at, mask=live & (row >= 0), other=0.0)
            total += x.to(tl.float32)
        tl.store(out + slot * width + c, total.to(out.dtype.element_ty), mask=live)

    @triton.jit
    def _add_key_rows_kernel(
        acc, dst, keys, src_rows, width, s_half, s_row, s_group,
        HAS_SRC_ROWS: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = c < width
        row = tl.load(dst + i).to(tl.int64)
        if HAS_SRC_ROWS:
            src = tl.load(src_rows + i).to(tl.int64)
        else:
            src = i
        x = tl.load(keys + src * s_row + _key_columns(c, s_half, s_group, D), mask=live, other=0.0)
        y = tl.load(acc + row * width + c, mask=live, other=0.0)
        tl.store(acc + row * width + c, y + x.to(acc.dtype.element_ty), mask=live)


def interleave(keys: torch.Tensor) -> torch.Tensor:
    """Split key gradients ``[2, M, G, d]`` as slot rows ``[M, G, 2d]`` (a new tensor)."""
    _, m, groups, d = keys.shape
    out = torch.empty((m, groups, 2 * d), dtype=keys.dtype, device=keys.device)
    out.view(m, groups, 2, d).copy_(keys.permute(1, 2, 0, 3))
    return out


def _key_strides(keys: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    """(half, row, group) element strides of split key gradients a kernel can read, else None."""
    if keys.stride(3) != 1:
        return None
    return keys.stride(0), keys.stride(1), keys.stride(2)


def slot_sums(keys: torch.Tensor, copies: torch.Tensor) -> torch.Tensor:
    """``[slots, G, 2d]``: row ``s`` the sum of ``keys[copies[j, s]]`` over ``j`` (split key
    gradients ``[2, M, G, d]``; int64 ``copies`` ``[c, slots]``, ``-1`` adds nothing), summed in
    fp32 (float64 for float64) and rounded once to ``keys``' dtype."""
    _, _, groups, d = keys.shape
    count, slots = copies.shape
    strides = _key_strides(keys)
    if _use_triton(keys, copies) and strides is not None and keys.dtype != torch.float64:
        out = torch.empty((slots, groups, 2 * d), dtype=keys.dtype, device=keys.device)
        width = groups * 2 * d
        block = min(1024, triton.next_power_of_2(width))
        if slots:
            _slot_sums_kernel[(slots, triton.cdiv(width, block))](
                out, keys, copies.contiguous(), slots, count, width, *strides, D=d, BLOCK=block
            )
        return out
    rows = interleave(keys)
    acc = torch.promote_types(keys.dtype, torch.float32)
    total = torch.zeros((slots, groups, 2 * d), dtype=acc, device=keys.device)
    for row in copies:
        live = row >= 0
        total[live] += rows[row[live]].to(acc)
    return total.to(keys.dtype)


def add_key_rows(
    acc: torch.Tensor,
    dst: torch.Tensor,
    keys: torch.Tensor,
    src_rows: Optional[torch.Tensor] = None,
) -> None:
    """``acc[dst[i]] += keys[:, src_rows[i]]`` (``keys[:, i]`` without ``src_rows``) in place:
    ``acc`` fp32 / float64 ``[N, G, 2d]`` (contiguous), ``dst`` int64 ``[k]`` distinct rows
    (the CUDA pass adds without atomics: a repeated row would lose all but one of its terms),
    ``keys`` split ``[2, M, G, d]``, ``src_rows`` int64 ``[k]`` or None."""
    if dst.numel() == 0:
        return
    strides = _key_strides(keys)
    if _use_triton(acc, keys) and strides is not None and acc.dtype == torch.float32:
        d = keys.shape[3]
        width = acc[0].numel()
        block = min(1024, triton.next_power_of_2(width))
        _add_key_rows_kernel[(dst.numel(), triton.cdiv(width, block))](
            acc, dst, keys, src_rows if src_rows is not None else dst, width, *strides,
            HAS_SRC_ROWS=src_rows is not None, D=d, BLOCK=block,
        )  # fmt: skip
        return
    rows = interleave(keys if src_rows is None else keys.index_select(1, src_rows))
    acc.index_add_(0, dst, rows.to(acc.dtype))


def merge(
    o_b: torch.Tensor, lse_b: torch.Tensor, o_d: torch.Tensor, lse_d: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(o [n, H, d], lse [n, H])`` of the union of the two key sets, new tensors (see the
    module doc). The inputs may be views (row ranges of larger buffers)."""
    n, heads, d = o_d.shape
    if _use_triton(o_b, o_d) and d & (d - 1) == 0 and lse_b.dtype == torch.float32:
        o = torch.empty_like(o_d, memory_format=torch.contiguous_format)
        lse = torch.empty_like(lse_d, memory_format=torch.contiguous_format)
        vectors = n * heads
        block = max(1, 4096 // d)
        _merge_kernel[(triton.cdiv(vectors, block),)](
            o_b.contiguous(), lse_b.contiguous(), o_d.contiguous(), lse_d.contiguous(),
            o, lse, vectors, D=d, BLOCK=block,
        )  # fmt: skip
        return o, lse
    lse = torch.logaddexp(lse_b, lse_d)
    o = torch.empty_like(o_d)
    acc = lse.dtype
    rows = 4096  # bounded temporaries
    for a in range(0, n, rows):
        b = min(a + rows, n)
        w_b = (lse_b[a:b] - lse[a:b]).exp().unsqueeze(-1)
        w_d = (lse_d[a:b] - lse[a:b]).exp().unsqueeze(-1)
        o[a:b] = torch.addcmul(o_d[a:b].to(acc) * w_d, o_b[a:b].to(acc), w_b)
    return o, lse


def add_rows(
    acc: torch.Tensor,
    dst: torch.Tensor,
    src: torch.Tensor,
    src_rows: Optional[torch.Tensor] = None,
) -> None:
    """``acc[dst[i]] += src[src_rows[i]]`` in place (``src[i]`` without ``src_rows``).

    Args:
        acc: fp32 / float64 ``[M, ...]``, contiguous.
        dst: int64 ``[k]``, distinct rows of ``acc``.
        src: ``[*, ...]`` rows of the same trailing shape, any float dtype, contiguous.
        src_rows: int64 ``[k]`` or None.
    """
    if dst.numel() == 0:
        return
    if _use_triton(acc, src):
        width = acc[0].numel()
        block = 1024
        _add_rows_kernel[(dst.numel(), triton.cdiv(width, block))](
            acc, dst, src, src_rows if src_rows is not None else dst, width,
            HAS_SRC_ROWS=src_rows is not None, BLOCK=block,
        )  # fmt: skip
        return
    picked = src if src_rows is None else src.index_select(0, src_rows)
    acc.index_add_(0, dst, picked.to(acc.dtype))
