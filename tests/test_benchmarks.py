"""The benchmark scripts still run, as their users run them: in their own processes, tiny, on CPU.

Tests do not import benchmark code; each script is started with ``PYTHONPATH`` at the repository
root and judged by its exit status and what it writes. What the benchmarks measure of the
library (exact gathers, logit precision) is tested by the library's own tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(args, timeout=600):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, *args], cwd=_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.parametrize("ranks", [2, 3])
def test_bench_gather_check_only(ranks):
    # --check-only compares every peer approach with ours and with the full tensors the shards
    # were cut from, on every payload; it exits non-zero on any difference.
    out = _run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            "benchmarks/bench_gather.py",
            "--device",
            "cpu",
            "--check-only",
            "--scale",
            "400",
        ]
    )
    assert "all approaches equal ours and the reference on" in out and f"at CP {ranks}" in out


def test_bench_head_cpu_smoke(tmp_path):
    _run(
        [
            "benchmarks/bench_head.py",
            "--device",
            "cpu",
            "--shapes",
            "40x97",
            "--hidden",
            "32",
            "--methods",
            "ours,ours+top20,naive",
            "--reps",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    (result,) = json.loads((tmp_path / "bench_head.json").read_text())["results"]
    ours, top, naive = (result["methods"][k] for k in ("ours", "ours+top20", "naive"))
    assert not any("error" in m for m in (ours, top, naive)), result["methods"]
    # The error columns tell an fp32-logit head from the naive bf16 one.
    assert ours["lp_err64"] < 5e-6 and top["top_ids_exact"]
    assert naive["lp_err64"] > 100 * ours["lp_err64"]
    assert "| ours |" in (tmp_path / "bench_head.md").read_text()


def test_probe_build_policy_replays_graph_builds_on_the_cpu():
    # The replay counts the cuDNN graphs random plans' tables would build: the default policy
    # (powers of two, reuse within 2x) must build fewer than fine sizes without reuse.
    out = _run(["benchmarks/probes/probe_build_policy.py", "--sets", "1", "--policies", "16:1,1:2"])
    rows = {
        line.split("|")[1].strip(): int(line.split("|")[2])
        for line in out.splitlines()
        if line.startswith("| 1")
    }
    assert set(rows) == {"16:1", "1:2"} and 0 < rows["1:2"] < rows["16:1"], out
