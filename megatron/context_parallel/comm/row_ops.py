"""Row primitives of the gather: move whole rows by an index, rows treated as bytes.

Two ops, both functional (they allocate their outputs and never alias their inputs):

* ``scatter_rows(packed, row_source, offsets, widths) -> list[Tensor]``: ``packed`` is the
  padded all-gather buffer viewed as bytes, uint8 ``[slots, W]``. For each field ``f`` it
  returns uint8 ``[len(row_source), widths[f]]`` whose row ``p`` is
  ``packed[row_source[p], offsets[f] : offsets[f] + widths[f]]``, or zeros where
  ``row_source[p] < 0`` (positions nobody owns; padding slots are never read).
* ``gather_rows(src, index) -> Tensor``: ``src`` ``[N, ...]`` of any dtype; returns
  ``[len(index), ...]`` whose row ``i`` is ``src[index[i]]``, or zeros where ``index[i] < 0``.

``permute_rows(src, index, inverse)`` is ``gather_rows`` by a permutation whose gradient is
``gather_rows`` by the inverse permutation: a second gather rather than a scatter-add.

Both are torch custom ops in the ``megatron_cp`` namespace (``torch.ops.megatron_cp.*``), so
they trace under ``torch.compile`` through their fake implementations. The schemas are defined
here, once; CPU tensors use the torch implementations below; CUDA tensors use the kernels in
``csrc/`` when the compiled extension loads (``_extension.py``), else the same torch code with
one warning. ``gather_rows`` is differentiable in ``src``: the gradient of row ``j`` of ``src``
is the sum of the output-gradient rows ``i`` with ``index[i] == j``. ``scatter_rows`` moves
uint8 bytes, which carry no gradient; callers differentiate around it (mappings.py).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from megatron.context_parallel import _extension

__all__ = ["scatter_rows", "gather_rows", "permute_rows", "has_cuda_kernels", "int_view_dtype"]

_NAMESPACE = "megatron_cp"
_lib = torch.library.Library(_NAMESPACE, "DEF")
_lib.define(
    "scatter_rows(Tensor packed, Tensor row_source, int[] offsets, int[] widths, "
    "int? max_threads_per_row=None) -> Tensor[]"
)
_lib.define("gather_rows(Tensor src, Tensor index) -> Tensor")


# --- torch implementations (CPU, and the CUDA fallback) -------------------------------------


_INT_VIEWS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def int_view_dtype(*byte_counts: int) -> torch.dtype:
    """The widest integer dtype (int64 .. uint8) whose size divides every one of ``byte_counts``.

    Bytes are moved as elements of this dtype: torch's indexing and strided copies move one
    element at a time, so int64 elements take up to 8x fewer steps than uint8 ones.
    """
    align = 0
    for value in byte_counts:
        align |= int(value)
    for size, dtype in _INT_VIEWS:
        if align % size == 0:
            return dtype
    raise AssertionError("unreachable: every alignment divides by 1")


def _wide_columns(rows: torch.Tensor, off: int, width: int) -> torch.Tensor:
    """Bytes ``[off, off + width)`` of uint8 ``[N, W]`` rows, viewed as wide integers."""
    dtype = int_view_dtype(rows.data_ptr(), rows.stride(0), off, width)
    size = dtype.itemsize
    return rows.view(dtype)[:, off // size : (off + width) // size]


class _MissingRows:
    """Where an index is -1: a safe index to read with, and how to zero those output rows.

    On a CPU the few missing rows are looked up on the host once and zeroed with
    ``index_fill_``, and a fully owned index is used as it is (no per-call clamped copy); a
    byte-wise mask over the whole output would cost more than the copy itself. On a device a
    broadcast mask keeps shapes static, so nothing waits on the host.
    """

    def __init__(self, index: torch.Tensor):
        self._index = index
        if index.device.type == "cpu":
            self._rows = torch.nonzero(index < 0).flatten()
            self.safe = index.clamp(min=0) if self._rows.numel() else index
        else:
            self._rows = None
            self.safe = index.clamp(min=0)

    def zero(self, out: torch.Tensor) -> torch.Tensor:
        if self._rows is not None:
            return out.index_fill_(0, self._rows, 0) if self._rows.numel() else out
        mask = (self._index < 0).view((-1,) + (1,) * (out.dim() - 1))
        return out.masked_fill_(mask, 0)


def _scatter_rows_torch(packed, row_source, offsets, widths, max_threads_per_row=None):
    # max_threads_per_row tunes the CUDA kernel only; torch indexing has nothing to tune.
    missing = _MissingRows(row_source)
    outs = []
    for off, width in zip(offsets, widths):
        if packed.shape[0] == 0 or width == 0:
            # Nothing to read: every index must be -1, so every row is zero.
            outs.append(packed.new_zeros((row_source.shape[0], width)))
            continue
        rows = _wide_columns(packed, off, width).index_select(0, missing.safe)
        outs.append(missing.zero(rows).view(torch.uint8))
    return outs


def _gather_rows_torch(src, index):
    tail = tuple(src.shape[1:])
    num_out, inner = index.shape[0], math.prod(tail)
    if inner == 0:
        return src.new_empty((num_out,) + tail)
    row_bytes = inner * src.element_size()
    if src.shape[0] == 0:
        rows = torch.zeros((num_out, row_bytes), dtype=torch.uint8, device=src.device)
    else:
        # Rows as bytes: one code path for every dtype (masked_fill_ lacks some, e.g. float8).
        missing = _MissingRows(index)
        flat = src.reshape(src.shape[0], inner).contiguous().view(torch.uint8)
        rows = _wide_columns(flat, 0, row_bytes).index_select(0, missing.safe)
        rows = missing.zero(rows).view(torch.uint8)
    return rows.view(src.dtype).view((num_out,) + tail)


_lib.impl("scatter_rows", _scatter_rows_torch, "CPU")
_lib.impl("gather_rows", _gather_rows_torch, "CPU")


@torch.library.register_fake(f"{_NAMESPACE}::scatter_rows", lib=_lib)
def _scatter_rows_fake(packed, row_source, offsets, widths, max_threads_per_row=None):
    return [packed.new_empty((row_source.shape[0], width)) for width in widths]


@torch.library.register_fake(f"{_NAMESPACE}::gather_rows", lib=_lib)
def _gather_rows_fake(src, index):
    return src.new_empty((index.shape[0],) + tuple(src.shape[1:]))


def _gather_rows_setup(ctx, inputs, output):
    src, index = inputs
    ctx.save_for_backward(index)
    ctx.num_src_rows = src.shape[0]


def _gather_rows_backward(ctx, grad):
    (index,) = ctx.saved_tensors
    n = ctx.num_src_rows
    # Rows with index -1 produced zeros; their gradient goes to a spare row that is dropped.
    # index_add_ sums repeated indices, which is the exact adjoint of a gather.
    target = torch.where(index >= 0, index, n)
    grad_src = grad.new_zeros((n + 1,) + tuple(grad.shape[1:]))
    grad_src.index_add_(0, target, grad)
    return grad_src[:n], None


torch.library.register_autograd(
    f"{_NAMESPACE}::gather_rows", _gather_rows_backward, setup_context=_gather_rows_setup, lib=_lib
)


# --- CUDA: compiled kernels, or the torch code with one warning ------------------------------

_HAS_CUDA_KERNELS = _extension.load()

if not _HAS_CUDA_KERNELS:

    def _scatter_rows_fallback(packed, row_source, offsets, widths, max_threads_per_row=None):
        _extension.warn_fallback_once("scatter_rows")
        return _scatter_rows_torch(packed, row_source, offsets, widths)

    def _gather_rows_fallback(src, index):
        _extension.warn_fallback_once("gather_rows")
        return _gather_rows_torch(src, index)

    _lib.impl("scatter_rows", _scatter_rows_fallback, "CUDA")
    _lib.impl("gather_rows", _gather_rows_fallback, "CUDA")


def has_cuda_kernels() -> bool:
    """True when CUDA tensors go through the compiled kernels rather than torch indexing."""
    return _HAS_CUDA_KERNELS


# --- public functions ------------------------------------------------------------------------


def _check_index(index, data, what: str) -> None:
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{what} must be a tensor, got {type(index).__name__}")
    if index.dtype != torch.int64 or index.dim() != 1:
        raise ValueError(
            f"{what} must be a 1-D int64 tensor, got {index.dtype} of shape {tuple(index.shape)}"
        )
    if index.device != data.device:
        raise ValueError(f"{what} is on {index.device} but the data is on {data.device}")


def scatter_rows(
    packed: torch.Tensor,
    row_source: torch.Tensor,
    offsets: Sequence[int],
    widths: Sequence[int],
    *,
    max_threads_per_row: Optional[int] = None,
) -> List[torch.Tensor]:
    """Unpacks the fields of the padded all-gather buffer into source order.

    Args:
        packed: uint8 ``[slots, W]``; the rows must be dense (a column slice of a wider buffer
            is fine). Slot ``r * max_count + i`` holds rank ``r``'s local row ``i``.
        row_source: int64 ``[S]`` on ``packed``'s device; the slot feeding each output row, or
            -1 for a row nobody owns (written as zeros). Values must be ``< slots``.
        offsets: byte offset of each field within a row.
        widths: byte width of each field; ``offsets[f] + widths[f] <= W``.
        max_threads_per_row: tuning knob of the CUDA kernel for benchmarks: at most this many
            threads (a power of two, 1 to 256) share one row. ``None`` keeps the kernel's
            measured default (64, see ``csrc/row_copy.h``). No effect on CPU tensors.

    Returns:
        One new uint8 ``[S, widths[f]]`` tensor per field. No gradient (bytes).

    Raises:
        TypeError, ValueError: on a wrong dtype, rank, device or field range, before any work.
    """
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"packed must be uint8 [slots, W], got {packed.dtype} of shape {tuple(packed.shape)}"
        )
    _check_index(row_source, packed, "row_source")
    offsets = [int(o) for o in offsets]
    widths = [int(w) for w in widths]
    if len(offsets) != len(widths):
        raise ValueError(f"got {len(offsets)} offsets but {len(widths)} widths")
    if max_threads_per_row is not None:
        t = max_threads_per_row
        if not isinstance(t, int) or isinstance(t, bool) or not 1 <= t <= 256 or t & (t - 1):
            raise ValueError(f"max_threads_per_row must be a power of two in [1, 256], got {t!r}")
    row_bytes = packed.shape[1]
    for f, (off, width) in enumerate(zip(offsets, widths)):
        if off < 0 or width < 0 or off + width > row_bytes:
            raise ValueError(
                f"field {f} covers bytes [{off}, {off + width}) of a {row_bytes}-byte row"
            )
    return torch.ops.megatron_cp.scatter_rows(
        packed, row_source, offsets, widths, max_threads_per_row=max_threads_per_row
    )


class _PermuteRows(torch.autograd.Function):
    """Forward: rows by a permutation. Backward: the gradient's rows by its inverse."""

    @staticmethod
    def forward(ctx, src, index, inverse):
        ctx.save_for_backward(inverse)
        return torch.ops.megatron_cp.gather_rows(src, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return torch.ops.megatron_cp.gather_rows(grad.contiguous(), inverse), None, None


def permute_rows(src: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Rows of ``src`` in the order of a permutation; differentiable in ``src``.

    Args:
        src: ``[N, ...]`` of any dtype and device.
        index: int64 ``[N]`` on ``src``'s device, a permutation of ``0 .. N-1``: row ``i`` of
            the output is ``src[index[i]]``.
        inverse: int64 ``[N]``, its inverse (``inverse[index[i]] == i``). Not verified here
            (that would read the device): the caller builds both from one host table.

    Returns:
        New ``[N, *src.shape[1:]]`` tensor. Gradient: ``grad_src = grad_out[inverse]``, one
        gather (a gradient through ``gather_rows`` would be a scatter-add).

    Raises:
        TypeError, ValueError: on a wrong dtype, rank, device or length, before any work.
    """
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a tensor, got {type(src).__name__}")
    if src.dim() < 1:
        raise ValueError("src must have a row dimension, got a 0-d tensor")
    _check_index(index, src, "index")
    _check_index(inverse, src, "inverse")
    if index.shape[0] != src.shape[0] or inverse.shape[0] != src.shape[0]:
        raise ValueError(
            f"a permutation of {src.shape[0]} rows needs index and inverse of that length, got "
            f"{index.shape[0]} and {inverse.shape[0]}"
        )
    return _PermuteRows.apply(src, index, inverse)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of ``src`` by ``index``; differentiable in ``src``.

    Args:
        src: ``[N, ...]`` of any dtype and device.
        index: int64 ``[M]`` on ``src``'s device; values in ``[-1, N)``, -1 gives a zero row.

    Returns:
        New ``[M, *src.shape[1:]]`` tensor of ``src``'s dtype. Gradient: ``grad_src[j]`` is the
        sum of ``grad_out[i]`` over ``index[i] == j`` (zero for rows never picked).

    Raises:
        TypeError, ValueError: on a wrong dtype, rank or device, before any work.
    """
    if not isinstance(src, torch.Tensor):
        raise TypeError(f"src must be a tensor, got {type(src).__name__}")
    if src.dim() < 1:
        raise ValueError("src must have a row dimension, got a 0-d tensor")
    _check_index(index, src, "index")
    return torch.ops.megatron_cp.gather_rows(src, index)
