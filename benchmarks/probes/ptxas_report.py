"""Registers, spills and shared memory of the Gluon head kernels for Hopper, without a GPU.

Each kernel is compiled for sm_90a through the installed Triton with the arguments its launcher
builds (``head.vocab_gluon.compile_only``; ``tests/_gluon_target.py`` stands in for the
device), then assembled by the ptxas that ships with Triton (``-v``). Spills in a consumer
partition cost the epilogue local-memory traffic; this is how the top-k kernel came to keep its
running top-k in shared memory. Use the Triton version of the GPU machine (3.6 there): spills
differ between versions.

    PYTHONPATH=$PWD python3 benchmarks/probes/ptxas_report.py [--k 1,5,20,32,64]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.nvidia.compiler import get_ptxas

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

from _gluon_target import hopper_target  # noqa: E402

from megatron.context_parallel.head import vocab_gluon as gluon  # noqa: E402


def assemble(compiled) -> dict:
    """ptxas -v on the compiled PTX: registers, spill stores / loads (bytes), shared memory."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        out = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    regs = re.search(r"Used (\d+) registers", out)
    return dict(
        regs=int(regs.group(1)),
        spill_st=int(spills.group(1)),
        spill_ld=int(spills.group(2)),
        smem=compiled.metadata.shared,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", default="1,5,20,32,64", help="top-k sizes to compile")
    args = parser.parse_args(argv)
    rows = []
    with hopper_target():
        for dtype in (torch.bfloat16, torch.float16):
            name = str(dtype).split(".")[-1]
            for kernel, label in (("stats", "stats"), ("dlogits", "d_logits")):
                compiled = gluon.compile_only(kernel, dtype, "cpu")
                rows.append((f"{label}, {name}", assemble(compiled)))
        for label, cfg in (
            ("top-k 64 x 256 (configured)", gluon.TOPK_CONFIG),
            ("top-k 128 x 128", dict(gluon.TOPK_CONFIG, BM=128, BN=128, GROUP=8)),
        ):
            for k in map(int, args.k.split(",")):
                compiled = gluon.compile_only("topk", torch.bfloat16, "cpu", k, cfg=cfg)
                rows.append((f"{label}, k = {k}, bfloat16", assemble(compiled)))
    print(f"# Gluon kernels for sm_90a, Triton {triton.__version__}\n")
    print("| kernel | registers (cap) | spill stores / loads (bytes) | shared memory (KiB) |")
    print("|---|---:|---:|---:|")
    for label, r in rows:
        smem = r["smem"] / 1024
        print(f"| {label} | {r['regs']} | {r['spill_st']} / {r['spill_ld']} | {smem:.1f} |")


if __name__ == "__main__":
    main()
