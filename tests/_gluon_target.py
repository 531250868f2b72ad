"""Compile Triton and Gluon kernels for a Hopper GPU on a machine that has none.

A shim: Triton's CUDA driver loads libcuda when built and asks it for the current device's
architecture. ``hopper_target()`` swaps in a driver that skips that and answers sm_90, so
``kernel.warmup(...)`` traces and compiles down to sm_90a PTX (and ``ptxas`` can assemble it);
nothing is ever launched. Used by tests/head/test_vocab_gluon_compile.py and
benchmarks/probes/ptxas_report.py; nothing in the package imports it.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["hopper_target"]


@contextlib.contextmanager
def hopper_target():
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    class CompileOnly(CudaDriver):
        def __init__(self):
            pass

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    saved = driver._active
    driver.set_active(CompileOnly())
    try:
        yield
    finally:
        driver._active = saved
