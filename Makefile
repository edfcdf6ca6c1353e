# Two commands: `make train` (set up, then the demo job on 2 CPU ranks) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
NPROC ?= 2
ARGS ?=
# TORCH=cpu: PyTorch's CPU-only wheels from its own index (TORCH_CPU_INDEX: a mirror of it, or a folder
# holding the torch and torchvision wheels), for a machine without an NVIDIA GPU: pip's default torch on
# Linux is the CUDA build, which brings about 3 GB of nvidia-* libraries along.
TORCH ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# The torch the venv holds, as its stamp records it: cpu, cuda or rocm (none for a stamp from before).
VENV_TORCH := $(shell sed -n '1s/^torch=\([a-z]*\).*/\1/p' $(VENV)/.installed 2>/dev/null)

.PHONY: train test test-fast lint format gpu-check setup clean FORCE

setup: $(VENV)/.installed

# Re-installs when pyproject.toml changes, and when TORCH=cpu asks for a torch the stamp does not record:
# then the installer finds the CPU build already there (and records it), or refuses before pip runs with
# the command that rebuilds .venv (pip does not swap a CUDA torch for the CPU one in place). An existing
# venv is kept (a `python -m venv` over it could change its Python). Without TORCH, torch comes from
# whatever index/constraints pip is configured with (on the project's build machines, wheels on local
# disk). trainer/tools/install.py says each step and its estimate on screen, pip's output in pip.log.
$(VENV)/.installed: pyproject.toml $(if $(filter-out $(VENV_TORCH),$(TORCH)),FORCE)
	@case "$(TORCH)" in ""|cpu) ;; *) echo "TORCH=$(TORCH) is not a choice: accepted: cpu, or unset (pip's default torch)"; exit 2;; esac
	@if [ -z "$(TORCH)" ] && [ ! -x $(BIN)/python ] && ! command -v nvidia-smi > /dev/null; then \
		echo "no NVIDIA GPU here: 'make $(or $(firstword $(MAKECMDGOALS)),setup) TORCH=cpu' would install the CPU-only torch (a .venv of about 1.2 GB, not 5.8)"; fi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m trainer.tools.install --log $(VENV)/pip.log --stamp $@ \
		$(if $(TORCH),--torch-index '$(TORCH_CPU_INDEX)' --command 'make $(or $(firstword $(MAKECMDGOALS)),setup) TORCH=$(TORCH)')

FORCE:

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

# What the lab's commands write in the repo root: run and sweep dirs, the W&B files of tools run there,
# the benchmarks' result dirs (collectives, gpu-check, network-check, scaling-check), data=text's token
# cache, the test and lint caches. Never .venv, conf/local/ or a data set under datasets/ (MNIST,
# CIFAR-10 fetched or put there by hand): datasets/ goes only when the token cache was all it held.
clean:
	rm -rf outputs multirun wandb collectives gpu-check network-check scaling-check datasets/tokens .pytest_cache .ruff_cache .mypy_cache
	@rmdir datasets 2> /dev/null || true
