"""Keeps benchmarks/models/bench_tree.py runnable as users run it: tiny, on CPU, own process.

As in ``test_benchmarks.py`` the script is started with ``PYTHONPATH`` at the repository root
and judged by its exit status and what it writes (``bench_tree.json`` and ``bench_tree.md``).
The tiny model's numbers mean nothing; what is checked is that every row is there and that the
tree and flat packings of the same samples give the same completion log-probs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_BATCHES = ("12+3x4", "16+4x3")


def _run(args, timeout=600):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, *args], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def test_bench_tree_tiny_on_cpu(tmp_path):
    # megatron-core builds GatedDeltaNet layers only with fla installed.
    hybrid = importlib.util.find_spec("fla") is not None
    args = ["benchmarks/models/bench_tree.py", "--tiny", "--batches", ",".join(_BATCHES)]
    args += ["--out", str(tmp_path)] + ([] if hybrid else ["--no-hybrid"])
    _run(args)
    results = json.loads((tmp_path / "bench_tree.json").read_text())
    models = ["GPT"] + (["hybrid G-*-"] if hybrid else [])

    rows = {(r["model"], r["batch"], r["packing"]): r for r in results["model"]}
    assert set(rows) == {(m, b, p) for m in models for b in _BATCHES for p in ("tree", "flat")}
    for model in models:
        for name in _BATCHES:
            prompt, rest = name.split("+")
            group, completion = (int(x) for x in rest.split("x"))
            tree, flat = rows[(model, name, "tree")], rows[(model, name, "flat")]
            assert tree["tokens"] == int(prompt) + group * completion
            assert flat["tokens"] == group * (int(prompt) + completion)
            assert tree["micro-batches"] == 1 and flat["micro-batches"] >= 1
            assert tree["fwd+bwd ms"] > 0 and flat["fwd+bwd ms"] > 0
            assert tree["tokens / flat"] == tree["tokens"] / flat["tokens"]
            assert isinstance(tree["pass"], bool)

    # Same samples, same weights: the CPU path gives tree and flat the same log-probs, and the
    # one-step perturbation of the embedding gives a non-zero noise scale.
    assert len(results["logprobs"]) == len(models) * len(_BATCHES)
    for lp in results["logprobs"]:
        assert lp["tree vs flat max"] <= 1e-6, lp
        assert lp["noise max"] > 0 and lp["pass"] is True, lp

    attention = results["attention"]
    assert [r["batch"] for r in attention] == list(_BATCHES)
    for row in attention:
        assert row["attention"] == "dense" and row["max err vs fp32"] < 0.05, row
        s = row["S"]
        prompt = int(row["batch"].split("+")[0])
        group, completion = (int(x) for x in row["batch"].split("+")[1].split("x"))
        pairs = prompt * (prompt + 1) // 2
        pairs += group * (completion * prompt + completion * (completion + 1) // 2)
        assert row["visible pairs"] == pairs and row["floor L"] == s

    if hybrid:
        assert [r["batch"] for r in results["gdn"]] == list(_BATCHES)
        for row in results["gdn"]:
            assert row["GDN fwd ms tree"] > 0 and row["GDN fwd+bwd ms flat"] > 0
            assert row["state exchange share of the layer"].startswith("n/a at CP 1")

    # Balance at the real GRPO sizes (host only): the default plan beats contiguous blocks on
    # attention work at every CP size, and both hold tokens within a block of even.
    balance = {(r["batch"], r["CP"], r["plan"]): r for r in results["balance"]}
    for batch in ("4096+8x1024", "16384+16x512"):
        for cp in (2, 4, 8):
            ours, blocks = balance[(batch, cp, "tree_plan")], balance[(batch, cp, "contiguous")]
            assert ours["work max/mean"] < blocks["work max/mean"]
            assert ours["tokens max/mean"] < 1.05

    table = (tmp_path / "bench_tree.md").read_text()
    for heading in ("## Model step", "## Completion log-probs", "## Tree attention", "## Balance"):
        assert heading in table
    assert "| GPT | 12+3x4 | tree |" in table
