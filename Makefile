# The two commands of the README: `make demo` and `make test` (and `make test-fast`, `make docs`). Each creates
# .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build of torch, from PyTorch's CPU wheel index: on Linux, PyPI's torch is the multi-GB CUDA
# build. On a GPU machine, install the torch build for your CUDA first and use `pip install -e '.[s3]'`
# directly (see README). Few retries: where that index cannot be reached (an offline mirror that has
# the wheel), pip goes on with the other indexes it is configured with at once.
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --retries 1 --timeout 15 --index-url $(TORCH_INDEX) "$(TORCH)"
	$(PY) -m pip install -q -e '.[s3,gcs,azure,test,docs]'
	touch $@

# Azurite, Microsoft's Azure Storage emulator, for the tests' az:// store (tests/stores.py); needs node (18 or
# newer) and npm, which `make test` asks for by name where they are missing.
AZURITE_VERSION ?= 3.37.0
AZURITE := .cache/azurite/node_modules/.bin/azurite-blob
$(AZURITE):
	@command -v npm >/dev/null || { echo "make test needs node and npm for Azurite (the Azure emulator): apt-get install nodejs npm, or https://nodejs.org"; exit 2; }
	npm install --silent --no-audit --no-fund --prefix .cache/azurite azurite@$(AZURITE_VERSION)
azurite: $(AZURITE)

.PHONY: demo test test-fast test-ray docs lint bench gpu-check gpu-check-dry gpu-wheelhouse azurite
demo: $(VENV)/.installed
	$(VENV)/bin/fleetgen demo --output demo-output

# Everything: the README's test command (CI runs it). Markers: tests/conftest.py.
test: $(VENV)/.installed $(AZURITE)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

# The inner loop: no Ray, no extra clusters, no chaos, nothing slow (under 2 minutes on 2 cores). Needs no
# npm: without Azurite the Azure tests skip, saying why.
test-fast: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 -m "not ray and not cluster and not chaos and not slow"

# The Ray lane alone: the tests on the session's local Ray and those that start Ray heads of their own.
test-ray: $(VENV)/.installed $(AZURITE)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "ray or cluster" --durations=15

# The docs site: the reference pages rendered from the code's tables, then mkdocs with warnings as errors.
docs: $(VENV)/.installed
	$(PY) -m fleetgen.jobs.reference docs/reference
	$(VENV)/bin/mkdocs build --strict --quiet
	@echo "site/index.html"

bench: $(VENV)/.installed
	$(PY) bench/overhead.py

# The GPU check (bench/gpu_check.py). On a CUDA machine with torch: `make gpu-check` (with the
# overlay from `make gpu-wheelhouse` on PYTHONPATH where diffusers & co. are missing; see README).
PYTHON ?= python3
GPU_PYTHON ?= 3.12
gpu-check:
	$(PYTHON) bench/gpu_check.py --json $${OUT:-.}/gpu-check.json

gpu-check-dry: $(VENV)/.installed
	$(PY) bench/gpu_check.py --dry --json gpu-check-dry.json

gpu-wheelhouse: $(VENV)/.installed
	$(PY) bench/gpu_wheelhouse.py --python $(GPU_PYTHON) --out gpu-overlay.tar.xz
