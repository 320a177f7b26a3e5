# Two entry points (see README): `make plan` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: plan test bench accuracy clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Light install: planner + simulator only (no torch, no ray).
$(VENV)/.plan-installed: pyproject.toml | $(BIN)/python
	$(PIP) install -e .
	@touch $@

# Everything the tests need. torch is installed first with its exact pin: on CPU machines that
# pin is a local CPU build, and nothing afterwards pulls a multi-GB CUDA build.
$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev,executor]'
	@touch $@ $(VENV)/.plan-installed

plan: $(VENV)/.plan-installed
	$(BIN)/hybridflow plan --out hybridflow-report

test: $(VENV)/.test-installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: $(VENV)/.test-installed
	$(BIN)/python benchmarks/bench_simulator.py
	$(BIN)/python benchmarks/bench_planner.py
	$(BIN)/python benchmarks/bench_executor.py

# Executor runs of a grid of plans (3 repeats each), calibration on some, prediction error on
# the others; writes runs/accuracy/ only (the shipped profile changes with
# `benchmarks/accuracy.py --reuse --install`). The last line is the held-out accuracy JSON.
accuracy: $(VENV)/.test-installed
	$(BIN)/python benchmarks/accuracy.py --out runs/accuracy

clean:
	rm -rf $(VENV) hybridflow-report hybridflow-compare .pytest_cache .ruff_cache
