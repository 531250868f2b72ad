# Every target but check-user-install first installs what it needs into .venv with
# scripts/install_dev.sh, the one development install recipe. CI (.ci/run, on a fresh clone)
# runs: make install lint check-kernels test check-user-install
.PHONY: install demo lint check-kernels test check-user-install

install:
	bash scripts/install_dev.sh

# The main job: a small GPTModel at CP 1, 2 and 4 on gloo ranks, outputs compared with CP 1,
# and the bug report's probe hidden_states[1:][mask].
demo: install
	.venv/bin/python examples/cp_probe.py

# Style: ruff and black, configured in pyproject.toml, versions pinned in requirements-dev.txt.
lint: install
	.venv/bin/ruff check .
	.venv/bin/black --check -q .

# The torch-free CUDA kernels compile with this machine's nvcc for sm_90 (no GPU needed), and
# the torch binding passes a syntax check against the venv's torch headers.
check-kernels: install
	bash csrc/check_compile.sh .venv/bin/python

# The whole suite: multi-process gloo tests on the CPU; GPU tests skip without a GPU.
test: install
	.venv/bin/python -m pytest -q -ra --timeout=900

# A user's install, for real and apart from .venv: `pip install .` and ".[attention]" into a fresh
# Python 3.12 venv (pyenv's on CI machines), then the package run from there on the CPU; pip on
# 3.11 must refuse it (Requires-Python >= 3.12, as megatron-core's). Downloads ~3 GB from PyPI
# (a CUDA torch) and takes ~3-7 min; scripts/check_user_install.sh says what it checks.
check-user-install:
	bash scripts/check_user_install.sh
