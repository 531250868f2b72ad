"""The attention subsystem's settings: one frozen object, read through a function, scoped.

``AttentionSettings`` holds every process-wide choice of the attention path (the backend, the
kernel shape policy of the run tables, whether their host ops run on the calling thread). The
value in effect is ``current_attention_settings()``; ``attention_settings(**changes)`` changes
it for a ``with`` block and restores it on exit, and ``set_attention_backend`` (public) sets
the backend of the process default. Nothing else changes it.

The value is process-wide, not per thread or context: the autograd engine runs backward on its
own threads, which must see the settings the forward ran with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from typing import Iterator

__all__ = [
    "BACKENDS",
    "AttentionSettings",
    "attention_settings",
    "current_attention_settings",
    "set_attention_backend",
]

BACKENDS = ("auto", "dense", "cudnn")


@dataclass(frozen=True)
class AttentionSettings:
    """Process-wide settings of the attention path.

    Attributes:
        backend: ``"auto"`` (cuDNN's fused attention for fp16 / bf16 CUDA tensors when
            ``nvidia-cudnn-frontend`` is installed, else the dense computation), ``"dense"``
            (always the dense computation: the CPU path and the reference) or ``"cudnn"``
            (always fused; raises where it cannot run).
        shape_buckets: sizes per power of two that an entry's rows and keys are rounded up to
            for the kernel shape (``runs._kernel_sizes``; 1: powers of two).
        shape_reuse: a batch may run on a recorded kernel shape up to this many times its own
            in every size (1: never; see ``runs._shared_shape``).
        serial_host_ops: the tables' host ops run on the calling thread alone
            (``runs.serial_host_ops``); False keeps torch's intra-op threads (so the two can be
            timed).
    """

    backend: str = "auto"
    # Why these defaults: see the kernel shape notes above ``runs._shared_shape``.
    shape_buckets: int = 1
    shape_reuse: float = 2.0
    serial_host_ops: bool = True

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {BACKENDS}, got {self.backend!r}")
        if isinstance(self.shape_buckets, bool) or int(self.shape_buckets) != self.shape_buckets:
            raise TypeError(f"shape_buckets must be an int, got {self.shape_buckets!r}")
        if self.shape_buckets < 1:
            raise ValueError(f"shape_buckets must be at least 1, got {self.shape_buckets}")
        if not self.shape_reuse >= 1:
            raise ValueError(f"shape_reuse must be at least 1, got {self.shape_reuse}")


_CURRENT = [AttentionSettings()]
_LOCK = threading.Lock()


def current_attention_settings() -> AttentionSettings:
    """The settings in effect (the process default, or the innermost ``attention_settings``)."""
    return _CURRENT[0]


@contextlib.contextmanager
def attention_settings(**changes) -> Iterator[AttentionSettings]:
    """Runs a ``with`` block under the current settings with ``changes`` (fields of
    ``AttentionSettings``); yields them and restores the previous ones on exit.

    Raises:
        TypeError, ValueError: on an unknown field or a bad value (before anything changes).
    """
    with _LOCK:
        before = _CURRENT[0]
        _CURRENT[0] = dataclasses.replace(before, **changes)
        inside = _CURRENT[0]
    try:
        yield inside
    finally:
        with _LOCK:
            _CURRENT[0] = before


def set_attention_backend(name: str) -> None:
    """Choose the backend of ``ContextParallelAttention`` for this process.

    Sets ``AttentionSettings.backend`` of the process default (an ``attention_settings`` block
    around the call restores its own value on exit).

    Args:
        name: ``"auto"`` (default: cuDNN's fused attention for fp16 / bf16 CUDA tensors when
            ``nvidia-cudnn-frontend`` is installed, else the dense computation), ``"dense"``
            (always the dense computation: the CPU path and the reference) or ``"cudnn"``
            (always fused; raises where it cannot run).
    """
    with _LOCK:
        _CURRENT[0] = dataclasses.replace(_CURRENT[0], backend=name)
