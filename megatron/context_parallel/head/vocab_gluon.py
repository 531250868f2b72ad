"""Gluon kernels of the vocab-parallel head on Hopper (used by ``vocab_ops``; not a public
module): the forward's statistics without and with a top-k, and the backward's ``d_logits``.

Both are a ``hidden @ weight.T`` matmul whose fp32 logits tiles never leave registers, built so
that the epilogue does not stall the tensor cores. The Triton kernels (``vocab_triton``) run a
128x256 tile with two warpgroups that both do the mainloop and then both the epilogue, so the
tensor cores idle during every epilogue. Here each persistent program holds three
warp-specialised partitions: one warp issues the TMA loads of every tile into one ring of
shared-memory stages, and two consumer warpgroups take the program's tiles in turns, each a
128x128 tile (64x256 for the top-k) with its own accumulator in registers. A consumer starts
a tile's mainloop once the other has issued its previous tile's products, so the two mainloops
alternate on the tensor cores and each epilogue runs under the other consumer's mainloop: the
"ping-pong" schedule of CUTLASS's Hopper kernels. Tiles are walked in grouped order (row blocks
fastest within a group) so the tiles in flight share operands in L2.

* ``_stats_pingpong_kernel``: per tile, the rows' max, sum of ``exp(logit - max)`` and the
  target's logit, written per 128-column block; ``vocab_ops._combine_splits`` merges the blocks
  (fp32 ``[V / 128, 3, n]``: 0.29 GiB at 20,436 x 151,936).
* ``_topk_pingpong_kernel``: the forward with a running top-k (grouped candidates and a fixed
  number of selection passes per tile, as ``vocab_triton``'s). Its work units are a row block
  and a contiguous run of column tiles, whose tiles the two consumers take in turns, each with
  its own running statistics and top-k, written per unit and consumer for
  ``vocab_ops._combine_splits``. The running top-k waits in shared memory while a tile's
  products and statistics hold the registers. A program reloads its row block for every tile,
  so ``topk_splits`` keeps the row blocks in flight few enough to stay in L2.
* ``_dlogits_pingpong_kernel``: the same ``d_logits`` as ``vocab_triton._dlogits_kernel``
  (rounded once to the input dtype), stored through TMA from a per-consumer shared-memory tile.

The Gluon kernels' logits agree with the Triton ones to a few fp32 units in the last place
(equal bits on most shapes; they issue 64x128 wgmma products, the Triton kernels 64x256).
H200, bf16, H = 5,120, queued behind other work: the forward kernel alone 0.96-1.01
GEMMs (whole k = 0 call 0.98-1.04, the Triton one 0.97-1.07); d_logits over all slices
1.01-1.09 against the Triton kernel's 1.07-1.13; the top-20 kernel alone 1.03-1.15 against
1.11-1.19.

Written in Gluon (``triton.experimental.gluon``, Triton's explicit-layout dialect, whose warp
specialisation works on Hopper where Triton 3.6's automatic one does not), against the Triton
3.6 API. Gluon is experimental: ``builds`` compiles each kernel once per device and dtype and
reports failure instead of raising, and ``vocab_ops`` then keeps the Triton kernels.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from types import MappingProxyType

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Steps shared with the Triton kernels (a Gluon kernel may call them): the top-k's order keys,
# the running statistics, the d_logits epilogue's arithmetic.
from megatron.context_parallel.head.vocab_triton import (
    _KEY_MAX,
    _KEY_MIN,
    _decode_slots,
    _dlogits_tile,
    _fold_stats,
    _key_value,
    _order_key,
    _store_stats,
)

_LOG2E = gl.constexpr(1.4426950408889634)

# One consumer warpgroup's tile; ring stages (H200: 4 beat 5, which leaves shared memory no
# room); row blocks per launch group; registers of the consumer and load partitions, and the
# kernel's cap, which sets the register file's split: 12 warps x 168 = 4 x 248 (the default
# consumer) + 4 x 232 + 4 x 24.
CONFIG = MappingProxyType(
    dict(BM=128, BN=128, BK=64, stages=4, GROUP=16, regs=(232, 24), maxnreg=168)
)
# The forward's statistics kernel: the same tile, launch groups of 8 (H200, kernel alone: 4
# stages 0.96-1.01 GEMMs, 6 stages 0.98-1.02; groups of 16 slower at every shape).
STATS_CONFIG = MappingProxyType(dict(CONFIG, GROUP=8))


@gluon.jit
def _tile_of(t, num_r, num_c, GROUP_R: gl.constexpr):
    # Grouped order: row blocks fastest within a group of GROUP_R, so the tiles in flight on the
    # device share their hidden rows and weight rows in L2.
    per_group = GROUP_R * num_c
    first_r = (t // per_group) * GROUP_R
    size_r = gl.minimum(num_r - first_r, GROUP_R)
    r = first_r + (t % per_group) % size_r
    c = (t % per_group) // size_r
    return r, c


@gluon.jit
def _tile_counts(h_desc, w_desc, n, width):
    """K blocks per tile, row blocks over ``n`` rows and column tiles over ``width`` columns."""
    kt = gl.cdiv(h_desc.shape[1], h_desc.block_type.shape[1])
    num_r = gl.cdiv(n, h_desc.block_type.shape[0])
    return kt, num_r, gl.cdiv(width, w_desc.block_type.shape[0])


@gluon.jit
def _load_partition(
    h_desc, w_desc, a_bufs, b_bufs, ready, empty, n, width, v0, num_progs, GROUP_R: gl.constexpr
):
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    kt, num_r, num_c = _tile_counts(h_desc, w_desc, n, width)
    seq = 0
    for t in range(gl.program_id(0), num_r * num_c, num_progs):
        r, c = _tile_of(t, num_r, num_c, GROUP_R)
        seq = _load_tile(h_desc, w_desc, a_bufs, b_bufs, ready, empty, seq, r * BM, v0 + c * BN, kt)


@gluon.jit
def _load_tile(h_desc, w_desc, a_bufs, b_bufs, ready, empty, seq, row0, col0, kt):
    """Loads one tile's operands (hidden rows ``row0 ..``, weight rows ``col0 ..``, all ``kt``
    K blocks) into the ring, from stage ``seq`` on; returns the next stage's sequence number."""
    BK: gl.constexpr = h_desc.block_type.shape[1]
    NB: gl.constexpr = a_bufs.type.shape[0]
    for kk in range(kt):
        s = seq % NB
        # Barriers start with their phase-1 wait complete: the first lap finds every stage free.
        mbarrier.wait(empty.index(s), ((seq // NB) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, h_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(h_desc, [row0, kk * BK], bar, a_bufs.index(s))
        tma.async_copy_global_to_shared(w_desc, [col0, kk * BK], bar, b_bufs.index(s))
        seq += 1
    return seq


@gluon.jit
def _tile_products(
    h_desc,
    w_desc,
    a_bufs,
    b_bufs,
    ready,
    empty,
    turn,
    j,
    kt,
    layout: gl.constexpr,
    CID: gl.constexpr,
):
    """fp32 ``[BM, BN]`` logits of this consumer's local tile ``j`` (in ``layout``) from the
    ring stages ``j * kt ...``; releases each stage once its product is done."""
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    NB: gl.constexpr = a_bufs.type.shape[0]
    seq0 = j * kt
    # Take turns: start this tile's mainloop once the other consumer has issued its previous
    # tile's products. Besides ordering the tensor cores, this keeps this consumer within one lap
    # of the ring, where a barrier's phase parity is unambiguous (a consumer that waited laps
    # ahead would see an older phase of the same parity complete). Consumer 0's first wait passes
    # on the barrier's initial state.
    mbarrier.wait(turn.index(CID), ((j // 2) & 1) ^ (1 - CID))
    acc = gl.zeros([BM, BN], gl.float32, layout)
    for kk in range(kt):
        seq = seq0 + kk
        s = seq % NB
        mbarrier.wait(ready.index(s), (seq // NB) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        # One product in flight: the previous one is done with its stage.
        acc = warpgroup_mma_wait(1, deps=[acc])
        mbarrier.arrive(empty.index((seq + NB - 1) % NB), pred=kk > 0)
    mbarrier.arrive(turn.index(1 - CID))
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(empty.index((seq0 + kt - 1) % NB))
    return acc


@gluon.constexpr_function
def _acc_layout(BN):
    # One warpgroup's wgmma accumulator: 64 rows per instruction, two instructions for 128.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])


@gluon.jit
def _consumer(
    ring,
    epilogue: gl.constexpr,
    epilogue_args,
    n,
    width,
    num_progs,
    GROUP_R: gl.constexpr,
    FLAG: gl.constexpr,
    CID: gl.constexpr,
):
    """Consumer warpgroup ``CID`` (0 or 1): takes the program's local tiles CID, CID + 2, ...,
    computes each one's logits and hands them to ``epilogue(acc, r, c, rows, cols, epilogue_args,
    FLAG)`` (``r`` / ``c``: the tile's row and column block, ``rows`` / ``cols`` its row and
    column indices, columns counted from the slice's start)."""
    h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn = ring
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    layout: gl.constexpr = _acc_layout(BN)
    kt, num_r, num_c = _tile_counts(h_desc, w_desc, n, width)
    j = CID
    for t in range(gl.program_id(0) + CID * num_progs, num_r * num_c, 2 * num_progs):
        r, c = _tile_of(t, num_r, num_c, GROUP_R)
        acc = _tile_products(h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, j, kt, layout, CID)
        rows = r * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        cols = c * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        epilogue(acc, r, c, rows, cols, epilogue_args, FLAG)
        j += 2
    # The d_logits epilogue's last TMA store (nothing pending for the forward's).
    tma.store_wait(0)


@gluon.jit
def _dlogits_consumer(ring, args, n, width, num_progs, GROUP_R: gl.constexpr, CID: gl.constexpr):
    _consumer(ring, _dlogits_epilogue, args, n, width, num_progs, GROUP_R, False, CID)


@gluon.jit
def _stats_consumer(
    ring,
    args,
    n,
    vocab,
    num_progs,
    GROUP_R: gl.constexpr,
    HAS_TARGET: gl.constexpr,
    CID: gl.constexpr,
):
    _consumer(ring, _stats_epilogue, args, n, vocab, num_progs, GROUP_R, HAS_TARGET, CID)


@gluon.jit
def _dlogits_epilogue(acc, r, c, rows, cols, args, FLAG: gl.constexpr):
    d_desc, c_smem, max_ptr, gs_ptr, ids_ptr, gid_ptr, pos_ptr, n, v0, stride_ids, stride_pos = args
    rows_ld = gl.where(rows < n, rows, 0).to(gl.int64)
    grads = (max_ptr, gs_ptr, ids_ptr, gid_ptr, pos_ptr, stride_ids, stride_pos)
    d = _dlogits_tile(acc, v0 + cols, rows_ld, c, grads)
    # This consumer's previous store must have read c_smem before it is overwritten.
    tma.store_wait(0)
    c_smem.store(d.to(d_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(d_desc, [r * acc.shape[0], c * acc.shape[1]], c_smem)


@gluon.jit
def _stats_epilogue(acc, r, c, rows, cols, args, HAS_TARGET: gl.constexpr):
    part_ptr, tgt_ptr, n, vocab = args
    rmask = rows < n
    rows_ld = gl.where(rmask, rows, 0).to(gl.int64)
    # Weight rows past the shard came in as zeros: not logits.
    acc = gl.where((cols < vocab)[None, :], acc, float("-inf"))
    tile_max = gl.max(acc, axis=1)
    tile_sum = gl.sum(gl.exp2((acc - tile_max[:, None]) * _LOG2E), axis=1)
    if HAS_TARGET:
        tgt = gl.load(tgt_ptr + rows_ld)
        # A target outside the shard must not meet the masked columns past its end.
        tgt = gl.where((tgt >= 0) & (tgt < vocab), tgt, -1)
        pick = gl.sum(gl.where(cols[None, :] == tgt[:, None], acc, 0.0), axis=1)
    else:
        pick = gl.zeros_like(tile_max)
    out = part_ptr + c.to(gl.int64) * 3 * n + rows_ld
    gl.store(out, tile_max, mask=rmask)
    gl.store(out + n, tile_sum, mask=rmask)
    gl.store(out + 2 * n, pick, mask=rmask)


@gluon.jit
def _ring(h_desc, w_desc, NUM_BUF: gl.constexpr):
    """The operand ring (``NUM_BUF`` stages of a hidden and a weight tile), its ready / empty
    barriers and the two consumers' turn barriers."""
    dtype: gl.constexpr = h_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF] + h_desc.block_type.shape, h_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUF] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    return a_bufs, b_bufs, ready, empty, turn


@gluon.jit(do_not_specialize=["n", "width", "v0", "stride_ids", "stride_pos", "num_progs"])
def _dlogits_pingpong_kernel(
    h_desc,
    w_desc,
    d_desc,
    max_ptr,
    gs_ptr,
    ids_ptr,
    gid_ptr,
    pos_ptr,
    n,
    width,
    v0,
    stride_ids,
    stride_pos,
    num_progs,
    GROUP_R: gl.constexpr,
    NUM_BUF: gl.constexpr,
    REGS_MMA: gl.constexpr,
    REGS_LOAD: gl.constexpr,
):
    a_bufs, b_bufs, ready, empty, turn = _ring(h_desc, w_desc, NUM_BUF)
    c0 = gl.allocate_shared_memory(d_desc.dtype, d_desc.block_type.shape, d_desc.layout)
    c1 = gl.allocate_shared_memory(d_desc.dtype, d_desc.block_type.shape, d_desc.layout)
    ring = (h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn)
    args0 = (d_desc, c0, max_ptr, gs_ptr, ids_ptr, gid_ptr, pos_ptr, n, v0, stride_ids, stride_pos)
    args1 = (d_desc, c1, max_ptr, gs_ptr, ids_ptr, gid_ptr, pos_ptr, n, v0, stride_ids, stride_pos)
    gl.warp_specialize(
        [
            (_dlogits_consumer, (ring, args0, n, width, num_progs, GROUP_R, 0)),
            (_dlogits_consumer, (ring, args1, n, width, num_progs, GROUP_R, 1)),
            (
                _load_partition,
                (h_desc, w_desc, a_bufs, b_bufs, ready, empty, n, width, v0, num_progs, GROUP_R),
            ),
        ],
        [4, 1],
        [REGS_MMA, REGS_LOAD],
    )


@gluon.jit(do_not_specialize=["n", "vocab", "num_progs"])
def _stats_pingpong_kernel(
    h_desc,
    w_desc,
    part_ptr,
    tgt_ptr,
    n,
    vocab,
    num_progs,
    HAS_TARGET: gl.constexpr,
    GROUP_R: gl.constexpr,
    NUM_BUF: gl.constexpr,
    REGS_MMA: gl.constexpr,
    REGS_LOAD: gl.constexpr,
):
    a_bufs, b_bufs, ready, empty, turn = _ring(h_desc, w_desc, NUM_BUF)
    ring = (h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn)
    args = (part_ptr, tgt_ptr, n, vocab)
    gl.warp_specialize(
        [
            (_stats_consumer, (ring, args, n, vocab, num_progs, GROUP_R, HAS_TARGET, 0)),
            (_stats_consumer, (ring, args, n, vocab, num_progs, GROUP_R, HAS_TARGET, 1)),
            (
                _load_partition,
                (h_desc, w_desc, a_bufs, b_bufs, ready, empty, n, vocab, 0, num_progs, GROUP_R),
            ),
        ],
        [4, 1],
        [REGS_MMA, REGS_LOAD],
    )


# --- The forward with a running top-k -------------------------------------------------------
# Work comes in units: one row block and a contiguous range of column tiles (a "split"), as in
# the Triton forward. A program walks its units one after another; its two consumers take the
# units' tiles in turns (the program's tile sequence, not each unit's, sets whose turn it is),
# and each keeps its own running statistics and top-k over the tiles it took of the unit. At a
# unit's end each consumer writes one partial result: slot ``2 * split + CID``. A consumer that
# took no tile of a unit (a one-tile unit on the other's turn) writes its empty state, which
# merges as nothing.


@gluon.constexpr_function
def _slots_layout(KP):
    # The running top-k's [BM, KP] keys: the accumulator's rows per thread, a row's slots spread
    # over the four threads that share it, as a wgmma accumulator of KP columns would be.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KP, 16])


# The running top-k's keys in shared memory: rows of KP int64, 16-byte vectors swizzled across
# rows so the four threads of a row and the eight rows of a warp spread over the banks.
_SLOTS_SMEM = gl.constexpr(gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0]))


@gluon.jit
def _like_rows(x, ref):
    """``x`` (``[BM]``) in the row layout of the 2-D tensor ``ref``: the same threads hold the
    same rows in every layout used here, so this moves no data."""
    return gl.convert_layout(x, gl.SliceLayout(1, ref.type.layout))


@gluon.jit
def _group_top2_gl(acc, col0, G: gl.constexpr):
    """Each column group's two largest logits of one ``[BM, BN]`` tile (first column ``col0``),
    as ``vocab_triton._group_top2``: columns ``j * G + b`` form group ``b``, all held by one
    thread in the wgmma accumulator layout, so the reductions stay in registers. Returns int64
    ``[BM, 2 G]`` order keys of the candidates (the minimum key where a candidate is not a logit)
    and fp32 ``[BM]`` the largest logit not among them."""
    BM: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    J: gl.constexpr = BN // G
    x = gl.reshape(acc, [BM, J, G])
    x3: gl.constexpr = x.type.layout
    jj = gl.arange(0, J, layout=gl.SliceLayout(0, gl.SliceLayout(2, x3)))
    jj = gl.expand_dims(gl.expand_dims(jj, 0), 2)
    gb = col0 + gl.arange(0, G, layout=gl.SliceLayout(0, gl.SliceLayout(1, x3)))
    gb = gl.expand_dims(gb, 0)
    v1 = gl.max(x, axis=1)
    j1 = gl.min(gl.where(x == gl.expand_dims(v1, 1), jj, J), axis=1)
    x = gl.where(jj == gl.expand_dims(j1, 1), float("-inf"), x)
    v2 = gl.max(x, axis=1)
    j2 = gl.min(gl.where(x == gl.expand_dims(v2, 1), jj, J), axis=1)
    x = gl.where(jj == gl.expand_dims(j2, 1), float("-inf"), x)
    beyond = gl.max(gl.max(x, axis=1), axis=1)
    cand_v = gl.reshape(gl.join(v1, v2), [BM, 2 * G])
    cand_c = gl.reshape(gl.join(j1 * G + gb, j2 * G + gb), [BM, 2 * G])
    # Masked columns (past the shard) hold -inf: not candidates.
    cand_k = gl.where(cand_v > float("-inf"), _order_key(cand_v, cand_c), _KEY_MIN)
    return cand_k, beyond


@gluon.jit
def _offer_gl(cand_k, top_k, thr_k, drop, PASSES: gl.constexpr):
    """``PASSES`` selection passes: each offers the row's next candidate key (descending) to the
    running top-k ``top_k`` (int64 ``[BM, KP]`` keys, row minimum ``thr_k``), replacing the
    row's smallest slot when larger. Keys are distinct, so a pass is two reductions. Returns the
    new ``top_k``, ``thr_k`` and ``drop``: the largest logit above the row minimum that the
    passes did not reach (for the exactness check)."""
    last_k = gl.full([cand_k.shape[0]], _KEY_MAX, gl.int64, gl.SliceLayout(1, cand_k.type.layout))
    for _ in gl.static_range(PASSES):
        best = gl.max(gl.where(cand_k < gl.expand_dims(last_k, 1), cand_k, _KEY_MIN), axis=1)
        best_t = _like_rows(best, top_k)
        put = (top_k == gl.expand_dims(thr_k, 1)) & gl.expand_dims(best_t > thr_k, 1)
        top_k = gl.where(put, gl.expand_dims(best_t, 1), top_k)
        thr_k = gl.min(top_k, axis=1)
        last_k = best
    rest = gl.max(gl.where(cand_k < gl.expand_dims(last_k, 1), cand_k, _KEY_MIN), axis=1)
    rest = _like_rows(rest, top_k)
    missed = gl.where(rest > thr_k, _key_value(rest), float("-inf"))
    drop = gl.maximum(drop, gl.convert_layout(missed, drop.type.layout))
    return top_k, thr_k, drop


@gluon.jit
def _empty_keys_gl(kcols, BM: gl.constexpr, K: gl.constexpr):
    """The running top-k before any tile, as ``vocab_triton._empty_keys`` in the layout of the
    slot columns ``kcols``: empty slots below K hold distinct keys under every real one; slots
    past K hold keys over every real one, so they are never the row minimum."""
    KP: gl.constexpr = kcols.shape[0]
    slots: gl.constexpr = kcols.type.layout.parent
    slot = gl.zeros([BM, KP], gl.int64, slots) + gl.expand_dims(kcols, 0).to(gl.int64)
    neg_inf = gl.full([BM, KP], float("-inf"), gl.float32, slots)
    empty_k = _order_key(neg_inf, gl.zeros([BM, KP], gl.int32, slots)) - 0xFFFFFFFF + slot
    return gl.where(gl.expand_dims(kcols, 0) < K, empty_k, _KEY_MAX - slot)


@gluon.jit
def _unit_tiles(u, num_r, num_c, per, GROUP_R: gl.constexpr):
    """Unit ``u``'s row block and its column tiles ``lo .. hi``."""
    num_s = gl.cdiv(num_c, per)
    r, split = _tile_of(u, num_r, num_s, GROUP_R)
    lo = split * per
    return r, split, lo, gl.minimum(lo + per, num_c)


@gluon.jit
def _units_load_partition(
    h_desc, w_desc, a_bufs, b_bufs, ready, empty, n, vocab, per, num_progs, GROUP_R: gl.constexpr
):
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    kt, num_r, num_c = _tile_counts(h_desc, w_desc, n, vocab)
    units = num_r * gl.cdiv(num_c, per)
    seq = 0
    for u in range(gl.program_id(0), units, num_progs):
        r, split, lo, hi = _unit_tiles(u, num_r, num_c, per, GROUP_R)
        for c in range(lo, hi):
            seq = _load_tile(h_desc, w_desc, a_bufs, b_bufs, ready, empty, seq, r * BM, c * BN, kt)


@gluon.jit
def _topk_consumer(
    ring,
    args,
    n,
    vocab,
    per,
    num_progs,
    GROUP_R: gl.constexpr,
    HAS_TARGET: gl.constexpr,
    K: gl.constexpr,
    KP: gl.constexpr,
    G: gl.constexpr,
    PASSES: gl.constexpr,
    CID: gl.constexpr,
):
    """Consumer ``CID`` of the top-k forward: per unit, the running max, sum of exp, target logit
    and top-k (grouped candidates, ``PASSES`` passes a tile, as ``vocab_triton``'s
    ``_offer_grouped``) over the unit's tiles it takes, then its partial result (slot
    ``2 * split + CID``): ``part`` fp32 ``[2 S, 4, n]`` (max, sum_exp, target logit, largest logit
    left out of the selection), ``topv`` / ``topi`` fp32 / int32 ``[2 S, n, KP]``."""
    h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn = ring
    part_ptr, topv_ptr, topi_ptr, tgt_ptr, keep = args
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    layout: gl.constexpr = _acc_layout(BN)
    slots: gl.constexpr = _slots_layout(KP)
    row_l: gl.constexpr = gl.SliceLayout(1, layout)
    kt, num_r, num_c = _tile_counts(h_desc, w_desc, n, vocab)
    units = num_r * gl.cdiv(num_c, per)
    kcols = gl.arange(0, KP, layout=gl.SliceLayout(0, slots))
    j0 = 0
    for u in range(gl.program_id(0), units, num_progs):
        r, split, lo, hi = _unit_tiles(u, num_r, num_c, per, GROUP_R)
        rows = r * BM + gl.arange(0, BM, layout=row_l)
        rmask = rows < n
        rows_ld = gl.where(rmask, rows, 0).to(gl.int64)
        m_i = gl.full([BM], float("-inf"), gl.float32, row_l)
        s_i = gl.zeros([BM], gl.float32, row_l)
        t_i = gl.zeros([BM], gl.float32, row_l)
        bound = gl.full([BM], float("-inf"), gl.float32, row_l)
        drop = gl.full([BM], float("-inf"), gl.float32, row_l)
        # Empty slots below K hold distinct keys under every real one; slots past K hold keys
        # over every real one, so they are never the row minimum. The running top-k waits in
        # shared memory (``keep``) while the next tile's products and statistics hold the
        # registers; only its row minimum stays in them.
        first_k = _empty_keys_gl(kcols, BM, K)
        thr_k = gl.min(first_k, axis=1)
        keep.store(first_k)
        if HAS_TARGET:
            tgt = gl.load(tgt_ptr + rows_ld)
            tgt = gl.where((tgt >= 0) & (tgt < vocab), tgt, -1).to(gl.int32)
        # This consumer's tiles of the unit: those whose place in the program's sequence has its
        # parity.
        for c in range(lo + (j0 + CID) % 2, hi, 2):
            j = j0 + c - lo
            acc = _tile_products(
                h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn, j, kt, layout, CID
            )
            cols = c * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
            acc = gl.where(gl.expand_dims(cols < vocab, 0), acc, float("-inf"))
            m_i, s_i, tile_max = _fold_stats(acc, m_i, s_i)
            if HAS_TARGET:
                hit = gl.expand_dims(cols, 0) == gl.expand_dims(tgt, 1)
                t_i += gl.sum(gl.where(hit, acc, 0.0), axis=1)
            cand_k, beyond = _group_top2_gl(acc, c * BN, G)
            bound = gl.maximum(bound, gl.convert_layout(beyond, row_l))
            # Each thread reads back the slots it stored (one layout): no barrier needed.
            cur_k = keep.load(slots)
            cur_k, thr_k, drop = _offer_gl(cand_k, cur_k, thr_k, drop, PASSES)
            keep.store(cur_k)
        out = part_ptr + (2 * split + CID).to(gl.int64) * 4 * n + rows_ld
        _store_stats(out, n, rmask, m_i, s_i, t_i)
        gl.store(out + 3 * n, gl.maximum(bound, drop), mask=rmask)
        top_v, top_i = _decode_slots(keep.load(slots), vocab)
        top_v = gl.where(gl.expand_dims(kcols, 0) < K, top_v, float("-inf"))
        rows_s = gl.convert_layout(rows_ld, gl.SliceLayout(1, slots))
        at = gl.expand_dims(((2 * split + CID) * n + rows_s) * KP, 1) + gl.expand_dims(kcols, 0)
        smask = gl.expand_dims(gl.convert_layout(rmask, gl.SliceLayout(1, slots)), 1)
        smask = smask & (gl.expand_dims(kcols, 0) < KP)
        gl.store(topv_ptr + at, top_v, mask=smask)
        gl.store(topi_ptr + at, top_i, mask=smask)
        j0 += hi - lo


@gluon.jit(do_not_specialize=["n", "vocab", "per", "num_progs"])
def _topk_pingpong_kernel(
    h_desc,
    w_desc,
    part_ptr,
    topv_ptr,
    topi_ptr,
    tgt_ptr,
    n,
    vocab,
    per,
    num_progs,
    HAS_TARGET: gl.constexpr,
    K: gl.constexpr,
    KP: gl.constexpr,
    G: gl.constexpr,
    PASSES: gl.constexpr,
    GROUP_R: gl.constexpr,
    NUM_BUF: gl.constexpr,
    REGS_MMA: gl.constexpr,
    REGS_LOAD: gl.constexpr,
):
    a_bufs, b_bufs, ready, empty, turn = _ring(h_desc, w_desc, NUM_BUF)
    ring = (h_desc, w_desc, a_bufs, b_bufs, ready, empty, turn)
    # Each consumer's running top-k between tiles.
    BM: gl.constexpr = h_desc.block_type.shape[0]
    keep0 = gl.allocate_shared_memory(gl.int64, [BM, KP], _SLOTS_SMEM)
    keep1 = gl.allocate_shared_memory(gl.int64, [BM, KP], _SLOTS_SMEM)
    args0 = (part_ptr, topv_ptr, topi_ptr, tgt_ptr, keep0)
    args1 = (part_ptr, topv_ptr, topi_ptr, tgt_ptr, keep1)
    # Written out: a tuple built with + here would lose its constexpr entries.
    gl.warp_specialize(
        [
            (
                _topk_consumer,
                (ring, args0, n, vocab, per, num_progs, GROUP_R, HAS_TARGET, K, KP, G, PASSES, 0),
            ),
            (
                _topk_consumer,
                (ring, args1, n, vocab, per, num_progs, GROUP_R, HAS_TARGET, K, KP, G, PASSES, 1),
            ),
            (
                _units_load_partition,
                (h_desc, w_desc, a_bufs, b_bufs, ready, empty, n, vocab, per, num_progs, GROUP_R),
            ),
        ],
        [4, 1],
        [REGS_MMA, REGS_LOAD],
    )


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def _descriptor(t, block):
    return TensorDescriptor.from_tensor(t, block, _smem_layout(tuple(block), t.dtype))


# Memoised: working the layout out costs ~10 us of Python per descriptor, before every launch
# (the backward makes three per vocabulary slice).
@functools.lru_cache(maxsize=64)
def _smem_layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _gl_dtype(dtype))


def _operands(hidden, weight, cfg):
    """Descriptors of the ``[BM, BK]`` hidden tiles and the ``[BN, BK]`` weight tiles."""
    return (
        _descriptor(hidden, [cfg["BM"], cfg["BK"]]),
        _descriptor(weight, [cfg["BN"], cfg["BK"]]),
    )


def _meta(cfg):
    """The kernels' compile-time arguments for ``cfg``."""
    return dict(
        GROUP_R=cfg["GROUP"],
        NUM_BUF=cfg["stages"],
        REGS_MMA=cfg["regs"][0],
        REGS_LOAD=cfg["regs"][1],
        num_warps=4,
        maxnreg=cfg["maxnreg"],
    )


def _dlogits_args(hidden, weight, row_max, grad_sum_exp, ids, grad_ids, pos, d, v0, progs, cfg):
    h_desc, w_desc = _operands(hidden, weight, cfg)
    d_desc = _descriptor(d, [cfg["BM"], cfg["BN"]])
    n, width = d.shape
    return (
        h_desc,
        w_desc,
        d_desc,
        row_max,
        grad_sum_exp,
        ids,
        grad_ids,
        pos,
        n,
        width,
        v0,
        ids.stride(0),
        pos.stride(0),
        progs,
    )


def _stats_args(hidden, weight, target, part, progs, cfg):
    h_desc, w_desc = _operands(hidden, weight, cfg)
    # Without a target the pointer slot takes any tensor; the kernel does not read it.
    tgt = target if target is not None else part
    return (h_desc, w_desc, part, tgt, hidden.shape[0], weight.shape[0], progs)


def launch_dlogits_pingpong(
    hidden, weight, row_max, grad_sum_exp, ids, grad_ids, pos, d, v0, slots, cfg=None
):
    """Writes ``d`` (``[n, width]``, a 16-byte-aligned view) for vocabulary columns ``v0 .. v0 +
    width``, as ``vocab_triton.launch_dlogits``, with ``min(tiles, slots)`` programs (``pos``:
    per row, where each ``cfg["BN"]``-column tile's ids start in the sorted ``ids``). Operands and
    ``d`` must suit the copy engine (``vocab_ops.tma_ok``)."""
    cfg = cfg or CONFIG
    tiles = triton.cdiv(d.shape[0], cfg["BM"]) * triton.cdiv(d.shape[1], cfg["BN"])
    progs = min(tiles, slots)
    args = (hidden, weight, row_max, grad_sum_exp, ids, grad_ids, pos, d, v0, progs, cfg)
    _dlogits_pingpong_kernel[(progs,)](*_dlogits_args(*args), **_meta(cfg))


def stats_tiles(vocab: int, cfg=None) -> int:
    """Column tiles of the forward kernel over ``vocab`` columns: the partial results per row."""
    return triton.cdiv(vocab, (cfg or STATS_CONFIG)["BN"])


def launch_stats_pingpong(hidden, weight, target, part, slots, cfg=None):
    """Per ``[BM, BN]`` logits tile of ``hidden @ weight.T`` (fp32), writes into the fp32
    ``part`` ``[stats_tiles(V), 3, n]``, at the tile's column block and rows: the tile's row max,
    the sum of ``exp(logit - that max)`` over its columns, and the logit at ``target`` (int64
    ``[n]`` shard-local ids; 0.0 where the target is in another tile, out of range, or ``target``
    is None). ``vocab_ops._combine_splits`` merges the column blocks. Operands must suit the copy
    engine (``vocab_ops.tma_ok``)."""
    cfg = cfg or STATS_CONFIG
    tiles = triton.cdiv(hidden.shape[0], cfg["BM"]) * stats_tiles(weight.shape[0], cfg)
    progs = min(tiles, slots)
    meta = _meta(cfg)
    _stats_pingpong_kernel[(progs,)](
        *_stats_args(hidden, weight, target, part, progs, cfg),
        HAS_TARGET=target is not None,
        **meta,
    )


# The top-k forward: one consumer warpgroup's tile is 64 x 256 (as a warpgroup's share of the
# Triton kernel's tile), its running top-k waiting in shared memory between tiles. H200, k = 20,
# kernel alone, 8 splits: 1.08-1.15 GEMMs against 1.12-1.19 with the statistics kernel's 128 x
# 128 tile. G: column
# groups per tile (8: one thread holds a group in the wgmma accumulator layout); passes:
# selection passes per tile (vocab_ops passes its "fwd_topk" entry); GROUP: row blocks per
# launch group of the units.
TOPK_CONFIG = MappingProxyType(dict(CONFIG, BM=64, BN=256, GROUP=16, G=8, passes=3))

_TILE_CONFIGS = {"dlogits": "CONFIG", "stats": "STATS_CONFIG", "topk": "TOPK_CONFIG"}


@contextlib.contextmanager
def tile_config_scope(kernel: str, **changes):
    """The tile configuration of ``kernel`` (``"dlogits"``, ``"stats"`` or ``"topk"``) with
    ``changes`` for the block, restored on exit. The configurations are read-only otherwise;
    the interpreter tests shrink the tiles this way."""
    name = _TILE_CONFIGS[kernel]
    old = globals()[name]
    unknown = set(changes) - set(old)
    if unknown:
        raise ValueError(f"unknown {kernel} tile settings {sorted(unknown)}")
    globals()[name] = MappingProxyType(dict(old, **changes))
    try:
        yield globals()[name]
    finally:
        globals()[name] = old


# Hidden-row bytes the top-k forward's programs may hold at once. Each program walks one row
# block across a run of column tiles and reads that block again for every tile, so the blocks in
# flight (programs / splits) must stay in L2 (H200: 50 MB, also holding the weight tiles the
# splits stream and the rings' prefetch). Measured at H = 5,120 (kernel alone, GEMMs): 8 splits,
# 10.8 MB of rows in flight, 1.08-1.15; 1-2 splits, 43-84 MB, 1.07-1.30.
_L2_ROWS_BYTES = 11 * 2**20
# Shared memory of one H200 block.
_SMEM_BYTES = 227 * 1024


def topk_splits(n: int, vocab: int, slots: int, row_bytes: int, cfg=None) -> int:
    """Column splits per row block for the top-k forward over ``n`` hidden rows of ``row_bytes``
    bytes each. Units of one row block and ``per`` tiles go to ``min(units, slots)`` persistent
    programs; the busiest walks ``ceil(units / slots) * per`` tiles. At least enough splits that
    the row blocks in flight (``slots / splits``) fit ``_L2_ROWS_BYTES``; then, as every split
    adds ``2 KP`` keys per row to the merge, the fewest (at most 16) whose busiest program walks
    at most 5% more tiles than an even share, else the fewest with the least."""
    cfg = cfg or TOPK_CONFIG
    return _topk_splits(n, vocab, slots, cfg["BM"], cfg["BN"], row_bytes)


# Memoised: the search is Python a waiting GPU would see before the launch.
@functools.lru_cache(maxsize=4096)
def _topk_splits(n: int, vocab: int, slots: int, bm: int, bn: int, row_bytes: int) -> int:
    num_r = triton.cdiv(n, bm)
    num_c = triton.cdiv(vocab, bn)
    held = max(1, _L2_ROWS_BYTES // (bm * row_bytes))
    least = 1 if num_r <= held else min(num_c, 16, triton.cdiv(slots, held))
    even = num_r * num_c / min(slots, num_r * num_c)
    best, best_cost = least, None
    for want in range(least, min(num_c, 16) + 1):
        per = triton.cdiv(num_c, want)
        splits = triton.cdiv(num_c, per)
        cost = triton.cdiv(num_r * splits, slots) * per
        if cost <= 1.05 * even:
            return splits
        if best_cost is None or cost < best_cost:
            best, best_cost = splits, cost
    return best


def topk_buffers(n: int, vocab: int, k: int, splits: int, device):
    """The top-k forward's partial results for ``splits`` splits: fp32 ``[2 S, 4, n]`` and fp32 /
    int32 ``[2 S, n, KP]`` slots (two per split: one per consumer)."""
    kp = topk_slots(k)
    return (
        torch.empty(2 * splits, 4, n, dtype=torch.float32, device=device),
        torch.empty(2 * splits, n, kp, dtype=torch.float32, device=device),
        torch.empty(2 * splits, n, kp, dtype=torch.int32, device=device),
    )


def _topk_args(hidden, weight, target, part, topv, topi, per, progs, cfg):
    h_desc, w_desc = _operands(hidden, weight, cfg)
    tgt = target if target is not None else part
    n, vocab = hidden.shape[0], weight.shape[0]
    return (h_desc, w_desc, part, topv, topi, tgt, n, vocab, per, progs)


def _topk_stages(cfg, kp: int) -> int:
    """Ring stages (at most the configured ones) that fit beside the two consumers' ``[BM, KP]``
    int64 slots (at 64 x 256: 4 up to KP = 64)."""
    stage = (cfg["BM"] + cfg["BN"]) * cfg["BK"] * 2
    room = _SMEM_BYTES - 2 * cfg["BM"] * kp * 8 - 1024
    return max(2, min(cfg["stages"], room // stage))


def _topk_meta(target, k, kp, cfg):
    meta = _meta(cfg)
    meta["NUM_BUF"] = _topk_stages(cfg, kp)
    return dict(meta, HAS_TARGET=target is not None, K=k, KP=kp, G=cfg["G"], PASSES=cfg["passes"])


def launch_topk_pingpong(
    hidden, weight, target, k, part, topv, topi, splits, slots, passes=None, cfg=None
):
    """The forward with a running top-k ``k``: into the buffers of ``topk_buffers(n, V, k,
    splits)``, per split and consumer, the statistics of ``launch_stats_pingpong`` over the
    tiles it took, the largest logit left out of its selection, and its top-k slots (values
    descending not guaranteed; empty slots -inf with id -1), for ``vocab_ops._combine_splits``.
    Operands must suit the copy engine (``vocab_ops.tma_ok``)."""
    cfg = dict(cfg or TOPK_CONFIG)
    if passes:
        cfg["passes"] = passes
    n, vocab = hidden.shape[0], weight.shape[0]
    num_c = triton.cdiv(vocab, cfg["BN"])
    per = triton.cdiv(num_c, splits)
    units = triton.cdiv(n, cfg["BM"]) * triton.cdiv(num_c, per)
    progs = min(units, slots)
    args = _topk_args(hidden, weight, target, part, topv, topi, per, progs, cfg)
    _topk_pingpong_kernel[(progs,)](*args, **_topk_meta(target, k, topv.shape[2], cfg))


_BUILDS = {}


def topk_slots(k: int) -> int:
    """Running top-k slots per row of the top-k kernel for ``k``: a power of two, at least 8
    (the slots' wgmma-accumulator layout needs 8 columns)."""
    return max(8, 1 << (k - 1).bit_length())


def builds(device: torch.device, dtype: torch.dtype, kernel: str, k: int = 0) -> bool:
    """Whether ``kernel`` ("dlogits", "stats" or "topk", the latter for top-k ``k``) can run on
    ``device`` for ``dtype`` inputs: a Hopper GPU (the kernels issue wgmma, which only sm_90
    has), bf16 or fp16, and this Triton's Gluon compiles it.

    Checked once per device, dtype, kernel (and for "topk", slot count: registers and shared
    memory grow with it) by compiling (not launching: safe under CUDA-graph capture) on
    placeholder tensors; a failure warns once and returns False."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    slots = topk_slots(k) if kernel == "topk" else 0
    key = (index, dtype, kernel, slots)
    if key not in _BUILDS:
        _BUILDS[key] = _try_build(index, dtype, kernel, slots)
    return _BUILDS[key]


def _try_build(index: int, dtype: torch.dtype, kernel: str, slots: int = 0) -> bool:
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    try:
        for with_target in (True, False) if kernel == "stats" else (True,):
            # k = the slot count: the largest k that runs with these slots.
            compile_only(kernel, dtype, torch.device("cuda", index), slots, with_target)
    except Exception as exc:  # noqa: BLE001 - any failure of an experimental compiler
        warnings.warn(
            f"megatron_cp: the Gluon {kernel} kernel does not build with Triton "
            f"{triton.__version__} ({type(exc).__name__}: {exc}); using the Triton kernel",
            stacklevel=3,
        )
        return False
    return True


def compile_only(kernel: str, dtype, device, k: int = 8, with_target=True, cfg=None):
    """Compiles ``kernel`` ("dlogits", "stats" or "topk" for top-k ``k``) for ``dtype`` operands
    with the arguments its launcher builds, on one-tile placeholder tensors on ``device``,
    without launching it; returns Triton's compiled kernel. ``cfg``: the kernel's configuration
    (default: the configured one). Sizes only bound loops and masks (the kernels do not
    specialise on them), so this is the kernel every launch of that variant runs."""
    cfg = cfg or {"dlogits": CONFIG, "stats": STATS_CONFIG, "topk": TOPK_CONFIG}[kernel]
    rows, cols = cfg["BM"], cfg["BN"]
    hidden = torch.empty(rows, cfg["BK"], dtype=dtype, device=device)
    weight = torch.empty(cols, cfg["BK"], dtype=dtype, device=device)
    target = torch.empty(rows, dtype=torch.int64, device=device) if with_target else None
    if kernel == "dlogits":
        vec = torch.empty(rows, dtype=torch.float32, device=device)
        d = torch.empty(rows, cols, dtype=dtype, device=device)
        ids = torch.empty(rows, 1, dtype=torch.int32, device=device)
        pos = torch.empty(rows, 2, dtype=torch.int32, device=device)
        args = _dlogits_args(hidden, weight, vec, vec, ids, vec, pos, d, 0, 1, cfg)
        return _dlogits_pingpong_kernel.warmup(*args, grid=(1,), **_meta(cfg))
    if kernel == "topk":
        part, topv, topi = topk_buffers(rows, cols, k, 1, device)
        args = _topk_args(hidden, weight, target, part, topv, topi, 1, 1, cfg)
        meta = _topk_meta(target, k, topv.shape[2], cfg)
        return _topk_pingpong_kernel.warmup(*args, grid=(1,), **meta)
    part = torch.empty(1, 3, rows, dtype=torch.float32, device=device)
    args = _stats_args(hidden, weight, target, part, 1, cfg)
    return _stats_pingpong_kernel.warmup(
        *args, grid=(1,), HAS_TARGET=target is not None, **_meta(cfg)
    )
