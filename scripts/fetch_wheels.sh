#!/usr/bin/env bash
# The pure-Python wheels a device call carries in .whl (git-ignored, so a fresh checkout has
# none): the head benchmark's peers (liger-kernel, cut-cross-entropy) and pytest-xdist for the
# GPU tests. The GPU machine reaches no index: download here, then `run` with carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps -d .whl \
  liger-kernel==0.8.5 cut-cross-entropy==25.1.1 pytest-xdist==3.8.0 execnet==2.1.2
ls .whl
