"""The Gluon kernels of the head compile for Hopper on a machine without a GPU.

Gluon has no interpreter, so on CPU this is the one check their code gets: each kernel is traced
and compiled down to sm_90a PTX through the installed Triton with the arguments its launcher
builds (``_vocab_gluon.compile_only``, which ``builds`` runs on the GPU), so an API or layout
error, or a launcher out of step with its kernel, fails here rather than on the GPU machine.
The GPU tests (test_vocab_ops_cuda.py) run them there.
"""

import os
import pathlib
import subprocess
import sys

import _gluon_target
import pytest
import torch

from megatron.context_parallel.head import vocab_ops

gluon = vocab_ops.vocab_gluon

pytestmark = [
    pytest.mark.skipif(gluon is None, reason="needs Triton's Gluon"),
    # On a GPU machine the kernels compile for the real device in the GPU tests.
    pytest.mark.skipif(torch.cuda.is_available(), reason="compile-only check for CPU machines"),
]

# The shared memory of one H200 block (227 KiB).
_SMEM = 227 * 1024


@pytest.fixture
def hopper_target():
    with _gluon_target.hopper_target():
        yield


def _check(compiled):
    ptx = compiled.asm["ptx"]
    assert ".target sm_90a" in ptx
    # The products run on the tensor cores as warpgroup MMAs, in warp-specialised partitions.
    assert "wgmma.mma_async" in ptx and "setmaxnreg" in ptx
    assert compiled.metadata.shared <= _SMEM


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [1, 20, 64])
def test_topk_kernel_compiles(hopper_target, k, dtype):
    _check(gluon.compile_only("topk", dtype, "cpu", k, with_target=k == 20))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stats_and_dlogits_kernels_compile(hopper_target, dtype):
    _check(gluon.compile_only("stats", dtype, "cpu"))
    _check(gluon.compile_only("dlogits", dtype, "cpu"))


def test_ptxas_report_lists_every_kernel():
    # benchmarks/probes/ptxas_report.py (registers and spills without a GPU) keeps working; run
    # as its users run it, in its own process.
    root = pathlib.Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "probes" / "ptxas_report.py"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, str(script), "--k", "20"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    for kernel in ("stats, bfloat16", "d_logits, float16", "top-k 64 x 256 (configured), k = 20"):
        assert f"| {kernel}" in out
    # With the running top-k in shared memory between tiles, the 128 x 128 consumer spills ~100
    # bytes at k = 20 (in registers: ~900, Triton 3.6); the configured 64 x 256 one next to
    # none.
    rows = {line.split(" | ")[0]: line for line in out.splitlines() if line.startswith("| top-k")}
    spilled = {label: int(line.split(" | ")[2].split(" / ")[0]) for label, line in rows.items()}
    assert spilled["| top-k 128 x 128, k = 20, bfloat16"] <= 256
    assert spilled["| top-k 64 x 256 (configured), k = 20, bfloat16"] <= 32
