"""Process groups and every collective the package issues.

Two kinds of collectives live here:

* data collectives (``all_gather_into``, ``reduce_scatter_into``, ``all_reduce``) on tensors the
  caller provides, which sit on the data's device;
* bookkeeping: ``exchange`` all-gathers a few int64 per rank on the group's *collective device*
  (CUDA for NCCL, CPU for gloo), chosen from the group's backend and never from the caller's
  tensors, so a malformed call issues the same collective as a good one. ``agree`` builds on it:
  every rank contributes its verdict on its own input (an ``errors.InputError`` or None) plus a
  description of the call, and every rank raises the first bad rank's error, so no rank is left
  waiting in a collective that a peer skipped.

Group resolution: everything below the public wrappers takes its groups as arguments; only the
wrappers call the ``resolve_*`` functions with ``group=None``, and only then is megatron-core
imported.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.context_parallel.comm import errors

__all__ = [
    "resolve_context_parallel_group",
    "resolve_data_parallel_group",
    "resolve_tensor_parallel_group",
    "group_rank_and_size",
    "global_rank",
    "collective_device",
    "all_gather_into",
    "reduce_scatter_into",
    "all_reduce",
    "all_to_all_into",
    "exchange",
    "find_problem",
    "agree",
    "first_difference",
    "find_problem_or_difference",
    "raise_if_calls_differ",
]

# Columns of every ``agree`` row before the caller's own description of the call: the error's
# code, its origin (global rank), its four numbers, and the length of its note in int64 words.
_CODE, _ORIGIN, _NUMBERS, _NOTE_WORDS = 0, 1, slice(2, 6), 6
_PREFIX = 7
# A note longer than this is cut: it names a problem, it is not a log.
_NOTE_BYTES = 4096


def _parallel_state():
    try:
        from megatron.core import parallel_state
    except ImportError as exc:  # pragma: no cover - megatron-core is a dependency
        raise RuntimeError(
            "group=None asks for megatron-core's default process group, but megatron-core "
            "could not be imported; pass an explicit group"
        ) from exc
    return parallel_state


def _resolve(group, what: str, getter):
    """``group``; else megatron-core's group from ``getter(parallel_state)``; None off-job."""
    if group is not None:
        return group
    if not dist.is_available() or not dist.is_initialized():
        return None
    ps = _parallel_state()
    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            f"group=None needs megatron-core's parallel_state.initialize_model_parallel() to "
            f"have run; pass an explicit {what} group instead"
        )
    return getter(ps)


def resolve_context_parallel_group(group: Optional[dist.ProcessGroup]):
    """Returns ``group``, or megatron-core's CP group when ``group`` is None.

    When torch.distributed is not initialised and ``group`` is None, returns None: the caller
    then runs as the only rank of a CP group of size 1.
    """
    return _resolve(group, "context-parallel", lambda ps: ps.get_context_parallel_group())


def resolve_tensor_parallel_group(group: Optional[dist.ProcessGroup]):
    """Returns ``group``, or megatron-core's tensor-parallel group when None (None off-job)."""
    return _resolve(group, "tensor-parallel", lambda ps: ps.get_tensor_model_parallel_group())


def resolve_data_parallel_group(group: Optional[dist.ProcessGroup]):
    """Returns ``group``, or megatron-core's pure data-parallel group (without CP) when None."""
    return _resolve(
        group,
        "data-parallel",
        lambda ps: ps.get_data_parallel_group(with_context_parallel=False),
    )


def group_rank_and_size(group) -> Tuple[int, int]:
    """(rank in group, group size); (0, 1) for ``None`` outside an initialised job."""
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def global_rank() -> int:
    """This process's rank in the default group (0 outside a distributed job)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def collective_device(group) -> torch.device:
    """The device of bookkeeping collectives on ``group``: CPU for gloo, else the current GPU.

    Decided by the group's backend alone. A group with both backends (``"cpu:gloo,cuda:nccl"``)
    keeps its bookkeeping on the CPU.
    """
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "nccl" not in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# torch 2.13 renamed the single-tensor collectives (``all_gather_into_tensor`` ->
# ``all_gather_single``); the old names warn there, the new ones do not exist before.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """``output[r * len(input) : (r + 1) * len(input)] = input`` of rank r, for every rank.

    Runs whatever the sizes, zero included: a rank must never skip a collective its peers join.
    """
    _ALL_GATHER(output, input, group=group)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """``output`` = the sum over ranks of this rank's equal slice of ``input`` (dim 0)."""
    _REDUCE_SCATTER(output, input, group=group)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """In-place all-reduce of ``tensor`` over ``group``."""
    dist.all_reduce(tensor, op=op, group=group)


def all_to_all_into(
    output: torch.Tensor,
    input: torch.Tensor,
    output_counts: Sequence[int],
    input_counts: Sequence[int],
    group,
) -> None:
    """Rows ``input_counts[r]`` of ``input`` (dim 0, in rank order) go to rank r; ``output``
    receives ``output_counts[r]`` rows from rank r, in rank order.

    Every rank's ``input_counts[r]`` must equal rank r's ``output_counts`` at this rank. Runs
    whatever the counts, zero included.
    """
    dist.all_to_all_single(
        output,
        input,
        output_split_sizes=list(output_counts),
        input_split_sizes=list(input_counts),
        group=group,
    )


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def exchange(values: Sequence[int], group) -> List[Tuple[int, ...]]:
    """Every rank's ``values`` (same length everywhere), in group-rank order.

    One all-gather of int64 on ``collective_device(group)``, read back on the host (a device
    sync for NCCL). A group of one, or a CUDA stream being captured into a graph (where a host
    read is not allowed), exchanges nothing: every row is this rank's own.
    """
    mine = [int(v) for v in values]
    _, size = group_rank_and_size(group)
    if size == 1:
        return [tuple(mine)]
    device = collective_device(group)
    if _capturing(device):
        return [tuple(mine)] * size
    return _all_gather_ints(mine, group, size, device)


def _all_gather_ints(mine: List[int], group, size: int, device) -> List[Tuple[int, ...]]:
    """The exchange's own work: int64 to ``device``, all-gather, read back on the host."""
    send = torch.tensor(mine, dtype=torch.int64).to(device)
    recv = torch.empty(size * len(mine), dtype=torch.int64, device=device)
    all_gather_into(recv, send, group)
    return [tuple(row) for row in recv.view(size, len(mine)).tolist()]


def _encode_note(note: str) -> List[int]:
    """``note`` as little-endian int64 words (UTF-8, zero padded), at most ``_NOTE_BYTES``."""
    data = note.encode("utf-8", "replace")[:_NOTE_BYTES]
    data += b"\0" * (-len(data) % 8)
    return [int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, len(data), 8)]


def _decode_note(words: Sequence[int]) -> str:
    data = b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)
    return data.rstrip(b"\0").decode("utf-8", "replace")


def find_problem(
    problem: Optional[BaseException], group, call: Sequence[int] = ()
) -> Tuple[Optional[errors.InputError], List[Tuple[int, ...]]]:
    """Exchanges each rank's verdict on its input; returns (the first bad rank's error, rows).

    Args:
        problem: the exception this rank's local checks raised (an ``InputError``, or any other
            exception, which travels as ``rejected`` with its type and text), or None. A problem
            that came from another group already carries its ``origin`` and is passed on as it
            is.
        group: the process group of the call (every rank of it must call this).
        call: ints describing the call, the same length on every rank; returned per rank for
            the caller to compare (plan fingerprint, field structure, ...).

    Returns:
        ``(error, rows)``: the error of the lowest group rank with a problem, rebuilt from its
        code, numbers and note with its global rank as ``origin`` (so it reads the same on every
        rank, that rank included, where the original exception is its ``__cause__``), or None;
        and every rank's ``call`` values in group-rank order.

    Communication: one all-gather of ``7 + len(call)`` int64 per rank; when the first bad rank's
    error has a note, a second one carrying the note's bytes (every rank knows its length from
    the first).
    """
    local = None if problem is None else errors.from_exception(problem)
    note: List[int] = []
    if local is None:
        head = (0,) * _PREFIX
    else:
        origin = global_rank() if local.origin is None else local.origin
        note = _encode_note(local.note)
        header = local.header()
        head = (header[0], origin) + header[1:] + (len(note),)
    rows = exchange(head + tuple(int(v) for v in call), group)
    calls = [r[_PREFIX:] for r in rows]
    bad = next((i for i, row in enumerate(rows) if row[_CODE] != 0), None)
    if bad is None:
        return None, calls
    row = rows[bad]
    text = ""
    if row[_NOTE_WORDS]:
        own = group_rank_and_size(group)[0] == bad
        words = note if own else [0] * row[_NOTE_WORDS]
        text = _decode_note(exchange(words, group)[bad])
    first = errors.from_code(row[_CODE], row[_NUMBERS], row[_ORIGIN], text)
    if local is not None and row[:_PREFIX] == head:
        first.__cause__ = problem
    return first, calls


def agree(
    problem: Optional[BaseException], group, call: Sequence[int] = ()
) -> List[Tuple[int, ...]]:
    """``find_problem``, raising the first bad rank's error on every rank; returns the rows.

    Raises:
        errors.InputError: on every rank of ``group`` alike when any rank had a problem.
    """
    first, rows = find_problem(problem, group, call)
    if first is not None:
        raise first
    return rows


def first_difference(
    rows: Sequence[Sequence[int]], skip: Sequence[int] = ()
) -> Optional[errors.InputError]:
    """A ``calls_differ`` error for the first value on which the ranks' calls differ, or None.

    Args:
        rows: the ``call`` values of every rank, as ``find_problem`` / ``agree`` return them.
        skip: indices of values that may differ between ranks (a row count, a rank).
    """
    for i in range(len(rows[0]) if rows else 0):
        if i in skip:
            continue
        values = [row[i] for row in rows]
        if any(v != values[0] for v in values):
            other = next(v for v in values if v != values[0])
            return errors.make("calls_differ", i, values[0], other)
    return None


def find_problem_or_difference(
    problem: Optional[BaseException], group, call: Sequence[int] = ()
) -> Optional[errors.InputError]:
    """``find_problem``, then ``first_difference`` of the calls; the first found, or None.

    For a group whose verdict must travel on to another group (TP before CP) instead of being
    raised at once: raising here would leave the other group's ranks waiting.
    """
    first, rows = find_problem(problem, group, call)
    return first if first is not None else first_difference(rows)


def raise_if_calls_differ(rows: Sequence[Sequence[int]], skip: Sequence[int] = ()) -> None:
    """Raises ``first_difference(rows, skip)`` when there is one (the same on every rank)."""
    difference = first_difference(rows, skip)
    if difference is not None:
        raise difference
