"""The benchmark scripts still run, as their users run them: in their own processes, tiny, on CPU.

Tests do not import benchmark code; each script is started with ``PYTHONPATH`` at the repository
root and judged by its exit status and what it writes. What the benchmarks measure of the
library (exact gathers, logit precision) is tested by the library's own tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
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
            "benchmarks/comm/bench_gather.py",
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
            "benchmarks/head/bench_head.py",
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


def test_probe_rectangles_reads_the_run_plans_on_the_cpu():
    # The rectangle model's table: a square entry computed as a triangle can only lower a plan's
    # work, and zigzag CP 2 (one square and one rectangle of equal rows) reads 1.25 and 1.12.
    out = _run(["benchmarks/probes/probe_rectangles.py", "--sizes", "4096"])
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    ratios = {r[0].strip(): (float(r[4]), float(r[5])) for r in rows[1:]}
    assert ratios["zigzag_cp2 r0"] == (1.25, 1.12), out
    assert all(apart <= whole for whole, apart in ratios.values()) and len(ratios) >= 4, out


def test_probe_table_host_times_the_host_share_on_the_cpu():
    # --cpu: one row per named case, both layouts among them, every time positive, and the
    # whole step's host share (build + on) at least the build's.
    out = _run(
        [
            "benchmarks/probes/probe_table_host.py", "--cpu", "--named", "--seq-len", "4096",
            "--reps", "3",
        ]
    )  # fmt: skip
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 6 and {r[1].strip() for r in rows} == {"runs", "blocks"}, out
    for row in rows:
        build, stage, staged_on, build_on = (float(c) for c in row[3:])
        assert min(build, stage, staged_on) > 0 and build_on >= build, out


def test_probe_backward_memory_models_the_peaks_on_the_cpu():
    # The modelled peak of the run tables and of the blocked layout, both positive and read.
    out = _run(
        [
            "benchmarks/probes/probe_backward_memory.py",
            "--size",
            "4096",
            "--cases",
            "zigzag_cp2,random_rows_cp2",
        ]
    )
    peaks = [
        float(line.split("modelled extra ")[1].split()[0])
        for line in out.splitlines()
        if "modelled extra " in line
    ]
    assert len(peaks) == 2 and all(p > 0 for p in peaks), out


def test_probe_backward_memory_counts_the_table_ops_of_a_prepared_batch():
    # on() and the first layer's derived tables each issue ops, the blocked layout's calls more;
    # with the backward's pieces staged ahead the first layer issues no more than without.
    args = ["--size", "4096", "--cases", "zigzag_cp2,random_rows_cp2", "--table-ops"]
    out = _run(["benchmarks/probes/probe_backward_memory.py", *args])
    cell = r"on\(\) (\d+) \((\d+)\), the first layer's (\d+) \((\d+)\)"
    rows = [
        [int(n) for n in found.groups()]
        for line in out.splitlines()
        if (
            found := re.search(
                f"staged ahead: {cell}; with the backward staged ahead: {cell}", line
            )
        )
    ]
    assert len(rows) == 2 and all(min(row) > 0 for row in rows), out
    for row in rows:
        assert row[1] <= row[0] and row[3] <= row[2] and row[7] <= row[3], out
    assert rows[1][3] > rows[0][3], out
    # GRPO trees take the same count (their tables' kernel calls in the tree's copy).
    args = ["--trees", "256+4x64", "--table-ops"]
    out = _run(["benchmarks/probes/probe_backward_memory.py", *args])
    assert re.search(f"grpo_256\\+4x64 CP1 S=512: tree tables: .*{cell}", out), out


def test_bench_attention_tables_only_on_the_cpu():
    # Every case's tables build and copy on the CPU, by the C++ builders and the torch ops: the
    # default cases, every named plan kind (issue 44) and the GRPO trees (tiny ones here).
    names = ("zigzag", "contiguous", "uneven", "THD", "random")
    out = _run(
        [
            "benchmarks/attention/bench_attention.py",
            "--tables-only",
            "--sizes",
            "4096",
            "--reps",
            "1",
            "--cases",
            ",".join(names),
            "--named",
            "--tree",
            "--tree-batches",
            "96+4x32,160+6x20",
        ]
    )
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    rows = {r[0].strip(): r for r in rows if r[0].strip() != "case"}
    named = (
        "zigzag_cp2",
        "packed_cut_1seq_cp4",
        "packed_cut_13seq_cp4",
        "thd_13seq_cp2",
        "block_shuffled_64_cp4",
        "random_rows_cp2",
    )
    for prefix in names + named + ("grpo_96+4x32", "grpo_160+6x20"):
        assert any(name.startswith(prefix) for name in rows), (prefix, out)
    layouts = {name.split()[0]: row[2].strip() for name, row in rows.items()}
    assert layouts["grpo_96+4x32"] == "treetables" and layouts["block_shuffled_64_cp4"] == "blocks"
    for name, row in rows.items():
        assert float(row[3]) > 0 and float(row[4]) > 0, (name, row)
