"""The seam between the fused attention Functions (``fused``) and a varlen attention kernel.

``fused`` moves the data (query span buffers, compact keys, gradient sums); a kernel computes
the entries of one ``AttentionRuns`` call. Anything with these members plugs in: the cuDNN
kernel (``cudnn.CudnnKernel``), or the tests' dense reference kernels on the CPU.
"""

from __future__ import annotations

from typing import Optional, Protocol, Tuple, runtime_checkable

import torch

__all__ = ["AttentionKernel"]


@runtime_checkable
class AttentionKernel(Protocol):
    """A varlen attention kernel over the entries of one ``AttentionRuns`` call.

    Shapes (``H`` query heads, ``G`` key / value heads, ``d`` head dim): ``q`` ``[Tq, H, d]``,
    ``kv`` ``[N, G, 2d]`` (keys, then values), ``o`` / ``do`` / ``dq`` like ``q``, ``stats`` the
    log-sum-exp ``[Tq, H]``, ``dkv`` ``[2, M, G, d]`` (key gradients, then value gradients;
    ``M = runs.mat_rows``). Each entry is a bottom-right causal block (``runs.causal``; else
    unmasked) of its ``q_len`` rows over its ``kv_len`` keys; the backward differentiates against
    the output and log-sum-exp it is given and writes each entry's key gradients whole.

    Attributes:
        shared_keys_in_backward: the backward reads each entry's keys where the forward did
            (overlapping ranges of the compact keys); False: it is given per-entry copies at
            ``runs.mat_start`` when entries overlap (``runs.materialize``).
        split_backward: a causal call's backward may run as its prefix and diagonal calls
            (``AttentionRuns.backward_split``), the second given ``dkv_out``; for a kernel whose
            backward skips masked tiles only on square entries.
        split_margin: the ``margin`` of that split (``AttentionRuns.backward_split``).
    """

    shared_keys_in_backward: bool
    split_backward: bool
    split_margin: float

    def backward_window_rows(self, heads: int, dim: int) -> Optional[int]:
        """Query plus key-gradient rows one backward call may span before the caller cuts it
        into windows (``AttentionRuns.backward_windows``); None: never cut."""
        ...

    def for_levels(self) -> "AttentionKernel":
        """The kernel of the blocked layout's level calls (the same computation; these run
        beside the blocked backward's fp32 gradient sums, so a kernel may cut them into
        smaller windows)."""
        ...

    def key_gradients(self, kv: torch.Tensor, runs) -> torch.Tensor:
        """A ``dkv`` ``[2, M, G, d]`` for ``runs``' backward, zero where no entry writes: the
        caller hands it (or windows of its rows) to the call's pieces as ``dkv_out``."""
        ...

    def forward(
        self, q: torch.Tensor, kv: torch.Tensor, runs, dev, scale: float, want_stats: bool
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(o, stats)`` of every entry (``stats`` None unless ``want_stats``)."""
        ...

    def backward(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        o: torch.Tensor,
        do: torch.Tensor,
        stats: torch.Tensor,
        runs,
        dev,
        scale: float,
        deterministic: bool,
        dkv_out: Optional[torch.Tensor] = None,
        dq_out: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(dq, dkv)`` of every entry. With ``dkv_out`` (``[2, M, G, d]``: a ``dkv`` an
        earlier call returned, ``key_gradients``' buffer, or a window of its rows), the key
        gradients are written into it, rows no entry writes keep their values, and it is
        returned (the pieces of a split or windowed backward). With ``dq_out`` (contiguous,
        ``q``'s shape and dtype: a window's rows of the caller's query gradient), the query
        gradients are written into it, rows outside every entry set to zero, and it is
        returned."""
        ...
