"""Keeps benchmarks/bench_gather.py honest: every peer approach it times must return exactly
what ours returns (and the full tensors the shards were cut from), on every payload it times.

Runs the benchmark's own correctness check at a tiny size on forked gloo ranks; no timing, no
matplotlib.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gather.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_gather", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    # dataclasses resolve string annotations through sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def _every_approach_equals_ours(rank, world_size, scale):
    names = bench.check_approaches(scale=scale)
    assert names == ["hidden_states", "target_logprobs", "top_k", "step_16x5"]
    # Tamper with one approach's output and make sure the check notices: it must be able to fail.
    payload = bench.make_payloads(world_size, scale)[1]
    setup = bench.Setup(payload, dist.group.WORLD, torch.device("cpu"))
    original = bench.RUNNERS["b_index_select"]
    bench.RUNNERS["b_index_select"] = lambda s: {
        k: torch.flip(v, dims=[0]) for k, v in original(s).items()
    }
    try:
        with pytest.raises(AssertionError, match="b_index_select differs from ours"):
            bench.check_setup(setup)
    finally:
        bench.RUNNERS["b_index_select"] = original


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_approach_equals_ours(world_size):
    run_distributed(_every_approach_equals_ours, world_size, 400.0)


def test_payload_shapes_follow_the_issue():
    payloads = {p.name: p for p in bench.make_payloads(2, 1.0, sweep=True)}
    assert payloads["hidden_states"].rows == 20_436
    assert payloads["hidden_states"].row_bytes == 5_120 * 2
    assert payloads["target_logprobs"].row_bytes == 4
    assert payloads["top_k"].row_bytes == 20 * 4 + 20 * 8
    step = payloads["step_16x5"]
    assert len(step.lengths) == 16 and len(step.fields) == 5
    assert all(n % 4 == 0 for n in step.lengths)
    # CP 4 needs lengths divisible by 8: 20,436 rounds up to 20,440.
    assert bench.make_payloads(4, 1.0)[0].rows == 20_440
    assert {"hidden_states/64", "hidden_states/16", "hidden_states/4"} <= set(payloads)
