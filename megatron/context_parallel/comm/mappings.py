"""Autograd-aware mappings between parallel regions: the package's only communicating Functions.

Context-parallel (CP) region:

* ``gather_from_context_parallel_region``: every field of a rank's shard is packed into one byte
  buffer, padded to the plan's largest shard, all-gathered ONCE over the CP group, and every
  received row is put at its source position (``row_ops.scatter_rows``). Backward: own rows.
* ``scatter_to_context_parallel_region``: its inverse (no communication forward).
* ``gather_padded_from_context_parallel_region``: the attention's K/V exchange, rows padded to
  the plan's largest shard and left in slot order. Backward: reduce-scatter.
* ``all_to_all_over_context_parallel_region``: the sequence mixers' exchange between row shards
  and head shards, uneven row counts per rank. Backward: the same all-to-all, counts swapped.

Tensor-parallel (TP) region, for the vocab-parallel head:

* ``copy_to_tensor_parallel_region``: identity forward, all-reduce backward.
* ``gather_from_tensor_parallel_region``: all-gather along a dim forward, own slice backward.

And ``reduce_over_data_parallel`` for anything computed from the gathered, CP-replicated outputs.

Bad input: the two CP entry points exchange, before any data moves, every rank's verdict on its
input and a description of its call (plan fingerprint, field structure, dtypes, trailing shapes,
row widths, device kind) in one small all-gather on the group's collective device
(``groups.agree``). Any problem on any rank, or any difference between ranks, raises the same
``errors.InputError`` (a ``ValueError``) on every rank, on every call. The data collective runs
only after that, so its sizes agree on every rank.

Layout: private helpers, then the autograd Functions, then the lower-case wrappers (the only
functions here that fall back to megatron-core's ``parallel_state`` groups).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.context_parallel.comm import errors, groups, row_ops
from megatron.context_parallel.comm.plan import ContextParallelPlan

__all__ = [
    "gather_from_context_parallel_region",
    "gather_or_raise",
    "scatter_to_context_parallel_region",
    "scatter_or_raise",
    "gather_padded_from_context_parallel_region",
    "all_to_all_over_context_parallel_region",
    "copy_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_over_data_parallel",
]

# Device kinds as exchanged between ranks.
_DEVICE_KINDS = {"cpu": 1, "cuda": 2}


# ---------------------------------------------------------------------------------------------
# Structure: one tensor, or a dict / tuple / list of tensors, flattened to a list and rebuilt.


def _flatten(local: Any) -> Tuple[List[Any], Any]:
    if isinstance(local, torch.Tensor):
        return [local], None
    if isinstance(local, dict):
        keys = list(local.keys())
        return [local[k] for k in keys], ("dict", keys)
    if isinstance(local, (tuple, list)):
        return list(local), (type(local), len(local))
    raise errors.make("structure")


def _unflatten(tensors: Sequence[torch.Tensor], spec: Any) -> Any:
    if spec is None:
        return tensors[0]
    if spec[0] == "dict":
        return dict(zip(spec[1], tensors))
    return spec[0](tensors)


# ---------------------------------------------------------------------------------------------
# Checks and the description of a call that ranks compare. Nothing here communicates.


def _check_fields(tensors: Sequence[Any], seq_dim: int, rank: int, plan, group, full: bool) -> None:
    """Raises the first thing wrong with this rank's fields (an ``errors.InputError``).

    Every field must have ``plan.counts[rank]`` rows along ``seq_dim`` (``plan.seq_len`` for a
    scatter's ``full`` tensor).
    """
    if len(tensors) == 0:
        raise errors.make("no_fields")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise errors.make("not_a_tensor", i)
        if not -t.dim() <= seq_dim < t.dim():
            raise errors.make("seq_dim", seq_dim, i, t.dim())
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t.device != device:
            raise errors.make("devices", i)
    if group is not None and groups.collective_device(group).type == "cuda":
        if device.type != "cuda":
            raise errors.make("backend_device")
    rows = plan.seq_len if full else plan.counts[rank]
    for i, t in enumerate(tensors):
        if t.shape[seq_dim] != rows:
            if full:
                raise errors.make("full_rows", t.shape[seq_dim], rows)
            raise errors.make("rows", i, t.shape[seq_dim], rows, rank)


def _row_bytes(t: torch.Tensor, seq_dim: int) -> int:
    return math.prod(s for d, s in enumerate(t.shape) if d != seq_dim % t.dim()) * t.element_size()


# What ``_describe`` puts after the plan's agreement values, in this order. Its first three
# values are the field structure that ``fields_differ`` reports.
_FIELD_VALUES = ("fields", "row_bytes", "structure", "seq_dim", "device_kind", "output_grad")
_FIELD_STRUCTURE = slice(
    ContextParallelPlan.AGREEMENT_VALUES, ContextParallelPlan.AGREEMENT_VALUES + 3
)
# A rank with a problem sends this in place of a description: the same length as one.
_UNDESCRIBED = (0,) * (ContextParallelPlan.AGREEMENT_VALUES + len(_FIELD_VALUES))


def _describe(
    plan: ContextParallelPlan, tensors: Sequence[torch.Tensor], seq_dim: int, output_grad: bool
) -> Tuple[int, ...]:
    """The ints that every rank of a gather or scatter must share.

    The plan's ``agreement_values``, then ``_FIELD_VALUES``: the number of fields, the bytes per
    row of all fields, a hash of every field's dtype, trailing shape and differentiability
    (which decides the collectives of the backward), the normalised ``seq_dim``, the device
    kind, and the backward mode.
    """
    seq = seq_dim % tensors[0].dim()
    text = repr(
        [
            (
                str(t.dtype),
                tuple(s for d, s in enumerate(t.shape) if d != seq),
                t.requires_grad and torch.is_grad_enabled(),
            )
            for t in tensors
        ]
    )
    values = dict(
        fields=len(tensors),
        row_bytes=sum(_row_bytes(t, seq_dim) for t in tensors),
        structure=int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little"),
        seq_dim=seq,
        device_kind=_DEVICE_KINDS.get(tensors[0].device.type, 3),
        output_grad=int(output_grad),
    )
    return plan.agreement_values() + tuple(values[name] for name in _FIELD_VALUES)


def _agree_on_input(
    problem: Optional[BaseException],
    plan: ContextParallelPlan,
    group,
    check: Callable[[int], Tuple[int, ...]],
) -> int:
    """Checks this rank's input, then ONE exchange; returns this rank's index in the group.

    ``check(rank)`` raises on a problem and else returns the call's description
    (``_describe``). Raises on every rank for any rank's problem (a caller's ``problem``
    included) or any difference between the ranks' descriptions.
    """
    rank, description = 0, _UNDESCRIBED
    if problem is None:
        try:
            if not isinstance(plan, ContextParallelPlan):
                raise errors.make("not_a_plan")
            rank = plan.rank_in(group)
            description = check(rank)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of any problem
            problem, description = exc, _UNDESCRIBED
    rows = groups.agree(problem, group, description)
    ContextParallelPlan.raise_unless_same(rows)
    first = rows[0][_FIELD_STRUCTURE]
    for row in rows[1:]:
        if tuple(row[_FIELD_STRUCTURE]) != tuple(first):
            mine = row[_FIELD_STRUCTURE]
            raise errors.make("fields_differ", first[0], mine[0], first[1], mine[1])
    groups.raise_if_calls_differ(rows)
    return rank


# What ranks of a data-parallel reduction compare, in this order; a rank with a problem sends
# ``_UNREDUCED`` (the same length).
_REDUCTION_VALUES = ("dims", "elements", "dtype_and_shape", "device_kind", "op")
_UNREDUCED = (0,) * len(_REDUCTION_VALUES)


def _describe_reduction(tensor: Any, op, group) -> Tuple[int, ...]:
    """The ints every rank of a ``reduce_over_data_parallel`` must share; raises on bad input."""
    if not isinstance(tensor, torch.Tensor):
        raise errors.make("not_a_tensor", 0, note=f"got {type(tensor).__name__}")
    if group is not None and groups.collective_device(group).type == "cuda":
        if tensor.device.type != "cuda":
            raise errors.make("backend_device")
    text = repr((str(tensor.dtype), tuple(tensor.shape)))
    values = dict(
        dims=tensor.dim(),
        elements=tensor.numel(),
        dtype_and_shape=int.from_bytes(
            hashlib.blake2b(text.encode(), digest_size=7).digest(), "little"
        ),
        device_kind=_DEVICE_KINDS.get(tensor.device.type, 3),
        op=int(op),
    )
    return tuple(values[name] for name in _REDUCTION_VALUES)


# ---------------------------------------------------------------------------------------------
# Data movement, no autograd.


def _as_row_bytes(x: torch.Tensor) -> torch.Tensor:
    """A seq-first tensor ``[n, ...]`` viewed as uint8 ``[n, row_bytes]`` (copies if strided)."""
    n, width = x.shape[0], math.prod(x.shape[1:])
    if n * width == 0:
        # Empty tensors may carry any strides, which a dtype view rejects.
        return torch.empty(n, width * x.element_size(), dtype=torch.uint8, device=x.device)
    return x.contiguous().view(n, width).view(torch.uint8)


def _copy_columns(dst: torch.Tensor, off: int, src: torch.Tensor) -> None:
    """``dst[:n, off : off + width] = src`` for uint8 ``src [n, width]``, as wide integers."""
    n, width = src.shape
    dtype = row_ops.int_view_dtype(
        dst.data_ptr(), dst.stride(0), off, width, src.data_ptr(), src.stride(0)
    )
    size = dtype.itemsize
    dst.view(dtype)[:n, off // size : (off + width) // size].copy_(src.view(dtype))


def _row_layout(fields: Sequence[torch.Tensor]) -> Tuple[List[int], List[int], int]:
    """Byte layout of one packed row: (offsets, widths, total) over ``fields``.

    Fields whose width is a multiple of 16 bytes go first, widest first, so they start on
    16-byte boundaries and the scatter kernel can move them with 16-byte vectors.
    """
    widths = [math.prod(f.shape[1:]) * f.element_size() for f in fields]
    order = sorted(range(len(fields)), key=lambda i: (widths[i] % 16 != 0, -widths[i]))
    offsets = [0] * len(fields)
    total = 0
    for i in order:
        offsets[i] = total
        total += widths[i]
    # A row stride that is a multiple of 16 bytes keeps every packed row 16-byte aligned, so
    # the kernel uses 16-byte vectors on all rows (measured on an H200: 10,484-byte rows moved
    # at 73% of copy bandwidth, the same rows padded to 10,496 bytes at 88%). Pad only where it
    # costs under 1/64 of the payload: narrow per-token rows would otherwise grow up to 4x.
    pad = -total % 16
    if pad * 64 <= total:
        total += pad
    return offsets, widths, total


def _gather_rows_to_source_order(
    fields: Sequence[torch.Tensor], plan: ContextParallelPlan, group, size: int
) -> List[torch.Tensor]:
    """Seq-first local fields ``[counts[rank], ...]`` -> seq-first full fields ``[seq_len, ...]``.

    One all-gather for all fields (none when the group has one rank).
    """
    device = fields[0].device
    row_source = plan.row_source(device)
    if size == 1:
        return [row_ops.gather_rows(f, row_source) for f in fields]
    offsets, widths, total = _row_layout(fields)
    rows = plan.max_count
    n = fields[0].shape[0]
    if len(fields) == 1 and n == rows and fields[0].is_contiguous():
        send = _as_row_bytes(fields[0])
    else:
        # Padding rows are never read (the scatter skips padding slots), so stay uninitialised.
        send = torch.empty(rows, total, dtype=torch.uint8, device=device)
        for f, off, width in zip(fields, offsets, widths):
            if width:
                _copy_columns(send, off, _as_row_bytes(f))
    recv = torch.empty(size * rows, total, dtype=torch.uint8, device=device)
    groups.all_gather_into(recv, send, group)
    if plan.slots_in_source_order and len(fields) == 1 and total == widths[0]:
        # The all-gather already wrote every row at its source position: no reorder pass.
        return [recv.view(fields[0].dtype).view((plan.seq_len,) + tuple(fields[0].shape[1:]))]
    unpacked = row_ops.scatter_rows(recv, row_source, offsets, widths)
    return [
        (
            u.view(f.dtype).view((plan.seq_len,) + tuple(f.shape[1:]))
            if u.shape[1]
            else torch.zeros((plan.seq_len,) + tuple(f.shape[1:]), dtype=f.dtype, device=device)
        )
        for u, f in zip(unpacked, fields)
    ]


def _reduce_scatter_to_local_rows(
    grads: Sequence[torch.Tensor], plan: ContextParallelPlan, group, rank: int, size: int
) -> List[torch.Tensor]:
    """Seq-first full gradients -> this rank's rows of their sum over the group.

    Only the owned rows travel: each gradient is laid out in the padded slot order, fields of
    one dtype side by side, and one reduce-scatter per dtype (in the order of first appearance,
    the same on every rank) sums them.
    """
    device = grads[0].device
    n = plan.counts[rank]
    if size == 1:
        return [row_ops.gather_rows(g, plan.local_positions(rank, device)) for g in grads]
    slots = plan.slot_positions(device)
    out: List[Optional[torch.Tensor]] = [None] * len(grads)
    by_dtype: dict = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        flat = [grads[i].reshape(plan.seq_len, -1) for i in idx]
        full = torch.cat(flat, dim=1) if len(flat) > 1 else flat[0]
        padded = row_ops.gather_rows(full, slots)
        mine = torch.empty(plan.max_count, full.shape[1], dtype=dtype, device=device)
        groups.reduce_scatter_into(mine, padded, group)
        start = 0
        for i, f in zip(idx, flat):
            width = f.shape[1]
            out[i] = mine[:n, start : start + width].reshape((n,) + tuple(grads[i].shape[1:]))
            start += width
    return out  # type: ignore[return-value]


def _seq_first(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    return t if seq_dim == 0 else t.movedim(seq_dim, 0)


def _seq_back(t: torch.Tensor, seq_dim: int) -> torch.Tensor:
    return t if seq_dim == 0 else t.movedim(0, seq_dim).contiguous()


# ---------------------------------------------------------------------------------------------
# Autograd Functions: CP region.


class _GatherFromContextParallelRegion(torch.autograd.Function):
    """Forward: all-gather the shards into source order. Backward: own rows (or reduce-scatter)."""

    @staticmethod
    def forward(ctx, plan, group, rank, size, seq_dim, output_grad, *tensors):
        ctx.plan, ctx.group, ctx.rank, ctx.size = plan, group, rank, size
        ctx.seq_dim, ctx.output_grad = seq_dim, output_grad
        ctx.floating = [t.is_floating_point() or t.is_complex() for t in tensors]
        ctx.shapes = [t.shape for t in tensors]
        ctx.dtypes = [t.dtype for t in tensors]
        ctx.device = tensors[0].device
        fields = [_seq_first(t, seq_dim) for t in tensors]
        outs = [
            _seq_back(o, seq_dim) for o in _gather_rows_to_source_order(fields, plan, group, size)
        ]
        ctx.mark_non_differentiable(*[o for o, fl in zip(outs, ctx.floating) if not fl])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # Which fields take part is decided by what every rank agreed on in the forward (their
        # differentiability), never by which gradients happen to be None on this rank, so the
        # reduce-scatters of output_grad=True are the same on every rank.
        wanted = [i for i, fl in enumerate(ctx.floating) if fl and ctx.needs_input_grad[6 + i]]
        if not ctx.output_grad:
            wanted = [i for i in wanted if grads[i] is not None]
        result: List[Optional[torch.Tensor]] = [None] * len(grads)
        if wanted:
            full = []
            for i in wanted:
                g = grads[i]
                if g is None:
                    shape = list(ctx.shapes[i])
                    shape[ctx.seq_dim] = ctx.plan.seq_len
                    g = torch.zeros(shape, dtype=ctx.dtypes[i], device=ctx.device)
                full.append(_seq_first(g, ctx.seq_dim))
            if ctx.output_grad:
                local = _reduce_scatter_to_local_rows(full, ctx.plan, ctx.group, ctx.rank, ctx.size)
            else:
                index = ctx.plan.local_positions(ctx.rank, full[0].device)
                local = [row_ops.gather_rows(g, index) for g in full]
            for i, g in zip(wanted, local):
                result[i] = _seq_back(g, ctx.seq_dim)
        return (None,) * 6 + tuple(result)


class _ScatterToContextParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's rows (no communication). Backward: all-gather into source order."""

    @staticmethod
    def forward(ctx, plan, group, rank, size, seq_dim, full):
        ctx.plan, ctx.group, ctx.size, ctx.seq_dim = plan, group, size, seq_dim
        index = plan.local_positions(rank, full.device)
        return _seq_back(row_ops.gather_rows(_seq_first(full, seq_dim), index), seq_dim)

    @staticmethod
    def backward(ctx, grad):
        g = _seq_first(grad, ctx.seq_dim)
        full = _gather_rows_to_source_order([g], ctx.plan, ctx.group, ctx.size)[0]
        return None, None, None, None, None, _seq_back(full, ctx.seq_dim)


class _GatherPaddedFromContextParallelRegion(torch.autograd.Function):
    """Forward: pad rows to ``max_count``, all-gather (slot order). Backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, local, group, size, max_count):
        ctx.group, ctx.size, ctx.rows = group, size, local.shape[0]
        tail = tuple(local.shape[1:])
        # Zero padding, not uninitialised memory: consumers mask padding slots out, but a masked
        # weight of 0 times a NaN from garbage would still poison a row.
        send = local.new_zeros((max_count,) + tail)
        send[: local.shape[0]] = local
        if size == 1:
            return send
        out = local.new_empty((size * max_count,) + tail)
        groups.all_gather_into(out, send, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.size == 1:
            return grad[: ctx.rows], None, None, None
        mine = grad.new_empty((grad.shape[0] // ctx.size,) + tuple(grad.shape[1:]))
        groups.reduce_scatter_into(mine, grad, ctx.group)
        return mine[: ctx.rows], None, None, None


class _AllToAllOverContextParallelRegion(torch.autograd.Function):
    """Forward: rows to ranks by ``send_counts``, rows from ranks by ``recv_counts``. Backward:
    the transpose, the same all-to-all with the counts swapped."""

    @staticmethod
    def forward(ctx, rows, group, send_counts, recv_counts):
        ctx.group, ctx.send_counts, ctx.recv_counts = group, send_counts, recv_counts
        out = rows.new_empty((sum(recv_counts),) + tuple(rows.shape[1:]))
        groups.all_to_all_into(out, rows.contiguous(), recv_counts, send_counts, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send_counts),) + tuple(grad.shape[1:]))
        groups.all_to_all_into(back, grad.contiguous(), ctx.send_counts, ctx.recv_counts, ctx.group)
        return back, None, None, None


# ---------------------------------------------------------------------------------------------
# Autograd Functions: TP region.


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) over TP.

    Consumers that each see V/TP of the vocabulary contribute part of the input's gradient;
    the all-reduce adds them up.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        groups.all_reduce(grad, ctx.group)
        return grad, None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """Forward: all-gather along ``dim`` over TP. Backward: keep this rank's slice.

    Every TP rank uses the gathered tensor alike (it computes the same thing from it), so each
    rank's gradient of the gathered tensor is already complete: no reduction.
    """

    @staticmethod
    def forward(ctx, x, group, rank, size, dim):
        ctx.rank, ctx.dim, ctx.width = rank, dim, x.shape[dim]
        # Gathered along dim 0 (the layout every backend accepts), then moved into place.
        moved = x.movedim(dim, 0).contiguous()
        parts = moved.new_empty((size * moved.shape[0],) + tuple(moved.shape[1:]))
        groups.all_gather_into(parts, moved, group)
        return parts.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        start = ctx.rank * ctx.width
        return grad.narrow(ctx.dim, start, ctx.width).contiguous(), None, None, None, None


# ---------------------------------------------------------------------------------------------
# Public wrappers.


def gather_or_raise(
    local: Any,
    plan: ContextParallelPlan,
    group,
    *,
    seq_dim: int = 0,
    context_parallel_output_grad: bool = False,
    problem: Optional[BaseException] = None,
) -> Any:
    """``gather_from_context_parallel_region`` on an explicit group, sharing a caller's problem.

    For callers with checks of their own (the output head): ``problem`` is the error those
    checks found on this rank (or None). It travels in the gather's exchange, and every rank of
    ``group`` then raises the first rank's error instead of moving data; ``local`` is ignored on
    a rank with a problem. ``group`` may be None only outside a distributed job.
    """
    flat: List[Any] = [[], None]

    def check(rank: int) -> Tuple[int, ...]:
        flat[:] = _flatten(local)
        _check_fields(flat[0], seq_dim, rank, plan, group, full=False)
        return _describe(plan, flat[0], seq_dim, context_parallel_output_grad)

    rank = _agree_on_input(problem, plan, group, check)
    tensors, spec = flat
    outs = _GatherFromContextParallelRegion.apply(
        plan,
        group,
        rank,
        plan.cp_size,
        seq_dim % tensors[0].dim(),
        bool(context_parallel_output_grad),
        *tensors,
    )
    return _unflatten(list(outs), spec)


def gather_from_context_parallel_region(
    local: Any,
    plan: ContextParallelPlan,
    group: Optional[dist.ProcessGroup] = None,
    *,
    seq_dim: int = 0,
    context_parallel_output_grad: bool = False,
) -> Any:
    """Forward: all-gather CP shards into source order; backward: keep own rows (or reduce-scatter).

    Args:
        local: this rank's shard: a tensor, or a dict / tuple / list of tensors sharing the local
            rows. Each has ``plan.counts[rank]`` rows along ``seq_dim``, any dtype and trailing
            shape, all on one device. All fields move in ONE data collective.
        plan: the CP plan, identical on every rank of ``group``.
        group: the CP process group; None means megatron-core's
            ``parallel_state.get_context_parallel_group()`` (or a single rank outside a
            distributed job).
        seq_dim: the sequence dimension of every field.
        context_parallel_output_grad: False (default) when every rank computes the same thing on
            the gathered tensors: rank r's input gradient is its own rows of its output gradient,
            with no communication and no scaling. True when the ranks' consumers differ (each
            computes part of the loss): output gradients are summed over the group (one
            reduce-scatter per dtype) before each rank keeps its rows; then every rank must
            backpropagate through the outputs.

    Returns:
        The same structure, each tensor of size ``plan.seq_len`` along ``seq_dim`` in source
        order (rows no rank owns are zero), identical on every rank. Integer and bool fields are
        not differentiable.

    Raises:
        errors.InputError (a ValueError; ``InputTypeError`` is a TypeError too): on EVERY rank
            alike, before any data moves, when any rank passes something wrong (a structure that
            is not a tensor or a dict / tuple / list of tensors, a field that is not a tensor,
            ``seq_dim`` out of range, fields on different devices, CPU tensors on an NCCL group,
            a row count other than the plan's, a group whose size is not ``plan.cp_size``), or
            when ranks differ (plans, number of fields, dtypes, trailing shapes,
            differentiability, ``seq_dim``, device kind, backward mode). One small all-gather
            of int64 on the group's collective device carries these checks on every call.
    """
    return gather_or_raise(
        local,
        plan,
        groups.resolve_context_parallel_group(group),
        seq_dim=seq_dim,
        context_parallel_output_grad=context_parallel_output_grad,
    )


def scatter_or_raise(
    full: torch.Tensor,
    plan: ContextParallelPlan,
    group,
    *,
    seq_dim: int = 0,
    problem: Optional[BaseException] = None,
) -> torch.Tensor:
    """``scatter_to_context_parallel_region`` on an explicit group, sharing a caller's problem.

    ``problem`` works as in ``gather_or_raise``: a model entry point passes what its own checks
    found, so every rank raises it before any rank starts the forward's collectives.
    """

    def check(rank: int) -> Tuple[int, ...]:
        if not isinstance(full, torch.Tensor):
            raise errors.make("not_a_tensor", 0)
        _check_fields([full], seq_dim, rank, plan, group, full=True)
        return _describe(plan, [full], seq_dim, False)

    rank = _agree_on_input(problem, plan, group, check)
    return _ScatterToContextParallelRegion.apply(
        plan, group, rank, plan.cp_size, seq_dim % full.dim(), full
    )


def scatter_to_context_parallel_region(
    full: torch.Tensor,
    plan: ContextParallelPlan,
    group: Optional[dist.ProcessGroup] = None,
    *,
    seq_dim: int = 0,
) -> torch.Tensor:
    """Forward: keep this rank's rows in its local order; backward: all-gather into source order.

    Args:
        full: a tensor of size ``plan.seq_len`` along ``seq_dim``, the same on every rank.
        plan: the CP plan, identical on every rank of ``group``.
        group: the CP process group; None means megatron-core's CP group.
        seq_dim: the sequence dimension.

    Returns:
        ``[..., plan.counts[rank], ...]``: the rows at ``plan.local_positions(rank)``. Its
        gradient is all-gathered (one collective) into the full input's gradient, so a batch
        sharded by a plan passes gradients back to the full input; rows no rank owns get zero.

    Raises:
        errors.InputError: on every rank alike (one small exchange, as for the gather), for a
            tensor that is not ``plan.seq_len`` long along ``seq_dim`` on some rank, or any
            difference between ranks (plans, dtypes, trailing shapes, ``seq_dim``).
    """
    return scatter_or_raise(
        full, plan, groups.resolve_context_parallel_group(group), seq_dim=seq_dim
    )


def gather_padded_from_context_parallel_region(
    local: torch.Tensor, max_count: int, group
) -> torch.Tensor:
    """Forward: pad to ``max_count`` rows and all-gather over CP; backward: reduce-scatter, unpad.

    Args:
        local: ``[n, ...]`` with ``n <= max_count`` (this rank's rows in plan order).
        max_count: the plan's largest shard; every rank must pass the same.
        group: the CP group (None: one rank).

    Returns:
        ``[cp_size * max_count, ...]`` in slot order (rank r's row i at ``r * max_count + i``),
        padding rows zero. Gradient: the sum over ranks of each slot's gradient, this rank's
        ``n`` rows kept (the keys and values of every rank's queries reach their owner).

    No exchange: the caller (attention inside a model) has rows fixed by an agreed plan.
    """
    _, size = groups.group_rank_and_size(group)
    return _GatherPaddedFromContextParallelRegion.apply(local, group, size, max_count)


def all_to_all_over_context_parallel_region(
    rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group
) -> torch.Tensor:
    """Forward: all-to-all of rows over CP (uneven counts); backward: all-to-all back.

    Args:
        rows: ``[sum(send_counts), ...]``: the rows for rank 0, then those for rank 1, ...
        send_counts: rows this rank sends to each rank of ``group``.
        recv_counts: rows this rank receives from each rank; rank r's ``send_counts`` at this
            rank's index must equal this rank's ``recv_counts[r]``.
        group: the CP group; every rank must call with agreeing counts.

    Returns:
        ``[sum(recv_counts), ...]``: rank 0's rows for this rank, then rank 1's, ... of
        ``rows``' dtype. Gradient: each received row's gradient is sent back to the row it came
        from (the transpose of the forward).

    No exchange: the callers (sequence mixers inside a model) take counts from an agreed plan.
    With one rank it returns ``rows`` itself.
    """
    if groups.group_rank_and_size(group)[1] == 1:
        return rows
    return _AllToAllOverContextParallelRegion.apply(
        rows, group, tuple(int(c) for c in send_counts), tuple(int(c) for c in recv_counts)
    )


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: identity; backward: all-reduce (sum) over the TP group (None or one rank: none)."""
    if groups.group_rank_and_size(group)[1] == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Forward: all-gather along ``dim`` over TP (rank order); backward: keep own slice.

    Runs on every rank whatever ``x``'s size (zero rows included), so TP peers never wait.
    """
    rank, size = groups.group_rank_and_size(group)
    if size == 1:
        return x
    return _GatherFromTensorParallelRegion.apply(x, group, rank, size, dim % x.dim())


def reduce_over_data_parallel(
    tensor: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """All-reduce over the pure data-parallel group; for values computed from gathered outputs.

    Outputs gathered with ``gather_from_context_parallel_region`` are identical on every CP rank,
    so a per-rank mean computed from them must not be averaged over CP again: reduce it over the
    data-parallel group without CP (``get_data_parallel_group(with_context_parallel=False)``
    when ``group`` is None). (A ``[sum, count]`` pair may be reduced over DP x CP too: both
    grow by ``cp_size`` and the ratio stays exact.)

    Args:
        tensor: any tensor; it is not modified.
        op: the reduction (``dist.ReduceOp``).
        group: the data-parallel group; None means megatron-core's pure DP group (or no
            reduction outside a distributed job).

    Returns:
        A new, detached tensor holding the reduction (not differentiable: reduce losses for
        logging, and let Megatron's DDP reduce the gradients).

    Raises:
        errors.InputError (``InputTypeError`` for a non-tensor): on every rank of ``group``
            alike, before the reduction, when any rank passes something that is not a tensor, a
            CPU tensor on an NCCL group, or a shape, dtype or ``op`` other than its peers'. One
            small all-gather of int64 on the group's collective device carries the check.
    """
    group = groups.resolve_data_parallel_group(group)
    problem, description = None, _UNREDUCED
    try:
        description = _describe_reduction(tensor, op, group)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of any problem
        problem = exc
    if groups.group_rank_and_size(group)[1] == 1:
        if problem is not None:
            error = errors.from_exception(problem)
            if error is problem:
                raise error
            raise error from problem
        return tensor.detach().clone()
    groups.raise_if_calls_differ(groups.agree(problem, group, description))
    out = tensor.detach().clone()
    groups.all_reduce(out, group, op)
    return out
