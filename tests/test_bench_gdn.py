"""Keeps benchmarks/mixers/bench_gdn.py runnable (tiny, on CPU) and its pieces the module's own."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import _megatron_cpu as mc
import pytest
from _dist import run_distributed

pytest.importorskip("fla", reason="megatron-core builds GatedDeltaNet only with fla installed")

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "mixers" / "bench_gdn.py"


def _smoke(rank, world_size):
    mc.init_parallel(1, 1)
    spec = importlib.util.spec_from_file_location("bench_gdn", _SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    argv = "--seq-len 40 --hidden 16 --key-heads 2 --value-heads 4 --head-dim 8 --reps 1"
    ms = bench.main(argv.split() + ["--warmup", "0", "--device", "cpu", "--dtype", "float32"])
    plan = bench.uneven_plan(40, 2, 0.55)
    return ms, plan.counts


def test_bench_gdn_cpu_smoke():
    ((ms, counts),) = run_distributed(_smoke, 1)
    assert ms["local_rows"] == counts[0] == 22 and ms["owned_rows"] == 40
    for key in ("reorders", "rule_and_conv", "mixing", "projections", "tables_host"):
        assert ms[key] > 0, key
    # How the pieces add up (their signs are noise at one rep on a CPU: the package's convolution
    # and norm are the same work as the rows' there, so "added" is the reorders plus noise).
    assert ms["layer"] == pytest.approx(ms["added"] + ms["mixing"] + ms["projections"])
    assert ms["overhead_of_layer"] == pytest.approx(ms["added"] / ms["layer"])
