# `make demo` and `make test` each build what they need into .venv on a fresh machine.
# torch: a CPU build (torch==2.13.0) unless a GPU is present; override with TORCH_SPEC=...
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
STAMP := $(VENV)/.installed-$(shell echo "$(TORCH_SPEC)" | tr -c 'a-zA-Z0-9.\n' _)
DEMO_ARGS ?=

.PHONY: demo test test-gpu bench figures clean install

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,data]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py $(DEMO_ARGS)

test: $(STAMP)
	$(VENV)/bin/lint-imports  # the layering contract in pyproject.toml [tool.importlinter]
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -m "not gpu" tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -ra -m gpu tests/gpu

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) scripts/bench_attention.py

clean:
	rm -rf $(VENV) lightning_logs runs .pytest_cache
