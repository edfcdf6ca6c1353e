# Two commands: `make train` (set up, then the demo job on 2 CPU ranks) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
ARGS ?=
# TORCH=cpu: PyTorch's CPU-only wheels from its own index, for a machine without an NVIDIA GPU: pip's
# default torch on Linux is the CUDA build, which brings about 3 GB of nvidia-* libraries along.
TORCH ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: train test test-fast lint format gpu-check setup clean

setup: $(VENV)/.installed

# Re-installs when pyproject.toml changes. torch comes from whatever index/constraints pip is
# configured with (on the project's build machines, wheels on local disk). trainer/tools/install.py is
# pip install -e '.[dev]' with two pips unpacking the wheels at once, since one pip keeps to one core.
# pip's install log goes to a file: one line on screen, its last lines and the path if it fails.
$(VENV)/.installed: pyproject.toml
	@case "$(TORCH)" in ""|cpu) ;; *) echo "TORCH=$(TORCH) is not a choice: accepted: cpu, or unset (pip's default torch)"; exit 2;; esac
	@if [ -z "$(TORCH)" ] && ! command -v nvidia-smi > /dev/null; then \
		echo "no NVIDIA GPU here: 'make $(firstword $(MAKECMDGOALS)) TORCH=cpu' would install the CPU-only torch (a .venv of about 1.2 GB, not 5.8)"; fi
	@echo "setting up $(VENV): pip install -e '.[dev]'$(if $(TORCH), with torch from $(TORCH_CPU_INDEX),) (log: $(VENV)/pip.log)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install --quiet --upgrade pip > $(VENV)/pip.log 2>&1 || \
		{ tail -n 20 $(VENV)/pip.log; echo "pip upgrade failed: the whole log is $(VENV)/pip.log"; exit 1; }
	$(if $(filter cpu,$(TORCH)),@$(BIN)/pip install torch torchvision --index-url $(TORCH_CPU_INDEX) >> $(VENV)/pip.log 2>&1 || \
		{ tail -n 20 $(VENV)/pip.log; echo "pip install of the CPU-only torch failed: the whole log is $(VENV)/pip.log"; exit 1; })
	@$(BIN)/python -m trainer.tools.install >> $(VENV)/pip.log 2>&1 || \
		{ tail -n 20 $(VENV)/pip.log; echo "pip install failed: the whole log is $(VENV)/pip.log"; exit 1; }
	@touch $@

# One thread per rank: NPROC ranks share the machine's cores. The launcher is torchrun that checks
# train.py's command line once before any worker starts (bad input: one line, exit 2; docs/running.md).
train: setup
	@OMP_NUM_THREADS=1 $(BIN)/python -m trainer.tools.launch --standalone --nproc_per_node=$(NPROC) train.py $(ARGS)

# The whole suite, slow end-to-end tests included, after the linters: this is what CI runs (.ci/run).
# Two workers (pytest-xdist), a test file to one worker so its module-scoped runs start once, the
# files in collection order (tests/conftest.py puts the longest first); the 20 slowest tests are
# listed at the end, so that drift shows in every run.
test: lint
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=20

# The house rules (pyproject.toml): ruff's lint and format check, then mypy over the packages.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Rewrites the code the way `make lint` wants it.
format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Everything that starts no process (no ranks, no torchrun, no subprocess), for a quick loop while editing.
test-fast: setup
	$(BIN)/pytest -m "not slow"

# On a machine with NVIDIA GPUs: the GPU tests, a 200-step demo on nccl, the collective and overhead
# benchmarks on CUDA, then one summary table; logs in gpu-check/. Exits 2 where there is no CUDA.
gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf outputs multirun .pytest_cache
