"""Extra memory and time of the fused attention's backward under the key-gradient options of
the cuDNN kernel (``CudnnOptions``; issue 26: extra peak memory per layer):

* ``CudnnOptions.separate_key_gradients``: cuDNN writes dK / dV to two dense ``[M, G, d]``
  buffers (read in place by ``attention.sums``) rather than straight into the interleaved
  ``[M, G, 2d]`` layout. With GQA its backward keeps per-query-head dK and dV in its workspace,
  laid out with the outputs' token stride times ``H / G``, so the interleaved layout doubles
  them.
* ``CudnnOptions.exact_key_workspace``: the graph's key total halved, as the frontend sizes
  those 16-bit buffers at four bytes an element.

Per case of ``bench_attention.cases(S)``, each setting: forward+backward ms (timed in turns in
one run), extra peak GiB beyond Q / K / V / O and their gradients (as ``bench_attention`` counts
it), the largest workspace one cuDNN call asked for, and the largest difference of the
gradients from the first setting's (the same arithmetic; cuDNN's dQ sums are unordered).

Run on a GPU with nvidia-cudnn-frontend:
``python benchmarks/probes/probe_key_gradient_layout.py [--sizes 20436] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "attention"))

from bench_attention import DIM, HEADS, Case, cases, extra_peak  # noqa: E402
from timing import time_round_robin  # noqa: E402

from megatron.context_parallel.attention import cudnn as _attention_cudnn  # noqa: E402

GiB = 1024**3
# (CudnnOptions.separate_key_gradients, CudnnOptions.exact_key_workspace)
SETTINGS = {
    "interleaved": (False, False),
    "dense dK, dV": (True, False),
    "dense, exact": (True, True),
}


def _kernel(setting):
    """The cuDNN kernel under ``setting`` (the library's defaults otherwise)."""
    separate, exact = setting
    return _attention_cudnn.CudnnKernel(
        _attention_cudnn.CudnnOptions(separate_key_gradients=separate, exact_key_workspace=exact)
    )


def _largest_workspace(fn):
    """(result of ``fn()``, the largest workspace in bytes a cuDNN call of it asked for)."""
    sizes = [0]
    real = _attention_cudnn._workspace

    def record(size, device):
        sizes.append(int(size))
        return real(size, device)

    _attention_cudnn._workspace = record
    try:
        return fn(), max(sizes)
    finally:
        _attention_cudnn._workspace = real


def probe_case(name, plan, rank, cu, reps, device):
    case = Case(plan, rank, cu, device)
    n = case.query.shape[0]
    kept = 2 * n * HEADS * DIM * 2 + case.kv_slots.numel() * 2
    kernels = {label: _kernel(setting) for label, setting in SETTINGS.items()}
    fns = {label: (lambda k=k: case.ours(True, kernel=k)) for label, k in kernels.items()}
    times = time_round_robin(fns, device, reps, 1)
    row = {"case": name, "tables": case.runs.describe()}
    first = None
    for label, kernel in kernels.items():
        gc.collect()
        torch.cuda.empty_cache()
        peak, ws = _largest_workspace(
            lambda k=kernel: extra_peak(lambda: case.ours(True, kernel=k), kept)
        )
        grads = [t.float() for t in case.ours(True, kernel=kernel)[1:]]
        first = grads if first is None else first
        row[f"{label}: fwd+bwd ms"] = times[label]
        row[f"{label}: extra GiB"] = peak
        row[f"{label}: largest workspace GiB"] = ws / GiB
        row[f"{label}: max |grad difference|"] = max(
            (x - y).abs().max().item() for x, y in zip(grads, first)
        )
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="20436")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        for name, plan, rank, cu in cases(size):
            rows.append(probe_case(name, plan, rank, cu, args.reps, device))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
