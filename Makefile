# Every target first installs what it needs into .venv with scripts/install_dev.sh, the one
# install recipe. CI (.ci/run, on a fresh clone) runs: make install lint check-kernels test
.PHONY: install demo lint check-kernels test

install:
	bash scripts/install_dev.sh

# The main job: a small GPTModel at CP 1, 2 and 4 on gloo ranks, outputs compared with CP 1,
# and the seed's probe hidden_states[1:][mask].
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
