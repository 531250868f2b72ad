"""The Gated DeltaNet convolution reading its rows through the source-order index (Triton).

``gdn.ContextParallelGatedDeltaNet`` receives each owned row's head chunk in receive order (rows
grouped by the rank that sent them) and needs them in source order for the causal depthwise
convolution. Reordering them first is a full copy each way (~0.35 ms of a ~19 ms layer
forward+backward at S = 20,436 on an H100). Here the
convolution itself reads each source row where it was received, and its backward writes each
row's gradient back there, so the received rows are never reordered:

* forward: ``y[t] = act(bias + sum_i weight[:, K-1-i] * x[to_source[t - i]])`` over the ``i``
  with ``t - i`` in ``t``'s own packed sequence (``offsets[t] >= i``); ``y`` dense, source order;
* backward (with the activation's input recomputed by the same kernel, as fla's convolution
  does): ``dx[to_source[t]] = sum_j weight[:, K-1-j] * dpre[t + j]`` over the ``j`` with ``t + j``
  in ``t``'s sequence, ``dweight[:, K-1-j] = sum_t dpre[t + j] * x[to_source[t]]`` and ``dbias =
  sum_t dpre[t]``, fp32 partial sums per row tile added by torch.

The arithmetic follows fla's ``causal_conv1d`` (the kernel megatron's layer calls on CUDA) term
by term and in the same order (fp32 accumulation, the recomputed pre-activation rounded to the
input dtype as fla rounds it); the weight and bias gradients are summed over other row tiles.
``tests/mixers/test_gdn_cuda.py`` holds all four within bf16 rounding of fla's on reordered rows,
and ``tests/mixers/test_gdn_conv_interpret.py`` checks the kernels against plain torch on CPU.

Measured (H100, S = 20,436, Qwen3.5-27B's GDN shape at CP 2,
``benchmarks/mixers/bench_gdn.py``): 1.92-2.00 ms forward+backward against 2.39-2.43 for fla's on
rows already in order (forward equal; the backward writes the input gradient into the received
rows' gradient, where fla's goes through the slice's backward), and no reorder of 0.35 ms before
it.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["gathered_causal_conv"]

# Rows per program (fla's chunk size); the channel tile is chosen per width below.
_BT = 64
_ACTIVATIONS = (None, "silu", "swish")


@triton.jit
def _tile(offsets, N, C: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """This program's tile: row tile index, source rows ``[BT, 1]``, channels ``[1, BD]``, their
    masks and each row's index within its sequence ``[BT, 1]``.

    Row quantities are [BT, 1] and channel ones [1, BD] throughout: Triton 3.6 miscompiles a 1-D
    row mask used by both a 1-D and a broadcast 2-D load ("mask type matches ptr type")."""
    i_d, i_t = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)[:, None]
    o_d = i_d * BD + tl.arange(0, BD)[None, :]
    m_t = o_t < N
    pos = tl.load(offsets + o_t, mask=m_t, other=0)
    return i_t, o_t, o_d, m_t, o_d < C, pos


@triton.jit
def _conv_fwd_kernel(
    x, stride_x, to_source, offsets, weight, bias, y, N,
    C: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    _, o_t, o_d, m_t, m_d, pos = _tile(offsets, N, C, BT, BD)
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    # Oldest row first, as fla sums.
    for i_w in tl.static_range(-K + 1, 1):
        m_r = m_t & (pos + i_w >= 0)
        row = tl.load(to_source + o_t + i_w, mask=m_r, other=0)
        b_x = tl.load(x + row * stride_x + o_d, mask=m_r & m_d, other=0.0).to(tl.float32)
        b_w = tl.load(weight + o_d * K + (i_w + K - 1), mask=m_d, other=0.0).to(tl.float32)
        acc += b_x * b_w
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    if ACTIVATION == "silu" or ACTIVATION == "swish":
        acc = acc * tl.sigmoid(acc)
    p_y = y + o_t * C + o_d
    tl.store(
        p_y,
        tl.cast(acc, dtype=p_y.dtype.element_ty, fp_downcast_rounding="rtne"),
        mask=m_t & m_d,
    )


@triton.jit
def _conv_bwd_kernel(
    x, stride_x, to_source, offsets, weight, pre, dy, dx, stride_dx, dw, db, N,
    C: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    i_t, o_t, o_d, m_t, m_d, pos = _tile(offsets, N, C, BT, BD)
    o_c = tl.program_id(0) * BD + tl.arange(0, BD)  # channels of the per-tile sums
    m_x = m_t & m_d
    row = tl.load(to_source + o_t, mask=m_t, other=0)
    b_x = tl.load(x + row * stride_x + o_d, mask=m_x, other=0.0)
    b_dx = tl.zeros((BT, BD), dtype=tl.float32)
    if HAS_BIAS:
        b_db = tl.zeros((BD,), dtype=tl.float32)
    for i_w in tl.static_range(0, K):
        o_s = o_t + i_w
        # Row t + i_w takes row t as its input i_w back only inside t's own sequence.
        m_s = (o_s < N) & m_t
        m_s = m_s & (tl.load(offsets + o_s, mask=m_s, other=-1) == pos + i_w)
        m_sd = m_s & m_d
        b_dy = tl.load(dy + o_s * C + o_d, mask=m_sd, other=0.0).to(tl.float32)
        if ACTIVATION == "silu" or ACTIVATION == "swish":
            b_y = tl.load(pre + o_s * C + o_d, mask=m_sd, other=0.0).to(tl.float32)
            b_ys = tl.sigmoid(b_y)
            b_dy = b_dy * b_ys * (1 + b_y * (1 - b_ys))
        b_w = tl.load(weight + o_d * K + (K - 1 - i_w), mask=m_d, other=0.0).to(tl.float32)
        b_dw = tl.sum(b_dy * b_x, 0)
        tl.store(dw + i_t * C * K + o_c * K + (K - 1 - i_w), b_dw, mask=o_c < C)
        if HAS_BIAS and i_w == 0:
            b_db += tl.sum(b_dy, 0)
        b_dx += b_dy * b_w
    if HAS_BIAS:
        tl.store(db + i_t * C + o_c, b_db, mask=o_c < C)
    p_dx = dx + row * stride_dx + o_d
    tl.store(
        p_dx, tl.cast(b_dx, dtype=p_dx.dtype.element_ty, fp_downcast_rounding="rtne"), mask=m_x
    )


class _FixedTile:
    """``kernel[grid](...)`` with a 32-channel tile: Triton's CPU interpreter (the tests) cannot
    time the autotuner's configurations."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return functools.partial(self.kernel[grid], BD=32)


def _tuned(kernel):
    """``kernel`` autotuned over its channel tile and warps on a GPU (each launch writes its
    outputs whole, so the autotuner's trial runs are harmless); ``_FixedTile`` under the
    interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return _FixedTile(kernel)
    configs = [triton.Config({"BD": bd}, num_warps=w) for bd in (32, 64, 128) for w in (4, 8)]
    return triton.autotune(configs=configs, key=["C", "K", "ACTIVATION"])(kernel)


_conv_fwd = _tuned(_conv_fwd_kernel)
_conv_bwd = _tuned(_conv_bwd_kernel)


def _forward(x, to_source, offsets, weight, bias, channels, activation, out_dtype) -> Tensor:
    n = to_source.shape[0]
    y = torch.empty(n, channels, device=x.device, dtype=out_dtype)
    if n == 0:
        return y
    weight = weight.contiguous()

    def grid(meta):
        return (triton.cdiv(channels, meta["BD"]), triton.cdiv(n, _BT))

    _conv_fwd[grid](
        x, x.stride(0), to_source, offsets, weight, bias if bias is not None else weight, y, n,
        C=channels, K=weight.shape[1], HAS_BIAS=bias is not None, ACTIVATION=activation, BT=_BT,
    )  # fmt: skip
    return y


class _GatheredConv(torch.autograd.Function):
    """See ``gathered_causal_conv``."""

    @staticmethod
    def forward(ctx, received, weight, bias, to_source, from_source, offsets, channels, act):
        ctx.save_for_backward(received, weight, bias, to_source, from_source, offsets)
        ctx.channels, ctx.act = channels, act
        conv = _forward(received, to_source, offsets, weight, bias, channels, act, received.dtype)
        rest = received[:, channels:].index_select(0, to_source)
        return conv, rest

    @staticmethod
    def backward(ctx, d_conv: Tensor, d_rest: Tensor):
        received, weight, bias, to_source, from_source, offsets = ctx.saved_tensors
        n, width = received.shape
        channels, act = ctx.channels, ctx.act
        d_received = torch.empty_like(received)
        # The columns past the convolution's: their rows back to receive order.
        d_received[:, channels:] = d_rest.index_select(0, from_source)
        k = weight.shape[1]
        tiles = triton.cdiv(n, _BT)
        dw = torch.empty(tiles, channels, k, device=received.device, dtype=torch.float32)
        db = (
            torch.empty(tiles, channels, device=received.device, dtype=torch.float32)
            if bias is not None
            else None
        )
        if n:
            # The activation's input, recomputed (fla's convolution does the same).
            pre = (
                _forward(received, to_source, offsets, weight, bias, channels, None, received.dtype)
                if act is not None
                else d_conv
            )
            weight_c = weight.contiguous()
            d_conv = d_conv.contiguous()

            def grid(meta):
                return (triton.cdiv(channels, meta["BD"]), tiles)

            _conv_bwd[grid](
                received, received.stride(0), to_source, offsets, weight_c, pre, d_conv,
                d_received, d_received.stride(0), dw, db if db is not None else dw, n,
                C=channels, K=k, HAS_BIAS=bias is not None, ACTIVATION=act, BT=_BT,
            )  # fmt: skip
        d_weight = dw.sum(0).to(weight.dtype)
        d_bias = db.sum(0).to(bias.dtype) if bias is not None else None
        return d_received, d_weight, d_bias, None, None, None, None, None


def gathered_causal_conv(
    received: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    to_source: Tensor,
    from_source: Tensor,
    offsets: Tensor,
    channels: int,
    activation: Optional[str],
) -> Tuple[Tensor, Tensor]:
    """Causal depthwise convolution of packed sequences whose rows are read in source order
    through an index, and the remaining columns of those rows in source order.

    Args:
        received: ``[N, W]`` rows (CUDA, last dim contiguous; any float dtype): the first
            ``channels`` columns are the convolution's input; source row ``t`` is
            ``received[to_source[t]]``.
        weight: ``[channels, K]`` (``conv1d.weight[:, 0]``), any width ``K``.
        bias: ``[channels]`` or None.
        to_source, from_source: int64 ``[N]``, a permutation and its inverse.
        offsets: int64 ``[N]``, each source row's index within its packed sequence.
        channels: ``C <= W``.
        activation: None, ``"silu"`` or ``"swish"`` (megatron's ``GatedDeltaNet.activation``).

    Returns:
        ``(y [N, C], rest [N, W - C])`` in source order and ``received``'s dtype: ``y`` the
        activated convolution, ``rest`` the other columns. Gradient: one ``[N, W]`` tensor in
        receive order for ``received`` (the convolution's input gradient written through the
        index, ``rest``'s rows gathered back), fp32-summed weight and bias gradients.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"gathered_causal_conv: activation {activation!r} not in {_ACTIVATIONS}")
    if received.stride(1) != 1:
        raise ValueError("gathered_causal_conv: received rows must be contiguous in their columns")
    return _GatheredConv.apply(
        received, weight, bias, to_source, from_source, offsets, channels, activation
    )
