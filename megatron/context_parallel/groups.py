"""Process groups: resolution (explicit first, then megatron-core's defaults) and collectives.

Everything below the public wrappers takes its groups as arguments. Only the wrappers call
these resolvers with ``group=None``, and only then is megatron-core imported. The two
single-tensor collectives are reached through one place because torch renamed them
(``all_gather_into_tensor`` -> ``all_gather_single`` in 2.13) while torch >= 2.6 is supported.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "resolve_context_parallel_group",
    "resolve_data_parallel_group",
    "resolve_tensor_parallel_group",
    "group_rank_and_size",
    "collective_device",
    "all_gather_single",
    "reduce_scatter_single",
]


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


def collective_device(group, like: Optional[torch.Tensor] = None) -> torch.device:
    """The device for small bookkeeping collectives on ``group``.

    A tensor's own device when given (data collectives go where the data is); otherwise CPU
    for gloo and the current CUDA device for NCCL.
    """
    if like is not None:
        return like.device
    backend = dist.get_backend(group)
    if "nccl" in str(backend) and "gloo" not in str(backend):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """``output[r * len(input) : (r + 1) * len(input)] = input`` of rank r, for every rank."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """``output`` = the sum over ranks of this rank's equal slice of ``input``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, group=group)
