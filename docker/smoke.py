"""Smoke test of an installed megatron-context-parallel: the last step of the Docker build.

Checks, in order, and reports every failure before exiting non-zero:

1. The package imports (from wherever it was installed) and says whether its compiled CUDA
   extension ``megatron.context_parallel._C`` loaded. With ``--require-cuda`` anything but
   "loaded" fails: that is what makes a Docker build fail when the kernels did not build or do
   not load against the image's torch.
2. The row ops and a single-rank gather put rows where an independently built reference says,
   on CPU, with exact equality.
3. When a GPU is visible: the same on CUDA, compared exactly with the CPU results, for several
   dtypes and row widths; with the extension loaded this runs the compiled kernels, and the
   torch fallback's warning is an error.
4. With ``--expect-megatron-core VERSION``: megatron-core is that version and the package's
   megatron-core integration (the CP attention) imports.
5. With ``--require-attention``: the ``attention`` extra is there, i.e. the cuDNN frontend of the
   fused attention imports and loads cuDNN (no GPU needed for that).

A Docker build has no GPU, so there only 1, 2 and 4 run; the image's first run on a node (or
``python docker/smoke.py --require-cuda`` on a GPU machine) covers 3.

Usage: python docker/smoke.py [--require-cuda] [--require-attention]
                              [--expect-megatron-core VERSION]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import warnings
from typing import Callable, List

import torch


def _reference_gather(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Row ``i`` = ``src[index[i]]``, zeros where ``index[i] < 0``: a plain Python loop."""
    out = torch.zeros((index.numel(),) + tuple(src.shape[1:]), dtype=src.dtype)
    for i, j in enumerate(index.tolist()):
        if j >= 0:
            out[i] = src[j]
    return out


def _row_op_cases(device: torch.device) -> List[tuple]:
    """(name, result, expected) triples for gather_rows / scatter_rows on ``device``."""
    from megatron.context_parallel.comm import row_ops as ops

    gen = torch.Generator().manual_seed(0)
    cases = []
    for dtype, width in ((torch.float32, 5), (torch.bfloat16, 64), (torch.int64, 3)):
        src = (torch.randn(7, width, generator=gen) * 100).to(dtype)
        index = torch.tensor([6, -1, 0, 3, 3, -1, 1, 2, 5], dtype=torch.int64)
        got = ops.gather_rows(src.to(device), index.to(device)).cpu()
        cases.append((f"gather_rows {dtype} width {width}", got, _reference_gather(src, index)))
    packed = torch.randint(0, 256, (6, 40), dtype=torch.uint8, generator=gen)
    row_source = torch.tensor([4, 0, -1, 5, 1, 2, -1], dtype=torch.int64)
    offsets, widths = [0, 16, 33], [16, 17, 7]
    got = ops.scatter_rows(packed.to(device), row_source.to(device), offsets, widths)
    for f, (off, width) in enumerate(zip(offsets, widths)):
        expected = _reference_gather(packed[:, off : off + width], row_source)
        cases.append((f"scatter_rows field {f} (width {width})", got[f].cpu(), expected))
    return cases


def _gather_cases(device: torch.device) -> List[tuple]:
    """A one-rank gather of a permuted shard lands every row at its source position."""
    from megatron.context_parallel import ContextParallelPlan, gather_from_context_parallel_region

    positions = [5, 0, 3, 1]  # position 2 and 4 are owned by nobody: zero rows
    plan = ContextParallelPlan.from_rank_positions([positions], seq_len=6)
    hidden = torch.arange(4 * 3, dtype=torch.float32).view(4, 3) + 1
    ids = torch.tensor([50, 10, 30, 11], dtype=torch.int64)
    out = gather_from_context_parallel_region({"h": hidden.to(device), "t": ids.to(device)}, plan)
    want_h = torch.zeros(6, 3)
    want_t = torch.zeros(6, dtype=torch.int64)
    for row, pos in enumerate(positions):
        want_h[pos] = hidden[row]
        want_t[pos] = ids[row]
    return [
        ("single-rank gather, float field", out["h"].cpu(), want_h),
        ("single-rank gather, int field", out["t"].cpu(), want_t),
    ]


def _check_cases(where: str, build: Callable[[], List[tuple]], failures: List[str]) -> None:
    try:
        cases = build()
    except Exception as exc:  # noqa: BLE001 - report, do not crash the whole smoke test
        failures.append(f"{where}: raised {type(exc).__name__}: {exc}")
        return
    bad = [name for name, got, want in cases if not torch.equal(got, want)]
    for name in bad:
        failures.append(f"{where}: {name} differs from the reference")
    print(f"  {where}: {len(cases) - len(bad)}/{len(cases)} exact")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--require-cuda",
        action="store_true",
        help="fail unless the compiled CUDA extension loads",
    )
    parser.add_argument(
        "--expect-megatron-core",
        metavar="VERSION",
        help="fail unless this megatron-core version is installed and the integration imports",
    )
    parser.add_argument(
        "--require-attention",
        action="store_true",
        help="fail unless the attention extra (the cuDNN frontend) imports and loads cuDNN",
    )
    args = parser.parse_args(argv)
    failures: List[str] = []

    print(
        f"smoke: python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"torch CUDA {torch.version.cuda}"
    )
    try:
        import megatron.context_parallel as mcp
        from megatron.context_parallel import _extension
        from megatron.context_parallel.comm import row_ops as ops
    except Exception as exc:  # noqa: BLE001
        print(f"smoke: FAILED: the package does not import: {type(exc).__name__}: {exc}")
        return 1
    outcome, reason = _extension.status()
    print(f"  package {mcp.__version__} from {os.path.dirname(mcp.__file__)}")
    print(
        f"  CUDA extension: {outcome}{f' ({reason})' if reason else ''}; "
        f"CUDA tensors use {'the compiled kernels' if ops.has_cuda_kernels() else 'torch'}"
    )
    if args.require_cuda and outcome != "loaded":
        failures.append(f"the CUDA extension is required but is {outcome}: {reason}")
    host, host_reason = _extension.host_status()
    print(f"  attention host tables: {host}{f' ({host_reason})' if host_reason else ''}")
    if args.require_cuda and host != "loaded":
        failures.append(f"the host tables are required with the kernels but are {host}")

    _check_cases("cpu row ops", lambda: _row_op_cases(torch.device("cpu")), failures)
    _check_cases("cpu gather", lambda: _gather_cases(torch.device("cpu")), failures)

    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        print(
            f"  GPU: {torch.cuda.get_device_name(device)}, "
            f"capability {torch.cuda.get_device_capability(device)}"
        )
        with warnings.catch_warnings():
            if outcome == "loaded":
                # With the kernels loaded, a fallback warning means they were bypassed.
                warnings.simplefilter("error", UserWarning)
            _check_cases("cuda row ops", lambda: _row_op_cases(device), failures)
            _check_cases("cuda gather", lambda: _gather_cases(device), failures)
    else:
        print("  GPU: none visible; the CUDA kernels were not run (only loaded)")

    if args.expect_megatron_core:
        try:
            found = importlib.metadata.version("megatron-core")
        except importlib.metadata.PackageNotFoundError:
            found = None
        if found != args.expect_megatron_core:
            failures.append(f"megatron-core {args.expect_megatron_core} expected, found {found}")
        try:
            import megatron.context_parallel.attention.layers  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            failures.append(f"the megatron-core integration does not import: {exc}")
        else:
            print(f"  megatron-core {found}: integration imports")

    if args.require_attention:
        try:
            from megatron.context_parallel.attention import cudnn as cudnn_backend

            frontend = cudnn_backend._cudnn()
        except Exception as exc:  # noqa: BLE001
            frontend, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = "the cudnn module does not import or cuDNN does not load"
        if frontend is None:
            failures.append(f"the attention extra is required but its frontend is missing: {why}")
        else:
            print(
                f"  attention extra: cuDNN frontend {getattr(frontend, '__version__', '?')}, "
                f"cuDNN {frontend.backend_version()}"
            )

    if failures:
        print("smoke: FAILED")
        for line in failures:
            print(f"  - {line}")
        return 1
    print("smoke: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
