# `make demo` and `make test` each build what they need into .venv on a fresh machine.
# torch: a CPU build (torch==2.13.0) unless a GPU is present; override with TORCH_SPEC=...
# Every other package at the version in constraints.txt (the environment the suite was green in).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
STAMP := $(VENV)/.installed-$(shell echo "$(TORCH_SPEC)" | tr -c 'a-zA-Z0-9.\n' _)
DEMO_ARGS ?=

.PHONY: demo test test-gpu bench figures clean install

$(STAMP): pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,data]"
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
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e ".[bench]"
	$(PY) -m benchmarks.attention.run

figures: $(STAMP)  # redraw paper_figures/ from the committed results (never trains)
	$(PY) scripts/figures.py

clean:
	rm -rf $(VENV) lightning_logs runs .pytest_cache
