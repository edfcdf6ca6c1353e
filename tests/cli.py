"""Run the real train.py: under the real torchrun, or as a plain single process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.compose import REPO

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
TRAIN = str(REPO / "train.py")
# For tests of the CPU path (gloo, CPU tensors, CPU-only timing): with the default trainer.device=auto
# a machine with enough GPUs would run them on nccl instead.
CPU = "trainer.device=cpu"


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}


def torchrun_cmd(args: list[str], nproc: int = 2) -> list[str]:
    # --standalone: a private rendezvous on a free port, so tests never collide on 29500.
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", TRAIN, *args]


def torchrun(args: list[str], cwd: Path, nproc: int = 2, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        torchrun_cmd(args, nproc), cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout_s
    )


def python_train(args: list[str], cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, TRAIN, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout_s
    )


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_rows(path: Path) -> list[dict[str, Any]]:
    return [row for row in jsonl(path) if "train/loss" in row]
