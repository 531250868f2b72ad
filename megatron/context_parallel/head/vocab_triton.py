"""Triton kernels of the vocab-parallel head (used by ``vocab_ops``; not a public module).

Two main kernels, both a ``hidden @ weight.T`` matmul with fp32 accumulation whose logits stay
in registers, and small ones for the top-k (``_merge_topk_kernel`` merges the forward's splits;
``_logit_keys_kernel``, ``_chunk_topk_kernel`` and ``_merge_keys_kernel`` select again, exactly,
the few rows the grouped selection could have got wrong, from their logits' order keys):

* ``_stats_fwd_kernel``: each program owns a block of ``BM`` rows and a contiguous range of
  vocabulary tiles (a "split"). Per tile it runs the K loop, then folds the fp32 tile into running
  per-row statistics: max, sum of ``exp(logit - max)`` (rescaled when the max grows), the target's
  logit and an unsorted running top-k. Each program writes one partial result per row; a few torch
  ops combine the splits (``vocab_ops._combine_splits``).
* ``_dlogits_kernel``: ``[BM, BN]`` tiles of a vocabulary slice, walked by as many programs as
  fit the device at once. It recomputes the logits and writes ``d = g_s * exp(logit - row_max) +
  (sum of grad_ids at ids equal to the column)`` rounded ONCE to the output dtype; cuBLAS then
  forms dW and dH from it. With the flattened tile loop Triton starts the next tile's operand
  loads during this tile's epilogue, and a descriptor store lets the copy engine drain ``d``
  while the next tile computes (H200: 1.35 -> 1.10 GEMMs for this kernel).

Running top-k in the forward: a row keeps ``KP`` slots (a power of two; slots past ``K`` are
never the minimum). The threshold is the row's smallest slot. Candidates enter in descending
(value, then lowest column) order, one per pass, each replacing the row's smallest slot. A pass
is a chain of dependent reductions across the program's threads, so passes, not elements, set
the cost. Two ways to choose the candidates:

* grouped (``GROUPED=True``, the default): columns ``j * G + b`` of a tile form group ``b``,
  which one thread holds in the accumulator layout, so each group's two largest come from
  in-thread reductions. Only those are offered (``2 G`` per row and tile), with slots and
  candidates as int64 order keys (value, then column), so a pass is two reductions. Every tile
  gets exactly ``PASSES`` passes, unrolled: with no inner loop of data-dependent length and no
  data-dependent branch, Triton fuses the flattened tile loop and loads the next tile's
  operands during this tile's epilogue (H200, k = 20, 3 passes: kernel 1.16-1.19 GEMMs against
  1.24-1.32 with as many passes as needed). The largest logit never offered, and the largest
  candidate above the threshold the passes did not reach, are kept per row; the rows where
  that reaches the k-th value are selected again over every element
  (``vocab_ops._reselect_into``; otherwise the result is exact).
* every element of the tile (``GROUPED=False``: the exact re-selection over a row list, or
  ``grouped`` configured off): exact by construction; as many passes as the row with the most
  elements above its threshold needs (~20 on a split's first tiles), skipped on tiles where no
  logit beats any row's threshold. Triton 3.6 cannot flatten this loop.

Works with Triton 3.6 and 3.8, and under ``TRITON_INTERPRET=1`` on CPU tensors for small
shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)
_BIG = tl.constexpr(2147483647)


@triton.jit
def _tile_logits(
    operands,
    rows_ld,
    cols,
    row0,
    col0,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
    PROMOTE: tl.constexpr,
):
    """The fp32 ``[BM, BN]`` logits of hidden rows ``row0..`` against the vocabulary columns
    ``cols`` (int32 ``[BN]``, ``col0 ..``) over ``H``. Columns past ``V`` hold the logits of
    column ``% V`` (or zeros, through descriptors): callers mask or drop them.

    ``operands``: ``(h_ptr, w_ptr, h_desc, w_desc, stride_h, stride_w, H, V)``, as every kernel
    here gathers its arguments. With ``USE_TMA`` the tiles come through the tensor descriptors
    (the copy engine zero-fills rows past the end); otherwise through ``[BM, BK]`` / ``[BN, BK]``
    pointer blocks at the int64 hidden rows ``rows_ld`` (``[BM]``; callers keep them in range)
    and the weight rows ``column % V``. With ``PROMOTE`` each ``BK`` block's product is summed
    by the tensor cores from zero and added to the running sum with ordinary (round-to-nearest)
    fp32 adds: the tensor cores' accumulation into a large running sum is less exact than IEEE
    fp32 (H200, H = 5,120: 4.4e-5 from fp64 against 2.4e-6 promoted), at the cost of a second
    ``[BM, BN]`` fp32 tile in registers.
    """
    h_ptr, w_ptr, h_desc, w_desc, stride_h, stride_w, H, V = operands
    BM: tl.constexpr = rows_ld.shape[0]
    BN: tl.constexpr = cols.shape[0]
    cols_ld = (cols % V).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    rk = tl.arange(0, BK)
    a_ptrs = h_ptr + rows_ld[:, None] * stride_h + rk[None, :]
    b_ptrs = w_ptr + cols_ld[:, None] * stride_w + rk[None, :]
    for k0 in range(0, H, BK):
        if USE_TMA:
            a = h_desc.load([row0, k0])
            b = w_desc.load([col0, k0])
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = (k0 + rk) < H
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
        elif PROMOTE:
            # An fma by 1.0, not "+=": Triton folds "acc + dot(a, b)" back into the tensor-core
            # accumulation; the fma is one IEEE round-to-nearest add.
            acc = tl.fma(tl.dot(a, tl.trans(b)), 1.0, acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BK
        b_ptrs += BK
    return acc


_KEY_MAX = tl.constexpr(9223372036854775807)
_KEY_MIN = tl.constexpr(-9223372036854775807)


@triton.jit
def _order_key(v, c):
    """int64 keys of fp32 values ``v`` at int32 columns ``c`` (``0 <= c < 2**31``): a larger key
    is a larger value, or the same value at a lower column. Decoded by ``_key_value`` and
    ``_key_col``."""
    b = v.to(tl.int32, bitcast=True)
    # Negative floats order backwards as integers: flip their magnitude bits.
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b.to(tl.int64) << 32) | (0xFFFFFFFF - c.to(tl.int64))


@triton.jit
def _key_value(key):
    b = (key >> 32).to(tl.int32)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _key_col(key):
    return (0xFFFFFFFF - (key & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def _pick_after(acc, cols, last_v, last_c, thr):
    """Per row, the largest element after ``(last_v, last_c)`` in (value descending, column
    ascending) order: its value and lowest column (BIG where it does not beat ``thr``)."""
    after = (acc < last_v[:, None]) | ((acc == last_v[:, None]) & (cols[None, :] > last_c[:, None]))
    best_v = tl.max(tl.where(after, acc, float("-inf")), axis=1)
    hit = after & (acc == best_v[:, None]) & (best_v > thr)[:, None]
    return best_v, tl.min(tl.where(hit, cols[None, :], _BIG), axis=1)


@triton.jit
def _group_top2(acc, col0, BM: tl.constexpr, BN: tl.constexpr, G: tl.constexpr):
    """Each column group's two largest logits of one ``[BM, BN]`` tile (first column ``col0``).

    Columns ``j * G + b`` (``j < BN / G``) form group ``b``: in the tensor cores' accumulator
    layout one thread holds all of a group's columns for its rows, so these reductions need no
    exchange between threads. Returns fp32 ``[BM, G]`` largest values, int32 their columns (the
    lowest among equal values), the same for the second largest, and fp32 ``[BM]`` the largest
    value any group has after those two (-inf if none).
    """
    J: tl.constexpr = BN // G
    x = tl.reshape(acc, (BM, J, G))
    jj = tl.arange(0, J)[None, :, None]
    gb = col0 + tl.arange(0, G)[None, :]
    v1 = tl.max(x, axis=1)
    j1 = tl.min(tl.where(x == v1[:, None, :], jj, J), axis=1)
    x = tl.where(jj == j1[:, None, :], float("-inf"), x)
    v2 = tl.max(x, axis=1)
    j2 = tl.min(tl.where(x == v2[:, None, :], jj, J), axis=1)
    x = tl.where(jj == j2[:, None, :], float("-inf"), x)
    return v1, j1 * G + gb, v2, j2 * G + gb, tl.max(tl.max(x, axis=1), axis=1)


@triton.jit
def _insert_next(cand_k, last_k, top_k, thr_k):
    """One selection pass: the row's next candidate key below ``last_k`` replaces the row's
    smallest slot ``thr_k`` when larger. Keys are distinct, so this is two reductions."""
    best = tl.max(tl.where(cand_k < last_k[:, None], cand_k, _KEY_MIN), axis=1)
    put = (top_k == thr_k[:, None]) & (best > thr_k)[:, None]
    top_k = tl.where(put, best[:, None], top_k)
    return top_k, tl.min(top_k, axis=1), best


@triton.jit
def _offer_grouped(
    acc,
    col0,
    V,
    top_k,
    thr_k,
    bound,
    drop,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    G: tl.constexpr,
    PASSES: tl.constexpr,
):
    """Offers each column group's two largest logits of the tile ``acc`` (first column ``col0``)
    to the running top-k ``top_k`` (int64 order keys, row minimum ``thr_k``) in exactly
    ``PASSES`` passes, unrolled: no inner loop of data-dependent length, so Triton can fuse the
    flattened tile loop. Returns the updated ``top_k``, ``thr_k``, ``bound`` (the largest logit
    not offered: a group's third or lower) and ``drop`` (the largest offered one that the passes
    did not reach, above the row minimum).
    """
    v1, c1, v2, c2, beyond = _group_top2(acc, col0, BM, BN, G)
    bound = tl.maximum(bound, beyond)
    cand_v = tl.reshape(tl.join(v1, v2), (BM, 2 * G))
    cand_c = tl.reshape(tl.join(c1, c2), (BM, 2 * G))
    real = (cand_c < V) & (cand_v > float("-inf"))
    cand_k = tl.where(real, _order_key(cand_v, cand_c), _KEY_MIN)
    last_k = tl.full((BM,), _KEY_MAX, tl.int64)
    for _ in tl.static_range(PASSES):
        top_k, thr_k, last_k = _insert_next(cand_k, last_k, top_k, thr_k)
    rest = tl.max(tl.where(cand_k < last_k[:, None], cand_k, _KEY_MIN), axis=1)
    drop = tl.maximum(drop, tl.where(rest > thr_k, _key_value(rest), float("-inf")))
    return top_k, thr_k, bound, drop


@triton.jit
def _offer_every(acc, cols, tile_max, top_v, top_i, K: tl.constexpr, KP: tl.constexpr):
    """Offers every element of the tile ``acc`` (columns ``cols``) to the running top-k values
    ``top_v`` / columns ``top_i`` (``[BM, KP]``), one candidate per pass in (value descending,
    column ascending) order, as many passes as the row with the most elements above its
    smallest slot needs; tiles whose ``tile_max`` beats no row's smallest slot skip the passes.
    Exact by construction. Returns the updated ``top_v``, ``top_i``."""
    kcols = tl.arange(0, KP)
    thr = tl.min(top_v, axis=1)
    if tl.max((tile_max > thr).to(tl.int32), axis=0) > 0:
        above = tl.sum((acc > thr[:, None]).to(tl.int32), axis=1)
        passes = tl.minimum(tl.max(above, axis=0), K)
        last_v = tl.full((acc.shape[0],), float("inf"), tl.float32)
        last_c = tl.full((acc.shape[0],), -1, tl.int32)
        for _ in range(passes):
            # The next element after the last pick replaces the row's smallest slot when above it.
            best_v, best_c = _pick_after(acc, cols, last_v, last_c, thr)
            take = best_v > thr
            slot = tl.min(tl.where(top_v == thr[:, None], kcols[None, :], KP), axis=1)
            put = take[:, None] & (kcols[None, :] == slot[:, None])
            top_v = tl.where(put, best_v[:, None], top_v)
            top_i = tl.where(put, best_c[:, None], top_i)
            thr = tl.min(top_v, axis=1)
            last_v = best_v
            last_c = best_c
    return top_v, top_i


@triton.jit
def _program_block(pid, n, num_splits, BM: tl.constexpr, GROUP_R: tl.constexpr):
    """The row block and the vocabulary split of program ``pid``. Programs that run together
    share a few row blocks and a few splits, so the hidden rows and the weight tiles they stream
    are read from DRAM about once per step and then hit L2."""
    num_r = tl.cdiv(n, BM)
    width = GROUP_R * num_splits
    first_r = (pid // width) * GROUP_R
    size_r = tl.minimum(num_r - first_r, GROUP_R)
    local = pid % width
    return first_r + local % size_r, local // size_r


@triton.jit
def _fold_stats(acc, m_i, s_i):
    """Folds the tile ``acc`` into the rows' running max ``m_i`` and sum ``s_i`` of
    ``exp(logit - max)`` (rescaled when the max grows); also returns the tile's row maxima."""
    tile_max = tl.max(acc, axis=1)
    m_new = tl.maximum(m_i, tile_max)
    p = tl.exp2(acc * _LOG2E - (m_new * _LOG2E)[:, None])
    s_i = s_i * tl.exp2((m_i - m_new) * _LOG2E) + tl.sum(p, axis=1)
    return m_new, s_i, tile_max


@triton.jit
def _dlogits_tile(acc, cols, rows_ld, c, grads):
    """fp32 ``d_logits`` of the logits tile ``acc`` (columns ``cols``, column block ``c`` of the
    slice; hidden rows ``rows_ld``): ``g_s * exp(logit - row_max)`` plus, at each column, the
    gradients of the ids equal to it. Each row's ids are sorted; ``pos[row, c] .. pos[row, c +
    1]`` are the ones in this tile. ``grads``: ``(max_ptr, gs_ptr, ids_ptr, gid_ptr, pos_ptr,
    stride_ids, stride_pos)``. Shared with ``vocab_gluon``'s d_logits epilogue."""
    max_ptr, gs_ptr, ids_ptr, gid_ptr, pos_ptr, stride_ids, stride_pos = grads
    row_max = tl.load(max_ptr + rows_ld)
    g_s = tl.load(gs_ptr + rows_ld)
    d = g_s[:, None] * tl.exp2(acc * _LOG2E - (row_max * _LOG2E)[:, None])
    first = tl.load(pos_ptr + rows_ld * stride_pos + c)
    stop = tl.load(pos_ptr + rows_ld * stride_pos + c + 1)
    passes = tl.max(stop - first, axis=0)
    for j in range(passes):
        at = first + j
        ok = at < stop
        id_j = tl.load(ids_ptr + rows_ld * stride_ids + at, mask=ok, other=-1)
        g_j = tl.load(gid_ptr + rows_ld * stride_ids + at, mask=ok, other=0.0)
        d += tl.where(cols[None, :] == id_j[:, None], g_j[:, None], 0.0)
    return d


@triton.jit
def _store_stats(out, n, rmask, m_i, s_i, t_i):
    """Stores a block of rows' running max, sum of exp and target logit at ``out``, ``out + n``
    and ``out + 2 n`` (one split's ``[PARTS, n]`` partial results; shared with ``vocab_gluon``)."""
    tl.store(out, m_i, mask=rmask)
    tl.store(out + n, s_i, mask=rmask)
    tl.store(out + 2 * n, t_i, mask=rmask)


@triton.jit
def _decode_slots(top_k, V):
    """The values and ids of running top-k slots held as order keys; empty slots (and columns
    outside ``[0, V)``) come out as -inf and id -1. Shared with ``vocab_gluon``."""
    top_v = _key_value(top_k)
    top_i = _key_col(top_k)
    # Empty slots decode to -inf and a negative column.
    return top_v, tl.where((top_i >= 0) & (top_i < V), top_i, -1)


@triton.jit
def _empty_keys(BM: tl.constexpr, KP: tl.constexpr, K: tl.constexpr):
    """The running top-k of grouped candidates before any tile: ``[BM, KP]`` order keys. Empty
    slots below K hold distinct keys under every real one; slots past K hold keys over every
    real one, so they are never the row minimum."""
    kcols = tl.arange(0, KP)
    neg_inf = tl.full((BM, KP), float("-inf"), tl.float32)
    slot = kcols[None, :].to(tl.int64)
    empty = _order_key(neg_inf, tl.zeros((BM, KP), tl.int32)) - 0xFFFFFFFF + slot
    return tl.where(kcols[None, :] < K, empty, -slot + _KEY_MAX)


@triton.jit
def _empty_slots(BM: tl.constexpr, KP: tl.constexpr, K: tl.constexpr):
    """The running top-k over every element before any tile: ``[BM, KP]`` values (-inf) and
    columns (-1). Slots past K hold +inf: never the row minimum, so never replaced, never
    output."""
    kcols = tl.arange(0, KP)
    top_v = tl.where(kcols[None, :] < K, float("-inf"), float("inf")) + tl.zeros(
        (BM, KP), tl.float32
    )
    return top_v, tl.zeros((BM, KP), tl.int32) - 1


@triton.jit
def _store_slots(topv_ptr, topi_ptr, split, rows, n, rmask, top_v, top_i, K: tl.constexpr):
    """Stores a program's running top-k (``[BM, KP]`` values and int32 columns) as its split's
    slots of ``[S, n, KP]``; slots past K as -inf."""
    KP: tl.constexpr = top_v.shape[1]
    kcols = tl.arange(0, KP)
    out = (split * n + rows).to(tl.int64)[:, None] * KP + kcols[None, :]
    tl.store(
        topv_ptr + out, tl.where(kcols[None, :] < K, top_v, float("-inf")), mask=rmask[:, None]
    )
    tl.store(topi_ptr + out, top_i, mask=rmask[:, None])


# Sizes that only bound loops or masks are not specialised on (no recompile per row count or
# slice); strides and pointers keep Triton's divisibility specialisation (vector loads).
@triton.jit(do_not_specialize=["n", "V", "H", "tiles_per_split", "num_splits"])
def _stats_fwd_kernel(
    h_ptr,
    w_ptr,
    h_desc,
    w_desc,
    tgt_ptr,
    part_ptr,
    topv_ptr,
    topi_ptr,
    n,
    V,
    H,
    stride_h,
    stride_w,
    tiles_per_split,
    num_splits,
    K: tl.constexpr,
    KP: tl.constexpr,
    HAS_TARGET: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_R: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
    PROMOTE: tl.constexpr,
    FLATTEN: tl.constexpr,
    GROUPED: tl.constexpr,
    G: tl.constexpr,
    PASSES: tl.constexpr,
    PARTS: tl.constexpr,
    ROW_LIST: tl.constexpr = False,
):
    r, split = _program_block(tl.program_id(0), n, num_splits, BM, GROUP_R)
    rows = r * BM + tl.arange(0, BM)
    if ROW_LIST:
        # tgt_ptr holds int64 [1 + n]: a count c, then hidden row indices; output row j (j < c)
        # is hidden row tgt_ptr[1 + j]. Whole blocks past c stop here, so the launch costs
        # next to nothing when c is small, whatever n is.
        count = tl.load(tgt_ptr).to(tl.int32)
        if r * BM >= count:
            return
        rows_ld = tl.load(tgt_ptr + 1 + tl.minimum(rows, count - 1))
        n_out = count
    else:
        # Rows past n read row (rows % n) instead of masking: the K loop stays mask-free and
        # those rows are never stored.
        rows_ld = (rows % n).to(tl.int64)
        n_out = n

    num_tiles = tl.cdiv(V, BN)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full((BM,), float("-inf"), tl.float32)
    s_i = tl.zeros((BM,), tl.float32)
    t_i = tl.zeros((BM,), tl.float32)
    if HAS_TARGET:
        tgt = tl.load(tgt_ptr + rows_ld)
        tgt = tl.where((tgt >= 0) & (tgt < V), tgt, -1).to(tl.int32)
    if KP > 0:
        if GROUPED:
            top_k = _empty_keys(BM, KP, K)
            thr_k = tl.min(top_k, axis=1)
            bound = tl.full((BM,), float("-inf"), tl.float32)
            drop = tl.full((BM,), float("-inf"), tl.float32)
        else:
            top_v, top_i = _empty_slots(BM, KP, K)

    operands = (h_ptr, w_ptr, h_desc, w_desc, stride_h, stride_w, H, V)
    for tile in tl.range(tile_lo, tile_hi, flatten=FLATTEN):
        cols = tile * BN + tl.arange(0, BN)
        acc = _tile_logits(
            operands, rows_ld, cols, r * BM, tile * BN, BK, EVEN_K, IEEE, USE_TMA, PROMOTE
        )
        acc = tl.where(cols[None, :] < V, acc, float("-inf"))
        m_i, s_i, tile_max = _fold_stats(acc, m_i, s_i)
        if HAS_TARGET:
            # Picked on every tile: a data-dependent branch would keep Triton from fusing the
            # flattened loop.
            t_i += tl.sum(tl.where(cols[None, :] == tgt[:, None], acc, 0.0), axis=1)
        if KP > 0:
            if GROUPED:
                top_k, thr_k, bound, drop = _offer_grouped(
                    acc, tile * BN, V, top_k, thr_k, bound, drop, K, BM, BN, G, PASSES
                )
            else:
                top_v, top_i = _offer_every(acc, cols, tile_max, top_v, top_i, K, KP)

    rmask = rows < n_out
    base = part_ptr + split * PARTS * n + rows
    _store_stats(base, n, rmask, m_i, s_i, t_i)
    if GROUPED:
        tl.store(base + 3 * n, tl.maximum(bound, drop), mask=rmask)
    if KP > 0:
        if GROUPED:
            top_v, top_i = _decode_slots(top_k, V)
        _store_slots(topv_ptr, topi_ptr, split, rows, n, rmask, top_v, top_i, K)


@triton.jit(
    do_not_specialize=["n", "V", "H", "v0", "width", "stride_ids", "stride_pos", "num_progs"]
)
def _dlogits_kernel(
    h_ptr,
    w_ptr,
    h_desc,
    w_desc,
    d_desc,
    max_ptr,
    gs_ptr,
    ids_ptr,
    gid_ptr,
    pos_ptr,
    d_ptr,
    n,
    V,
    H,
    v0,
    width,
    stride_h,
    stride_w,
    stride_ids,
    stride_pos,
    stride_d,
    num_progs,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_R: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
    PROMOTE: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    # Program p takes tiles p, p + num_progs, ... of the slice (num_progs: the programs that fit
    # the device at once), numbered in grouped order: row blocks fastest within a group of
    # GROUP_R, so the programs running together share their hidden rows and weight tiles in L2.
    # The flattened loop starts the next tile's operand loads during this tile's epilogue.
    pid = tl.program_id(0)
    num_r = tl.cdiv(n, BM)
    num_c = tl.cdiv(width, BN)
    per_group = GROUP_R * num_c
    operands = (h_ptr, w_ptr, h_desc, w_desc, stride_h, stride_w, H, V)
    grads = (max_ptr, gs_ptr, ids_ptr, gid_ptr, pos_ptr, stride_ids, stride_pos)
    for t in tl.range(pid, num_r * num_c, num_progs, flatten=True):
        first_r = (t // per_group) * GROUP_R
        size_r = tl.minimum(num_r - first_r, GROUP_R)
        r = first_r + (t % per_group) % size_r
        c = (t % per_group) // size_r

        rows = r * BM + tl.arange(0, BM)
        rows_ld = (rows % n).to(tl.int64)
        local_cols = c * BN + tl.arange(0, BN)
        cols = v0 + local_cols
        acc = _tile_logits(
            operands, rows_ld, cols, r * BM, v0 + c * BN, BK, EVEN_K, IEEE, USE_TMA, PROMOTE
        )
        d = _dlogits_tile(acc, cols, rows_ld, c, grads)
        if TMA_STORE:
            # The copy engine clips rows past n and columns past width, and the store drains
            # while the next tile's loads start.
            d_desc.store([r * BM, c * BN], d.to(d_desc.dtype))
        else:
            out = d_ptr + rows.to(tl.int64)[:, None] * stride_d + local_cols[None, :]
            mask = (rows < n)[:, None] & (local_cols < width)[None, :]
            tl.store(out, d.to(d_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _emit_top(key, out_v, out_i, ok, V, K: tl.constexpr):
    """Stores, per row of the int64 order keys ``key`` ``[R, W]`` (distinct within a row), the K
    largest in descending order: values at ``out_v + t`` and ids at ``out_i + t`` (``[R]``
    pointers, rows where ``ok``). Ids come from the keys; ids outside ``[0, V)`` (padding, whose
    keys hold -inf) and rows short of K keys come out as -inf and -1. One reduction per pass."""
    for t in tl.static_range(K):
        best = tl.max(key, axis=1)
        col = _key_col(best)
        tl.store(out_v + t, tl.where(best > _KEY_MIN, _key_value(best), float("-inf")), mask=ok)
        tl.store(out_i + t, tl.where((col >= 0) & (col < V), col, -1).to(tl.int64), mask=ok)
        key = tl.where(key == best[:, None], _KEY_MIN, key)


@triton.jit(do_not_specialize=["n", "S", "V"])
def _merge_topk_kernel(
    topv_ptr,
    topi_ptr,
    out_v_ptr,
    out_i_ptr,
    list_ptr,
    n,
    S,
    V,
    K: tl.constexpr,
    KP: tl.constexpr,
    W: tl.constexpr,
    R: tl.constexpr,
    ROW_LIST: tl.constexpr,
):
    # Rows r0..r0+R: the first K slots of each of the S splits (fp32 values, int32 ids, laid out
    # [S, n, KP]) become W int64 order keys per row; K passes take the largest key each.
    # ROW_LIST: list_ptr holds int64 [1 + n], a count c then output rows; row j < c of the slots
    # goes to output row list_ptr[1 + j], and programs past c stop at once.
    rows = tl.program_id(0) * R + tl.arange(0, R)
    if ROW_LIST:
        count = tl.load(list_ptr).to(tl.int32)
        if tl.program_id(0) * R >= count:
            return
        live = rows < count
        dest = tl.load(list_ptr + 1 + rows, mask=live, other=0)
    else:
        live = rows < n
        dest = rows.to(tl.int64)
    c = tl.arange(0, W)
    s = c // K
    ok = live[:, None] & (s < S)[None, :]
    at = (s[None, :].to(tl.int64) * n + rows[:, None]) * KP + (c % K)[None, :]
    v = tl.load(topv_ptr + at, mask=ok, other=float("-inf"))
    ids = tl.load(topi_ptr + at, mask=ok, other=-1)
    # A row's ids are distinct (each column lives in one split, once), so keys on (value, id)
    # are: equal values come out in ascending id, as from every other selection path. Empty
    # slots (id -1) get distinct columns past every id, which decode as empty again.
    col = tl.where(ids >= 0, ids, _BIG - W + c[None, :])
    key = tl.where(ok, _order_key(v, col), _KEY_MIN)
    out = dest * K
    _emit_top(key, out_v_ptr + out, out_i_ptr + out, live, V, K)


@triton.jit(do_not_specialize=["width", "stride_key", "stride_floor"])
def _chunk_topk_kernel(
    key_ptr,
    count_ptr,
    floor_ptr,
    row_ptr,
    out_ptr,
    width,
    stride_key,
    stride_floor,
    K: tl.constexpr,
    KP: tl.constexpr,
    C: tl.constexpr,
    HAS_FLOOR: tl.constexpr,
):
    # Row r, columns c*C .. c*C+C of the logit keys: their K largest keys to out[r, c, :] (the
    # rest of the K slots: KEY_MIN). Rows at or past the device-side count stop at once.
    r = tl.program_id(0)
    c = tl.program_id(1)
    if r >= tl.load(count_ptr):
        return
    cols = c * C + tl.arange(0, C)
    key = tl.load(key_ptr + r.to(tl.int64) * stride_key + cols, mask=cols < width, other=_KEY_MIN)
    if HAS_FLOOR:
        # A value the row's k-th largest is known to reach (output row row_ptr[r]): nothing
        # below it is in the top k, so a chunk needs a pass per key at or above it (~1-2).
        fb = tl.load(floor_ptr + tl.load(row_ptr + r) * stride_floor).to(tl.int32, bitcast=True)
        low = (fb ^ ((fb >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32
        key = tl.where(key >= low, key, _KEY_MIN)
    passes = tl.minimum(tl.sum((key > _KEY_MIN).to(tl.int32), axis=0), K)
    slot = tl.arange(0, KP)
    picks = tl.full((KP,), _KEY_MIN, tl.int64)
    for t in range(passes):
        best = tl.max(key, axis=0)
        picks = tl.where(slot == t, best, picks)
        key = tl.where(key == best, _KEY_MIN, key)
    out = out_ptr + (r.to(tl.int64) * tl.num_programs(1) + c) * K
    tl.store(out + slot, picks, mask=slot < K)


@triton.jit(do_not_specialize=["V"])
def _merge_keys_kernel(
    cand_ptr,
    count_ptr,
    row_ptr,
    out_v_ptr,
    out_i_ptr,
    V,
    K: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
):
    # Row j of the candidates [m, W] (int64 keys, W = chunks * K): its K largest as values and
    # ids, written to output row row_ptr[j]. Rows at or past the device-side count stop at once.
    j = tl.program_id(0)
    if j >= tl.load(count_ptr):
        return
    c = tl.arange(0, WP)
    key = tl.load(cand_ptr + j.to(tl.int64) * W + c, mask=c < W, other=_KEY_MIN)
    dest = tl.load(row_ptr + j).to(tl.int64) * K + tl.zeros((1,), tl.int64)
    _emit_top(key[None, :], out_v_ptr + dest, out_i_ptr + dest, dest >= 0, V, K)


@triton.jit(do_not_specialize=["n", "V", "H", "num_progs"])
def _logit_keys_kernel(
    h_ptr,
    w_ptr,
    h_desc,
    w_desc,
    key_ptr,
    count_ptr,
    n,
    V,
    H,
    stride_h,
    stride_w,
    stride_key,
    num_progs,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
    PROMOTE: tl.constexpr,
    HAS_COUNT: tl.constexpr,
):
    # With HAS_COUNT only the first min(n, *count_ptr) rows: a row count that only the device
    # knows yet (zero: nothing to do).
    if HAS_COUNT:
        n = tl.minimum(tl.load(count_ptr).to(tl.int32), n)
    # Program p computes tiles p, p + num_progs, ... (row blocks fastest) with the forward
    # kernel's tile code, so the logits are bit for bit the forward's, and stores their order
    # keys; columns past V (up to the last tile's end) get keys of -inf, below every logit.
    # (A flattened loop would stage the int64 tile through shared memory: 272 KiB, over the
    # limit, with Triton 3.6 for sm_90.)
    pid = tl.program_id(0)
    num_r = tl.cdiv(n, BM)
    operands = (h_ptr, w_ptr, h_desc, w_desc, stride_h, stride_w, H, V)
    for t in range(pid, num_r * tl.cdiv(V, BN), num_progs):
        r = t % num_r
        c = t // num_r
        rows = r * BM + tl.arange(0, BM)
        rows_ld = (rows % n).to(tl.int64)
        cols = c * BN + tl.arange(0, BN)
        acc = _tile_logits(
            operands, rows_ld, cols, r * BM, c * BN, BK, EVEN_K, IEEE, USE_TMA, PROMOTE
        )
        acc = tl.where(cols[None, :] < V, acc, float("-inf"))
        key = _order_key(acc, cols[None, :] + tl.zeros((BM, BN), tl.int32))
        out = key_ptr + rows.to(tl.int64)[:, None] * stride_key + cols[None, :]
        tl.store(out, key, mask=(rows < n)[:, None])


# --- launch helpers ------------------------------------------------------------------------------
# Whether a launch reads its operands (and the d_logits kernel writes d) through tensor descriptors
# is the caller's choice (``use_tma``: ``vocab_ops`` decides with ``vocab_ops.tma_ok``).


def _descriptors(hidden, weight, bm, bn, bk, use_tma):
    """Tensor descriptors of the two operands when the copy engine can load them, else the
    tensors themselves (then unused by the kernel)."""
    if not use_tma:
        return hidden, weight
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (
        TensorDescriptor.from_tensor(hidden, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bn, bk]),
    )


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _tile_meta(hidden, cfg, use_tma: bool) -> dict:
    """The compile-time arguments of ``_tile_logits`` (and the launch options) that every logits
    kernel takes from its tile ``cfg``, the operands and ``use_tma``."""
    h, bk = hidden.shape[1], cfg["BK"]
    return dict(
        BM=cfg["BM"],
        BN=cfg["BN"],
        BK=bk,
        EVEN_K=(h % bk == 0),
        IEEE=hidden.dtype.itemsize == 4,
        USE_TMA=use_tma,
        PROMOTE=bool(cfg.get("promote")),
        num_warps=cfg["warps"],
        num_stages=cfg["stages"],
    )


def _stats_meta(k, target, grouped, row_list, part, cfg) -> dict:
    """The forward kernel's compile-time arguments beyond the tile's (see ``launch_stats_fwd``)."""
    return dict(
        K=k,
        KP=_next_pow2(max(k, 2)) if k else 0,
        HAS_TARGET=target is not None,
        GROUP_R=cfg.get("GROUP", 8),
        # Triton 3.6 cannot flatten a tile loop holding the every-element selection passes.
        FLATTEN=not (k and not grouped),
        GROUPED=bool(grouped and k),
        G=cfg.get("G", 8),
        PASSES=int(cfg.get("passes", 0)),
        PARTS=part.shape[1],
        ROW_LIST=row_list is not None,
    )


def launch_stats_fwd(
    hidden, weight, target, k, part, topv, topi, splits, cfg, grouped=False, row_list=None, *,
    use_tma: bool,
):  # fmt: skip
    """Runs the forward kernel into preallocated partials; returns nothing.

    ``part`` is fp32 ``[splits, 3 or 4, n]``: max, sum_exp, target logit and, with ``grouped``
    top-k candidates (each column group's two largest per tile, see ``_group_top2``), the
    largest logit that was not offered. ``use_tma``: load the operands through tensor
    descriptors (the caller checks that the copy engine can address them).

    ``row_list``: None, or int64 ``[1 + m]`` on the device: a count ``c <= m``, then ``m`` row
    indices of ``hidden``. The kernel then computes output rows ``j < c`` from hidden rows
    ``row_list[1 + j]`` (partials sized for ``n = m`` rows; no target; pointer loads), and the
    launch, sized for all ``m``, costs next to nothing past ``c``: the host need not know ``c``.
    """
    assert row_list is None or target is None, "a row-list launch takes no target"
    # A listed row block is not a run of rows a descriptor could load.
    assert row_list is None or not use_tma, "a row-list launch loads through pointers"
    assert not (grouped and k) or cfg["passes"] >= 1, "grouped candidates take passes >= 1"
    n = hidden.shape[0] if row_list is None else row_list.shape[0] - 1
    v = weight.shape[0]
    tiles = triton.cdiv(v, cfg["BN"])
    h_desc, w_desc = _descriptors(hidden, weight, cfg["BM"], cfg["BN"], cfg["BK"], use_tma)
    # A row list travels in the target's slot; with neither, the slot gets an unused pointer.
    slot = row_list if row_list is not None else target if target is not None else hidden
    _stats_fwd_kernel[(triton.cdiv(n, cfg["BM"]) * splits,)](
        hidden,
        weight,
        h_desc,
        w_desc,
        slot,
        part,
        topv,
        topi,
        n,
        v,
        hidden.shape[1],
        hidden.stride(0),
        weight.stride(0),
        triton.cdiv(tiles, splits),
        splits,
        **_stats_meta(k, target, grouped, row_list, part, cfg),
        **_tile_meta(hidden, cfg, use_tma),
    )


def launch_dlogits(
    hidden, weight, row_max, grad_sum_exp, ids, grad_ids, pos, d, v0, cfg, slots, *, use_tma: bool
):
    """Writes ``d[:, :width]`` (a ``[n, width]`` view) for vocabulary columns ``v0 .. v0+width``.

    ``min(tiles, slots)`` programs (``slots``: the programs that fit the device at once) walk the
    slice's tiles. ``use_tma``: the operands are loaded and ``d`` is stored through tensor
    descriptors (the caller checks that the copy engine can address all three; H200: 1.35 ->
    1.10 GEMMs with the flattened loop and the persistent grid), else through pointers.
    """
    n, h = hidden.shape
    width = d.shape[1]
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    tiles = triton.cdiv(n, bm) * triton.cdiv(width, bn)
    progs = max(1, min(tiles, slots))
    h_desc, w_desc = _descriptors(hidden, weight, bm, bn, bk, use_tma)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        d_desc = TensorDescriptor(d, list(d.shape), list(d.stride()), [bm, bn])
    else:
        d_desc = d
    _dlogits_kernel[(progs,)](
        hidden,
        weight,
        h_desc,
        w_desc,
        d_desc,
        row_max,
        grad_sum_exp,
        ids,
        grad_ids,
        pos,
        d,
        n,
        weight.shape[0],
        h,
        v0,
        width,
        hidden.stride(0),
        weight.stride(0),
        ids.stride(0),
        pos.stride(0),
        d.stride(0),
        progs,
        GROUP_R=cfg.get("GROUP", 8),
        TMA_STORE=use_tma,
        **_tile_meta(hidden, cfg, use_tma),
    )


def _selection_shape(width: int):
    """Rows per program and warps for a K-pass selection over ``width`` keys a row: ~8 keys a
    thread (the passes' cost is keys times passes: on the H200, ~8 keys a thread ran 3-10x faster
    than 64)."""
    warps = max(1, min(8, width // 256))
    return max(1, 256 * warps // width), warps


def merge_topk(top_v, top_i, k, vocab, row_list=None, values=None, ids=None):
    """The k largest of the forward's per-split slots: fp32 ``[n, k]`` values (descending) and
    int64 ``[n, k]`` ids. ``top_v`` / ``top_i``: fp32 / int32 ``[S, n, KP]``, slots ``>= k`` unused,
    a row's ids distinct and below ``vocab``, empty slots -inf with id -1; equal values come out
    in ascending id, empty slots last (-inf, -1).

    ``row_list`` (int64 ``[1 + n]``: a device-side count c, then output rows, as from a row-list
    ``launch_stats_fwd``): only slot rows ``j < c`` are merged, into rows ``row_list[1 + j]`` of
    the given ``values`` / ``ids``, which are returned."""
    splits, n, kp = top_v.shape
    if row_list is None:
        values = torch.empty(n, k, dtype=torch.float32, device=top_v.device)
        ids = torch.empty(n, k, dtype=torch.int64, device=top_v.device)
    width = _next_pow2(splits * k)
    rows, warps = _selection_shape(width)
    _merge_topk_kernel[(triton.cdiv(n, rows),)](
        top_v,
        top_i,
        values,
        ids,
        row_list if row_list is not None else top_i,
        n,
        splits,
        vocab,
        K=k,
        KP=kp,
        W=width,
        R=rows,
        ROW_LIST=row_list is not None,
        num_warps=warps,
    )
    return values, ids


def topk_of_keys(keys, count, k, vocab, rows, values, ids, floor=None, chunk=1024):
    """Into ``values`` / ``ids`` (fp32 / int64 ``[N, k]``) at rows ``rows[j]``: the k largest of
    row ``j`` of the int64 order keys ``keys`` (``[m, width]``, from ``logit_keys``), decoded, for
    ``j`` below the device-side one-element ``count``. ``floor`` (fp32, indexed by output row, any
    stride): a value each row's k-th largest is known to reach (k of its logits are at least
    that), which spares most passes. Two launches, no host read: the k largest of each ``chunk``
    of columns, then of those."""
    m, width = keys.shape
    if m == 0:
        return
    chunk = min(chunk, _next_pow2(width))
    chunks = triton.cdiv(width, chunk)
    cand = torch.empty(m, chunks, k, dtype=torch.int64, device=keys.device)
    _chunk_topk_kernel[(m, chunks)](
        keys,
        count,
        floor if floor is not None else keys,
        rows,
        cand,
        width,
        keys.stride(0),
        floor.stride(0) if floor is not None else 0,
        K=k,
        KP=_next_pow2(k),
        C=chunk,
        HAS_FLOOR=floor is not None,
        num_warps=1,
    )
    w = chunks * k
    _merge_keys_kernel[(m,)](
        cand,
        count,
        rows,
        values,
        ids,
        vocab,
        K=k,
        W=w,
        WP=_next_pow2(w),
        num_warps=_selection_shape(_next_pow2(w))[1],
    )


def key_columns(vocab: int, cfg) -> int:
    """Columns of ``logit_keys``' output for a vocabulary of ``vocab``: whole tiles."""
    return triton.cdiv(vocab, cfg["BN"]) * cfg["BN"]


def logit_keys(hidden, weight, keys, cfg, slots, count=None, *, use_tma: bool):
    """Writes into int64 ``keys`` (``[n, key_columns(V)]``) the order keys (``_order_key``: value,
    then lowest column) of the fp32 logits ``hidden @ weight.T``, computed by the forward kernel's
    tile code with the tile ``cfg`` (so the same bits as ``_stats_fwd_kernel`` with that config);
    columns past ``V`` get keys of -inf. ``slots``: programs that fit the device at once.
    ``count``: a one-element integer tensor on the device; only its first ``count`` rows (at most
    ``n``) are written. ``use_tma``: load the operands through tensor descriptors."""
    n, h = hidden.shape
    v = weight.shape[0]
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    tiles = triton.cdiv(n, bm) * triton.cdiv(v, bn)
    progs = max(1, min(tiles, slots))
    h_desc, w_desc = _descriptors(hidden, weight, bm, bn, bk, use_tma)
    _logit_keys_kernel[(progs,)](
        hidden,
        weight,
        h_desc,
        w_desc,
        keys,
        count if count is not None else keys,
        n,
        v,
        h,
        hidden.stride(0),
        weight.stride(0),
        keys.stride(0),
        progs,
        HAS_COUNT=count is not None,
        **_tile_meta(hidden, cfg, use_tma),
    )
