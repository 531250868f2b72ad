# Image for H200 (Hopper, sm_90) nodes: NGC PyTorch + megatron-core + megatron-context-parallel
# with its CUDA row kernels and its attention extra (the cuDNN frontend of the fused attention).
#
# Build (no GPU needed; the kernels compile with the base image's nvcc):
#   docker build -t megatron-cp .
#   docker build --build-arg BASE_TAG=25.12-py3 --build-arg MEGATRON_CORE_VERSION=0.19.2 -t megatron-cp .
# Run on a node:
#   docker run --gpus all --ipc=host --rm megatron-cp \
#     torchrun --nproc-per-node 8 examples/cp_probe.py
#
# BASE_TAG is an NGC PyTorch release (nvcr.io/nvidia/pytorch:<YY.MM>-py3) built on CUDA 13:
# releases 25.08 and later are. 25.12-py3 ships CUDA 13.1.0, PyTorch 2.10 and Python 3.12
# (megatron-core 0.19 needs Python >= 3.12), with TransformerEngine, apex and flash-attn.
# Those four come from the base image and are never reinstalled: docker/install.sh installs
# without dependencies and fails if any of their versions changes.
#
# Development checkouts and CI install with scripts/install_dev.sh (`make install`), which runs
# the same docker/install.sh into a .venv with the test tools.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch
ARG BASE_TAG=25.12-py3
FROM ${BASE_IMAGE}:${BASE_TAG}

# The megatron-core release this package is tested against (pyproject/setup.py require >= it).
ARG MEGATRON_CORE_VERSION=0.19.2

# Hopper only: one cubin for sm_90, no PTX for other chips. MCP_FORCE_CUDA_BUILD makes setup.py
# fail rather than fall back to a pure-Python install when the toolchain is missing.
ENV TORCH_CUDA_ARCH_LIST="9.0" \
    MCP_FORCE_CUDA_BUILD=1 \
    MAX_JOBS=8

WORKDIR /opt/megatron-context-parallel

COPY pyproject.toml setup.py ./
COPY csrc ./csrc
COPY megatron ./megatron
COPY docker ./docker
COPY examples ./examples

# --extras attention: the package's `attention` extra (setup.py names it: the cuDNN frontend),
# installed with its own dependencies while the base image's torch, TE, apex and flash-attn stay.
RUN bash docker/install.sh --megatron-core "megatron-core==${MEGATRON_CORE_VERSION}" --require-cuda \
    --extras attention

# Last step: the build fails unless the compiled extension loads (and, when the builder has a
# GPU, unless its kernels match the torch reference exactly). A step of its own on purpose, so a
# failing smoke test names itself in the build log.
# hadolint ignore=DL3059
RUN python docker/smoke.py --require-cuda --require-attention \
    --expect-megatron-core "${MEGATRON_CORE_VERSION}"
