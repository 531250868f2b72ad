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


def test_topk_kernel_methods_change_only_the_kernel_choice():
    bench = _load_bench()
    before = bench.vocab_ops.kernel_config("fwd_topk")
    for name, gluon in (("ours+top20/triton", False), ("ours+top20/gluon", True)):
        (method,) = bench.make_methods([name], [])
        # set_config also spells out its defaults for flags the config leaves unset: compare
        # the config's own keys.
        cfg = method.cfg["fwd_topk"]
        assert {key: cfg[key] for key in before} == dict(before, pingpong=gluon)
        seen = method._with_cfg(lambda: bench.vocab_ops.kernel_config("fwd_topk"))
        assert {key: seen[key] for key in before} == dict(before, pingpong=gluon)
        assert bench.vocab_ops.kernel_config("fwd_topk")["pingpong"] == before["pingpong"]


def test_round_robin_runs_each_once_per_round_in_varying_order():
    bench = _load_bench()
    calls = []
    fns = {name: (lambda n=name: calls.append(n)) for name in "abcde"}
    ms, ratio = bench.time_round_robin(fns, torch.device("cpu"), reps=6, warmup=0, unit="a")
    rounds = [calls[i : i + 5] for i in range(0, 30, 5)]
    assert all(sorted(r) == list("abcde") for r in rounds)
    # A fixed order would give each call the same neighbour every round.
    assert len({tuple(r) for r in rounds}) > 1
    assert set(ms) == set("abcde") and ratio["a"] == 1.0


def test_cublas_floor_gradients_are_the_plain_products():
    bench = _load_bench()
    (floor,) = bench.make_methods(["cublas-floor"], [])
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(33, 16, generator=gen)
    w = torch.randn(70, 16, generator=gen)
    gh, gw = floor.train(h, w, None, None, None)
    logits = h @ w.t()
    assert torch.allclose(gh, logits @ w, atol=1e-4) and torch.allclose(
        gw, logits.t() @ h, atol=1e-4
    )


def test_gemm_repeat_runs_the_unit_four_times(monkeypatch):
    bench = _load_bench()
    (rep,) = bench.make_methods(["gemm-x4"], [])
    h, w = torch.randn(8, 4), torch.randn(6, 4)
    calls = []
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: calls.append(1) or real(a, b))
    assert torch.equal(rep.forward(h, w, None), real(h, w.t())) and len(calls) == 1
    out, grad_w = rep.train(h, w, None, None, None)
    assert len(calls) == 5 and torch.equal(out, real(h, w.t())) and grad_w.shape == w.shape
