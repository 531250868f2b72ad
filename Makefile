# Two entry points, each installing what it needs into .venv first (scripts/install_dev.sh).
.PHONY: demo test install

install:
	bash scripts/install_dev.sh

# The main job: a small GPTModel at CP 1, 2 and 4 on gloo ranks, outputs compared with CP 1,
# and the seed's probe hidden_states[1:][mask].
demo: install
	.venv/bin/python examples/cp_probe.py

test: install
	.venv/bin/python -m pytest -q -ra --timeout=900
