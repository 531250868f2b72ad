"""Build and install ``megatron-context-parallel``.

Python 3.12 or later: megatron-core 0.19.2, which this package needs, declares Requires-Python
>= 3.12, so ``python_requires`` says the same (``make check-user-install`` installs into a fresh
3.12 venv and checks that 3.11 is refused). Three ways in:

    pip install .                                  # a fresh environment: pip brings torch,
    pip install ".[attention]"                     #   megatron-core (and the cuDNN frontend)
    pip install --no-build-isolation ".[attention]"    # over the torch you have

A plain ``pip install .`` builds in pip's isolated build environment, which has no torch: the
result is the pure-Python install (both compiled parts below fall back to torch). Installing
with ``--no-build-isolation`` into an environment that already has torch (and setuptools and
wheel, and a C++ compiler; nvcc and ``CUDA_HOME`` for the kernels) builds them against that
torch. The development checkouts and CI (Python 3.11 machines) install with
``scripts/install_dev.sh``, through ``docker/install.sh``, which below 3.12 adds
``--ignore-requires-python`` (megatron-core runs on 3.11; only its metadata asks for 3.12).

Two compiled parts, each with a torch fallback at run time:

* The CUDA row kernels (``csrc/*.cu``) are built into ``megatron.context_parallel._C`` when the
  toolchain allows it: torch was built with CUDA and ``nvcc`` is found (``CUDA_HOME`` or
  ``PATH``). Whether a GPU is visible does not matter, so a Docker build without GPUs still
  builds the kernels. Otherwise CUDA tensors fall back to torch indexing (with one warning).
* The attention's host table builders (``csrc/host/``, plain C++ on CPU tensors) are built into
  ``megatron.context_parallel._host`` whenever torch imports (CPU builds too). Without them the
  tables are built by torch ops, about 10-40x slower.

Environment variables (on/off ones follow megatron/context_parallel/_env.py: 1/true/yes/on
or 0/false/no/off/empty, anything else is an error):
    MCP_FORCE_CUDA_BUILD=1: build the extension or fail (no silent pure-Python install).
    MCP_SKIP_CUDA_BUILD=1: build neither part (pure-Python install). Setting both is an error.
    TORCH_CUDA_ARCH_LIST: target architectures, default "9.0" (Hopper: H100, H200).
    MAX_JOBS: parallel compile jobs (read by torch's build helper).

Both libraries are linked against the shared libstdc++.so whatever the compiler's default
(megatron/context_parallel/_linkage.py says why: a static C++ runtime turns a failing
TORCH_CHECK into a segfault), and the build fails, naming the fix, if the result still lacks it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys

from setuptools import find_namespace_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
EXT_NAME = "megatron.context_parallel._C"
HOST_EXT_NAME = "megatron.context_parallel._host"
DEFAULT_ARCH_LIST = "9.0"


def _load_by_path(name: str):
    """The package's module ``name``, loaded by path: the package is not importable yet."""
    path = os.path.join(ROOT, "megatron", "context_parallel", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_megatron_cp{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


env_flag = _load_by_path("_env").env_flag
linkage = _load_by_path("_linkage")


def _find_nvcc(cuda_home):
    if cuda_home:
        candidate = os.path.join(cuda_home, "bin", "nvcc")
        if os.path.exists(candidate):
            return candidate
    return shutil.which("nvcc")


def _cuda_build_decision():
    """``(build, reason, details)``: whether to build the extension, judged from the toolchain."""
    skip = env_flag("MCP_SKIP_CUDA_BUILD")
    force = env_flag("MCP_FORCE_CUDA_BUILD")
    if skip and force:
        raise ValueError("MCP_SKIP_CUDA_BUILD and MCP_FORCE_CUDA_BUILD are both on; pick one")
    if skip:
        return False, "MCP_SKIP_CUDA_BUILD is set", {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as exc:
        if force:
            raise RuntimeError(
                f"MCP_FORCE_CUDA_BUILD is set but torch is not importable: {exc}"
            ) from exc
        return False, "torch is not importable (use --no-build-isolation)", {}
    details = {"torch": torch.__version__, "torch CUDA": torch.version.cuda}
    nvcc = _find_nvcc(cpp_extension.CUDA_HOME)
    details["nvcc"] = nvcc
    if torch.version.cuda is None:
        reason = "torch was built without CUDA"
    elif nvcc is None:
        reason = "nvcc not found (set CUDA_HOME)"
    else:
        return True, "torch has CUDA and nvcc is found", details
    if force:
        raise RuntimeError(f"MCP_FORCE_CUDA_BUILD is set but {reason}")
    return False, reason, details


def _host_build_decision() -> bool:
    """Whether to build the host table builders: torch imports and no pure-Python install."""
    if env_flag("MCP_SKIP_CUDA_BUILD"):
        return False
    return importlib.util.find_spec("torch") is not None


def _extensions(build: bool, host: bool):
    if not (build or host):
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    exts = []
    if build:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        exts.append(
            CUDAExtension(
                name=EXT_NAME,
                sources=["csrc/binding.cpp", "csrc/row_copy.cu"],
                include_dirs=[os.path.join(ROOT, "csrc")],
                extra_compile_args={
                    "cxx": ["-O3"],
                    "nvcc": ["-O3"],
                },
                extra_link_args=linkage.LINK_ARGS,
            )
        )
    if host:
        exts.append(
            CppExtension(
                name=HOST_EXT_NAME,
                sources=["csrc/host/attention_tables.cpp"],
                extra_compile_args=["-O3"],
                extra_link_args=linkage.LINK_ARGS,
            )
        )

    class CheckedBuildExtension(BuildExtension):
        """torch's ``BuildExtension``, refusing a library that lacks the shared libstdc++."""

        def build_extension(self, extension):
            super().build_extension(extension)
            path = self.get_ext_fullpath(extension.name)
            try:
                linkage.check_shared_runtime(path)
            except RuntimeError:
                os.remove(path)  # never leave a library behind that crashes on a bad call
                raise

    return exts, {"build_ext": CheckedBuildExtension}


def _summary(build: bool, reason: str, details: dict, host: bool) -> None:
    lines = ["", "megatron-context-parallel build summary"]
    lines.append(f"  CUDA extension {EXT_NAME}: {'BUILD' if build else 'skipped'} ({reason})")
    lines.append(f"  host tables {HOST_EXT_NAME}: {'BUILD' if host else 'skipped'}")
    for key, value in details.items():
        lines.append(f"  {key}: {value}")
    if build:
        lines.append(f"  TORCH_CUDA_ARCH_LIST: {os.environ.get('TORCH_CUDA_ARCH_LIST')}")
    if build or host:
        lines.append(f"  CXX: {os.environ.get('CXX', '(default)')}, links {linkage.LINK_ARGS}")
    lines.append("")
    print("\n".join(lines), file=sys.stderr)


def _wants_build() -> bool:
    # Metadata-only commands (egg_info, dist_info, --version) need no compiler decision.
    build_cmds = {"build", "build_ext", "install", "develop", "bdist_wheel", "editable_wheel"}
    return any(arg in build_cmds for arg in sys.argv[1:])


if _wants_build():
    BUILD, REASON, DETAILS = _cuda_build_decision()
    HOST = _host_build_decision()
    _summary(BUILD, REASON, DETAILS, HOST)
else:
    BUILD = HOST = False
EXT_MODULES, CMDCLASS = _extensions(BUILD, HOST)

setup(
    name="megatron-context-parallel",
    version="0.1.0",
    description="Context parallelism for megatron-core that returns full-sequence outputs",
    packages=find_namespace_packages(include=["megatron.context_parallel*"]),
    # What megatron-core 0.19.2 declares; the 3.11 development path ignores it on purpose.
    python_requires=">=3.12",
    install_requires=["torch>=2.6", "megatron-core>=0.19.2", "numpy"],
    # The fused attention on GPUs (cuDNN's varlen attention through its Python frontend);
    # without it ContextParallelAttention runs the dense computation. CPU installs need none.
    extras_require={"attention": ["nvidia-cudnn-frontend==1.32.0"]},
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
    zip_safe=False,
)
