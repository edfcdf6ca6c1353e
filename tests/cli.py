"""Run the real train.py: under the real torchrun, or as a plain single process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests import forks
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


def torchrun(
    args: list[str], cwd: Path, nproc: int = 2, timeout_s: float = 240, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """train.py under torchrun --standalone with nproc ranks (run_torchrun)."""
    return run_torchrun(torchrun_cmd(args, nproc), cwd, timeout_s, fresh)


def run_torchrun(
    cmd: list[str], cwd: Path, timeout_s: float = 240, fresh: bool = False
) -> subprocess.CompletedProcess[str]:
    """A `torchrun ...` command line (cmd[0] is TORCHRUN), run as subprocess.run(cmd, capture_output=True,
    text=True, timeout=timeout_s) would, with env(): torchrun's own main, forked from tests/forks.py's
    server, which forks each rank of a python script too (fresh=True: each rank a new interpreter)."""
    assert cmd[0] == TORCHRUN, cmd
    return forks.torchrun(cmd[1:], cwd, env(), timeout_s, fork_ranks=not fresh)


def launch(args: list[str], cwd: Path, nproc: int = 2, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """The launcher `make train` uses (python -m trainer.tools.launch): torchrun's arguments, then train.py's."""
    cmd = [sys.executable, "-m", "trainer.tools.launch", "--standalone", f"--nproc_per_node={nproc}", TRAIN, *args]
    run_env = {**env(), "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=cwd, env=run_env, capture_output=True, text=True, timeout=timeout_s)


def python_train(args: list[str], cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, TRAIN, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout_s
    )


def python_train_forked(args: list[str], cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """`python train.py *args` as python_train runs it, forked from tests/forks.py's server (torch imported
    once): for a test of what one process trains and prints, not of how an interpreter starts."""
    return forks.python([TRAIN, *args], cwd, env(), timeout_s)


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_rows(path: Path) -> list[dict[str, Any]]:
    return [row for row in jsonl(path) if "train/loss" in row]


def rank_exit_codes(text: str) -> dict[int, int]:
    """Each failed rank's exit code, from torchrun's failure report (-15: torchrun stopped it)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text)
    return {int(rank): int(code) for rank, code in found}


def assert_every_rank_stopped(text: str, message: str, nproc: int = 2) -> set[int]:
    """A start-up error: some rank printed it and exited (2, or 1 from Hydra), and every other rank exited
    the same way or went down with the job.

    Every rank checks its input on its own, but torchrun stops the siblings as soon as the first rank
    exits, so a slower rank may be stopped (SIGTERM: -15, or 143 once the lab handles it) before it
    gets to print the same message; one that stays quiet while rank 0 speaks is stopped the same way.
    """
    assert message in text, f"{message!r} not printed:\n{text}"
    codes = rank_exit_codes(text)
    assert sorted(codes) == list(range(nproc)), f"torchrun's report does not list every rank: {codes}\n{text}"
    own_exits = set(codes.values()) - {-15, 143}  # stopped by torchrun: killed, or its SIGTERM handled
    assert len(own_exits) == 1 and own_exits <= {1, 2}, f"exit codes {codes}\n{text}"
    return own_exits
