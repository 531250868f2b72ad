#!/usr/bin/env bash
# Creates .venv with everything the demo and the tests need, on a fresh Python 3.11 machine.
#
# megatron-core 0.19.2 declares Requires-Python >= 3.12 but runs on 3.11, so it is installed
# with --ignore-requires-python and --no-deps (its own dependency list would pull a CUDA torch);
# the few packages it needs at import time (numpy, packaging, triton) come from
# requirements-dev.txt. This package is installed editable without build isolation, so its
# setup.py sees the venv's torch instead of downloading another one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.installed
if [ -f "$stamp" ] && [ "$stamp" -nt requirements-dev.txt ] && [ "$stamp" -nt setup.py ]; then
    exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python -m pip install -q --no-deps --ignore-requires-python megatron-core==0.19.2
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
touch "$stamp"
