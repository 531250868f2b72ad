#!/usr/bin/env bash
# The one development install: .venv with everything the demo, the tests and CI need, on a fresh
# machine with Python 3.11 or later. `make install` runs it, and every other make target (so CI,
# .ci/run) runs that first.
#
# 1. .venv with requirements-dev.txt: the pinned CPU torch, the test and style tools, hadolint,
#    and the few packages megatron-core imports (numpy, packaging, triton).
# 2. docker/install.sh --editable into it, the script the Docker image installs with:
#    megatron-core 0.19.2 without its dependency list (which would pull a CUDA torch; it also
#    declares Requires-Python >= 3.12 but runs on 3.11), then this package without build
#    isolation (built against the venv's torch, with the CUDA kernels when torch has CUDA and
#    nvcc is found), failing if torch changed on the way.
#
# PYTHON picks the interpreter (default python3). A re-run does nothing until
# requirements-dev.txt, setup.py or docker/install.sh changes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.installed
if [[ -f $stamp && $stamp -nt requirements-dev.txt && $stamp -nt setup.py &&
  $stamp -nt docker/install.sh ]]; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-dev.txt
bash docker/install.sh --python .venv/bin/python --editable
touch "$stamp"
