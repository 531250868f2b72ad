"""Keeps benchmarks/bench_head.py runnable and its error columns meaningful (tiny, on CPU)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_head.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_head", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_head_cpu_smoke():
    bench = _load_bench()
    methods = bench.make_methods(["ours", "ours+top20", "naive"], [])
    res = bench.bench_shape(40, 97, 32, methods, torch.device("cpu"), reps=1, warmup=0)
    ours, top, naive = (res["methods"][k] for k in ("ours", "ours+top20", "naive"))
    assert "error" not in ours and "error" not in top and "error" not in naive
    assert ours["lp_err64"] < 5e-6 and top["top_err64"] < 5e-6 and top["top_ids_exact"]
    # The naive bf16 logits are visibly worse: the error column can tell the two apart.
    assert naive["lp_err64"] > 100 * ours["lp_err64"]
    assert ours["dw_vs_naive"] <= 1.1 and ours["dh_vs_naive"] <= 1.1
    assert "| ours |" in bench.markdown([res])
    # Both timings are reported (on CPU the "queued" one has no GPU lead to hide behind).
    assert ours["fwd_gemms_queued"] > 0 and top["train_gemms_queued"] > 0
