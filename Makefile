# Two entry points, each installing what it needs into .venv first (scripts/install_dev.sh).
.PHONY: demo test install

install:
	bash scripts/install_dev.sh

demo: install
	.venv/bin/python examples/gather_demo.py

test: install
	.venv/bin/python -m pytest -q -ra --timeout=900
