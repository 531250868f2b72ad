#!/usr/bin/env bash
# The wheels a device call carries in .whl (git-ignored, so a fresh checkout has none; the GPU
# machine reaches no index: download here, then `run` with carry [".whl"] and
# `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`):
#   - the head benchmark's peers (liger-kernel, cut-cross-entropy);
#   - the fused attention's cuDNN frontend (setup.py's `attention` extra) and megatron-core, both
#     built for the GPU machine's Python 3.12;
#   - fla-core and einops for the Gated DeltaNet tests and benchmark;
#   - pytest-xdist / execnet and hypothesis (with its dependencies) for the GPU tests.
# About 30 MB in all, under the 64 MiB carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
py312=(--python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all:)
python3 -m pip download -q --no-deps -d .whl "${py312[@]}" \
  nvidia-cudnn-frontend==1.32.0 megatron-core==0.19.2 hypothesis
python3 -m pip download -q --no-deps -d .whl \
  liger-kernel==0.8.5 cut-cross-entropy==25.1.1 pytest-xdist==3.8.0 execnet==2.1.2 \
  fla-core==0.6.0 einops tqdm sortedcontainers attrs
ls .whl
du -sh .whl
