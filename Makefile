# `make demo` and `make test` each build what they need into .venv on a fresh machine.
# torch: the CUDA build (PyPI's `torch`) on a GPU machine (nvidia-smi on the PATH, /proc/driver/nvidia, or
# CUDA_VISIBLE_DEVICES naming a device) or when asked (GPU=1), else the CPU build (torch==2.13.0); GPU=0 forces
# the CPU build, TORCH_SPEC=... picks any; the install prints which torch it installed.
# Every other package at the version in constraints.txt (the environment the suite was green in).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
GPU ?= $(shell { command -v nvidia-smi || test -e /proc/driver/nvidia || \
	{ test -n "$$CUDA_VISIBLE_DEVICES" && test "$$CUDA_VISIBLE_DEVICES" != "-1"; }; } >/dev/null 2>&1 && echo 1 || echo 0)
TORCH_SPEC ?= $(if $(filter 1,$(GPU)),torch,torch==2.13.0)
STAMP := $(VENV)/.installed-$(shell echo "$(TORCH_SPEC)" | tr -c 'a-zA-Z0-9.\n' _)
DEMO_ARGS ?=

.PHONY: demo test test-gpu bench figures clean install docs

$(STAMP): pyproject.toml Makefile constraints.txt
	$(PYTHON) -m venv $(VENV)
	@echo "make: installing $(TORCH_SPEC) ($(if $(filter command line environment,$(origin TORCH_SPEC)),TORCH_SPEC given,$(if $(filter 1,$(GPU)),the CUDA build: a GPU was found or GPU=1 asked for it,the CPU build: no GPU found; GPU=1 asks for the CUDA build)))"
	$(PY) -m pip install -q -c constraints.txt "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,data,docs]"
	@$(PY) -c "import torch; print('make: installed torch', torch.__version__, '-', 'CUDA ' + torch.version.cuda + ' build' if torch.version.cuda else 'CPU build')"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py $(DEMO_ARGS)

test: $(STAMP)
	$(VENV)/bin/lint-imports  # the layering contract in pyproject.toml [tool.importlinter]
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -m "not gpu" tests

docs: $(STAMP)  # the documentation site into site/ (warnings are errors); `.venv/bin/mkdocs serve` to browse
	$(VENV)/bin/mkdocs build --strict

test-gpu: $(STAMP)
	$(PY) -m pytest -q -ra -m gpu tests/gpu

bench: $(STAMP)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -c constraints.txt -e ".[bench]"
	$(PY) -m benchmarks.attention.run

figures: $(STAMP)  # redraw paper_figures/ from the committed results (never trains)
	$(PY) scripts/figures.py

clean:
	rm -rf $(VENV) lightning_logs runs .pytest_cache
