# The two commands of the README: `make demo` and `make test`. Both create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch. On a GPU machine, install the torch build for your CUDA first and use
# `pip install -e '.[s3]'` directly (see README).
TORCH ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[s3,test]'
	touch $@

.PHONY: demo test lint bench
demo: $(VENV)/.installed
	$(VENV)/bin/fleetgen demo --output demo-output

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) bench/overhead.py
