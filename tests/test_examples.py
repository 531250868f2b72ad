"""Every example runs on the CPU at a small size, as a user would start it, and says it passed.

Each example is a subprocess started exactly as the README says (it forks its own gloo ranks).
The assertions read its output: the verdict line, and the numbers in its table, so an example
that printed "PASSED" over wrong numbers would still fail here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _run(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("RANK", None)  # never join an outer job: the example starts its own ranks
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def _table(stdout: str, first_header: str) -> list:
    """Rows (lists of cells) of the whitespace-aligned table whose header starts with a word."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_header])
    rows = []
    for line in lines[start + 1 :]:
        cells = line.split()
        if not cells or not cells[0].isdigit():
            break
        rows.append(cells)
    return rows


@pytest.mark.slow
def test_cp_probe_matches_cp1_at_cp2_and_cp4():
    result = _run("cp_probe.py", "--cp-sizes", "1,2,4", "--world-size", "4", "--iters", "1")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    rows = _table(out, "CP")
    # CP 1, then the default and an uneven plan at CP 2 and at CP 4.
    assert [(r[0], r[2]) for r in rows] == [
        ("1", "whole"),
        ("2", "thd"),
        ("2", "uneven"),
        ("4", "thd"),
        ("4", "uneven"),
    ], out
    for r in rows:
        counts = [int(c) for c in r[3].split("/")]
        assert len(counts) == int(r[0]) and sum(counts) == 200, r
        if r[2] == "uneven":
            assert len(set(counts)) == len(counts), r  # every shard a different size
        diffs = [float(x) for x in r[4:9]]  # 4 fields + the report probe
        assert all(d <= 1e-4 for d in diffs), r
        assert float(r[9].replace(",", "")) > 0
    probe = re.search(
        r"report probe: output\.hidden_states\[1:\]\[mask\].*\[199\] -> \((\d+), 64\)"
        r" at CP 1, 2, 4: passed",
        out,
    )
    assert probe, out
    assert int(probe.group(1)) == 200 - 3 * 8 - 3  # minus prompts and sequence ends
    assert "cp_probe: PASSED" in out


def test_cp_probe_verdict_fails_on_a_difference_or_a_probe_shape(capsys, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    import cp_probe

    def row(cp, diffs, shape=(173, 64)):
        return dict(
            cp=cp,
            dp=4 // cp,
            plan="thd",
            counts=(200 // cp,) * cp,
            diffs=diffs,
            id_swaps=0,
            tokens_per_s=1.0,
            probe_shape=shape,
        )

    good = [row(1, [0.0] * 5), row(2, [1e-6] * 5)]
    assert cp_probe.report(good, 1e-4, 200) is True
    assert "cp_probe: PASSED" in capsys.readouterr().out
    for bad in (
        [row(1, [0.0] * 5), row(2, [1e-6, 1e-6, 1e-6, 3e-3, 1e-6])],  # logits off
        [row(1, [0.0] * 5), row(2, [1e-6] * 4 + [float("nan")])],  # probe NaN
        [row(1, [0.0] * 5), row(2, [1e-6] * 5, shape=(86, 64))],  # probe on a shard
    ):
        assert cp_probe.report(bad, 1e-4, 200) is False
        out = capsys.readouterr().out
        assert "cp_probe: FAILED" in out


@pytest.mark.slow
def test_train_dp2_cp2_matches_cp1_and_plots(tmp_path):
    png = tmp_path / "loss.png"
    args = ["--dp", "2", "--cp", "2", "--steps", "2"]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(png)]
    except ImportError:
        png = None
    result = _run("train_gpt_cp.py", *args)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    rows = _table(out, "step")
    assert [r[0] for r in rows] == ["1", "2"], out
    for r in rows:
        ref, cp, diff = float(r[1]), float(r[2]), float(r[3])
        assert abs(ref - cp) <= 1e-5 and diff <= 1e-5, r
        assert 0 < ref < 10, r  # a real cross-entropy for a 128-token vocabulary
    assert float(rows[1][1]) < float(rows[0][1]), out  # the step did train
    assert "train_gpt_cp: PASSED" in out
    # The progress bar reaches its end for both runs (stderr: not a terminal, one line a step).
    assert "CP 1" in result.stderr and "DP2 x CP2" in result.stderr
    assert "2/2" in result.stderr
    if png is not None:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _pretrain_rows(out: str) -> list:
    rows = _table(out, "iter")
    for r in rows:
        ref, cp, diff = float(r[1]), float(r[2]), float(r[3])
        assert abs(ref - cp) <= 1e-5 and diff <= 1e-5, r
        assert 0 < ref < 10, r  # a real cross-entropy for a 128-token vocabulary
    return rows


@pytest.mark.slow
def test_grpo_tree_at_cp2_matches_flat_packing():
    result = _run("grpo_tree_cp.py", "--cp", "2", "--steps", "2")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    samples = re.findall(r"sample +\d+: +(-?[\d.]+) +(-?[\d.]+)", out)
    assert len(samples) == 8, out  # 2 prompts x 4 completions, as the flat sample has them
    for flat, tree in samples:
        assert abs(float(flat) - float(tree)) <= 1e-4, (flat, tree)
        assert -10 < float(flat) < 0, flat  # a real mean log-prob over a 128-token vocabulary
    rows = _table(out, "step")
    assert [r[0] for r in rows] == ["1", "2"], out
    for r in rows:
        assert abs(float(r[1]) - float(r[2])) <= 1e-4, r
    match = re.search(r"tokens per step: tree (\d+), flat (\d+)", out)
    assert match and int(match.group(1)) < int(match.group(2)), out
    assert "grpo_tree_cp: PASSED" in out


@pytest.mark.slow
def test_pretrain_pp2_cp2_matches_cp1_and_plots(tmp_path):
    png = tmp_path / "loss.png"
    args = ["--train-iters", "3"]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(png)]
    except ImportError:
        png = None
    result = _run("pretrain_gpt_cp.py", *args)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "4 ranks on cpu (gloo)" in out and "tied embeddings" in out, out
    rows = _pretrain_rows(out)
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    assert float(rows[-1][1]) < float(rows[0][1]), out  # it trains
    assert "loss DP 1 x CP 2 x PP 2" in out
    assert "pretrain_gpt_cp: PASSED" in out
    # One progress bar per run on stderr, each reaching its end.
    assert "CP 1, DP 4" in result.stderr and "DP 1 x CP 2 x PP 2" in result.stderr
    assert "3/3" in result.stderr
    if png is not None:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags,layout",
    [
        (
            [
                "--pipeline-model-parallel-size",
                "1",
                "--use-distributed-optimizer",
                "--calculate-per-token-loss",
                "--cp-plan",
                "uneven",
            ],
            "DP 2 x CP 2 x PP 1",
        ),
        (
            [
                "--num-virtual-stages-per-pipeline-rank",
                "2",
                "--cp-plan",
                "uneven",
                "--untie-embeddings-and-output-weights",
                "--global-batch-size",
                "4",
            ],
            "DP 1 x CP 2 x PP 2 (VPP 2)",
        ),
    ],
    ids=["dp2-cp2-distributed-optimizer-per-token-uneven", "pp2-vpp2-cp2-uneven-untied"],
)
def test_pretrain_other_layouts_match_cp1(flags, layout):
    result = _run("pretrain_gpt_cp.py", "--train-iters", "2", *flags)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert f"loss {layout}" in out, out
    assert len(_pretrain_rows(out)) == 2, out
    assert "pretrain_gpt_cp: PASSED" in out


@pytest.mark.parametrize(
    "script,flag",
    [
        ("cp_probe", "--cp-sizes"),
        ("train_gpt_cp", "--plot"),
        ("pretrain_gpt_cp", "--context-parallel-size"),
    ],
)
def test_examples_document_their_options(script, flag, capsys, monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    module = __import__(script)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert flag in capsys.readouterr().out


def test_gather_demo_returns_source_order_on_uneven_shards():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "gather_demo.py"), "--cp", "3", "--seq-len", "23"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == 3
    assert all("exact" in line and "passed" in line for line in lines), result.stdout
    assert "gather_demo: PASSED" in result.stdout


def test_examples_never_import_from_tests():
    for name in os.listdir(EXAMPLES):
        if name.endswith(".py"):
            with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
                text = f.read()
            assert not re.search(
                r"^\s*(from|import)\s+(tests|_dist|_megatron_cpu)\b", text, re.MULTILINE
            ), name
