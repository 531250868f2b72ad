"""Gluon kernels of the vocab-parallel head on Hopper (used by ``vocab_ops``; not a public
module): the forward's statistics without a top-k, and the backward's ``d_logits``.

Both are a ``hidden @ weight.T`` matmul whose fp32 logits tiles never leave registers, built so
that the epilogue does not stall the tensor cores. The Triton kernels (``_vocab_triton``) run a
128x256 tile with two warpgroups that both do the mainloop and then both the epilogue, so the
tensor cores idle during every epilogue. Here each persistent program holds three
warp-specialised partitions: one warp issues the TMA loads of every tile into one ring of
shared-memory stages, and two consumer warpgroups take the program's tiles in turns, each a
128x128 tile with its own accumulator in registers. A consumer starts a tile's mainloop once the
other has issued its previous tile's products, so the two mainloops alternate on the tensor cores
and each epilogue runs under the other consumer's mainloop: the "ping-pong" schedule of
CUTLASS's Hopper kernels. Tiles are walked in grouped order (row blocks fastest within a group)
so the tiles in flight share operands in L2.

* ``_stats_pingpong_kernel``: per tile, the rows' max, sum of ``exp(logit - max)`` and the
  target's logit, written per 128-column block; ``vocab_ops._combine_splits`` merges the blocks
  (fp32 ``[V / 128, 3, n]``: 0.29 GiB at 20,436 x 151,936).
* ``_dlogits_pingpong_kernel``: the same ``d_logits`` as ``_vocab_triton._dlogits_kernel``
  (rounded once to the input dtype), stored through TMA from a per-consumer shared-memory tile.

Both kernels' logits agree with the Triton ones to a few fp32 units in the last place (equal
bits on most shapes; the two issue different wgmma shapes). H200, bf16, H = 5,120 (RESULTS.md
"Session 11", queued): the forward kernel alone 0.96-1.01 GEMMs (whole k = 0 call 0.98-1.04,
the Triton one 0.97-1.07); d_logits over all slices 1.01-1.09 against the Triton kernel's
1.07-1.13.

Written in Gluon (``triton.experimental.gluon``, Triton's explicit-layout dialect, whose warp
specialisation works on Hopper where Triton 3.6's automatic one does not), against the Triton
3.6 API. Gluon is experimental: ``builds`` compiles each kernel once per device and dtype and
reports failure instead of raising, and ``vocab_ops`` then keeps the Triton kernels.
"""

from __future__ import annotations

import warnings

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

_LOG2E = gl.constexpr(1.4426950408889634)

# One consumer warpgroup's tile; ring stages (H200: 4 beat 5, which leaves shared memory no
# room); row blocks per launch group; registers of the consumer and load partitions, and the
# kernel's cap, which sets the register file's split: 12 warps x 168 = 4 x 248 (the default
# consumer) + 4 x 232 + 4 x 24.
CONFIG = dict(BM=128, BN=128, BK=64, stages=4, GROUP=16, regs=(232, 24), maxnreg=168)
# The forward's statistics kernel: the same tile, launch groups of 8 (H200, kernel alone: 4
# stages 0.96-1.01 GEMMs, 6 stages 0.98-1.02; groups of 16 slower at every shape).
STATS_CONFIG = dict(CONFIG, GROUP=8)


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
def _load_partition(
    h_desc, w_desc, a_bufs, b_bufs, ready, empty, n, width, v0, num_progs, GROUP_R: gl.constexpr
):
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    NB: gl.constexpr = a_bufs.type.shape[0]
    kt = gl.cdiv(h_desc.shape[1], BK)
    num_r = gl.cdiv(n, BM)
    num_c = gl.cdiv(width, BN)
    seq = 0
    for t in range(gl.program_id(0), num_r * num_c, num_progs):
        r, c = _tile_of(t, num_r, num_c, GROUP_R)
        for kk in range(kt):
            s = seq % NB
            # Barriers start with their phase-1 wait complete: the first lap finds every stage
            # free.
            mbarrier.wait(empty.index(s), ((seq // NB) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, h_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(h_desc, [r * BM, kk * BK], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(w_desc, [v0 + c * BN, kk * BK], bar, b_bufs.index(s))
            seq += 1


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
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    layout: gl.constexpr = _acc_layout(BN)
    kt = gl.cdiv(h_desc.shape[1], BK)
    num_r = gl.cdiv(n, BM)
    num_c = gl.cdiv(width, BN)
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
    row_max = gl.load(max_ptr + rows_ld)
    g_s = gl.load(gs_ptr + rows_ld)
    d = g_s[:, None] * gl.exp2(acc * _LOG2E - (row_max * _LOG2E)[:, None])
    cols = v0 + cols
    # Each row's ids are sorted; pos[row, c] .. pos[row, c + 1] are the ones in this tile.
    first = gl.load(pos_ptr + rows_ld * stride_pos + c)
    stop = gl.load(pos_ptr + rows_ld * stride_pos + c + 1)
    for p in range(gl.max(stop - first, axis=0)):
        at = first + p
        ok = at < stop
        id_p = gl.load(ids_ptr + rows_ld * stride_ids + at, mask=ok, other=-1)
        g_p = gl.load(gid_ptr + rows_ld * stride_ids + at, mask=ok, other=0.0)
        d += gl.where(cols[None, :] == id_p[:, None], g_p[:, None], 0.0)
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


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def _descriptor(t, block):
    layout = gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(t.dtype))
    return TensorDescriptor.from_tensor(t, block, layout)


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
    hidden, weight, row_max, grad_sum_exp, ids, grad_ids, pos, d, v0, slots, cfg=CONFIG
):
    """Writes ``d`` (``[n, width]``, a 16-byte-aligned view) for vocabulary columns ``v0 .. v0 +
    width``, as ``_vocab_triton.launch_dlogits``, with ``min(tiles, slots)`` programs (``pos``:
    per row, where each ``cfg["BN"]``-column tile's ids start in the sorted ``ids``). Operands and
    ``d`` must suit the copy engine (``_vocab_triton.tma_ok``)."""
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
    engine (``_vocab_triton.tma_ok``)."""
    cfg = cfg or STATS_CONFIG
    tiles = triton.cdiv(hidden.shape[0], cfg["BM"]) * stats_tiles(weight.shape[0], cfg)
    progs = min(tiles, slots)
    meta = _meta(cfg)
    _stats_pingpong_kernel[(progs,)](
        *_stats_args(hidden, weight, target, part, progs, cfg),
        HAS_TARGET=target is not None,
        **meta,
    )


_BUILDS = {}


def builds(device: torch.device, dtype: torch.dtype, kernel: str) -> bool:
    """Whether ``kernel`` ("dlogits" or "stats") can run on ``device`` for ``dtype`` inputs: a
    Hopper GPU (the kernels issue wgmma, which only sm_90 has), bf16 or fp16, and this Triton's
    Gluon compiles it.

    Checked once per device, dtype and kernel by compiling (not launching: safe under CUDA-graph
    capture) on placeholder tensors; a failure warns once and returns False."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, dtype, kernel)
    if key not in _BUILDS:
        _BUILDS[key] = _try_build(index, dtype, kernel)
    return _BUILDS[key]


def _try_build(index: int, dtype: torch.dtype, kernel: str) -> bool:
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    dev = torch.device("cuda", index)
    cfg = CONFIG if kernel == "dlogits" else STATS_CONFIG
    rows, cols = cfg["BM"], cfg["BN"]
    hidden = torch.empty(rows, cfg["BK"], dtype=dtype, device=dev)
    weight = torch.empty(cols, cfg["BK"], dtype=dtype, device=dev)
    vec = torch.empty(rows, dtype=torch.float32, device=dev)
    try:
        if kernel == "dlogits":
            d = torch.empty(rows, cols, dtype=dtype, device=dev)
            ids = torch.empty(rows, 1, dtype=torch.int32, device=dev)
            pos = torch.empty(rows, 2, dtype=torch.int32, device=dev)
            args = _dlogits_args(hidden, weight, vec, vec, ids, vec, pos, d, 0, 1, cfg)
            _dlogits_pingpong_kernel.warmup(*args, grid=(1,), **_meta(cfg))
        else:
            part = torch.empty(1, 3, rows, dtype=torch.float32, device=dev)
            tgt = torch.empty(rows, dtype=torch.int64, device=dev)
            for target in (tgt, None):
                args = _stats_args(hidden, weight, target, part, 1, cfg)
                _stats_pingpong_kernel.warmup(
                    *args, grid=(1,), HAS_TARGET=target is not None, **_meta(cfg)
                )
    except Exception as exc:  # noqa: BLE001 - any failure of an experimental compiler
        warnings.warn(
            f"megatron_cp: the Gluon {kernel} kernel does not build with Triton "
            f"{triton.__version__} ({type(exc).__name__}: {exc}); using the Triton kernel",
            stacklevel=3,
        )
        return False
    return True
