"""What a person sees in the terminal: Ctrl-C, the progress bar after a resume, and without a terminal."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.cli import CPU, TORCHRUN, TRAIN, env, train_rows
from tests.test_reliability import BASE
from trainer.logger.wandb_files import find_runs
from trainer.loop.progress import progress_bar

INTERRUPT = re.compile(r"\[rank(\d)\] interrupted at step (\d+); checkpoint written at step (\d+)")


def test_progress_bar_without_a_terminal_writes_lines_and_starts_at_the_resumed_step() -> None:
    out = io.StringIO()  # not a terminal
    with progress_bar(total=10, done=4, enabled=True, stream=out) as bar:
        for _ in range(6):
            bar.update(1)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert re.search(r"\b4/10\b", lines[0]), lines  # a resumed run starts where it stopped, not at 0
    assert re.search(r"\b10/10\b", lines[-1]), lines


def _run_until_rows(args: list[str], metrics: Path, rows: int) -> subprocess.Popen[str]:
    """torchrun in its own process group, as a shell runs a foreground job, once `rows` rows are logged."""
    proc = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN, *args],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(train_rows(metrics)) >= rows) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    return proc


def _ctrl_c(proc: subprocess.Popen[str]) -> str:
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the signal to the whole foreground group
    return proc.communicate(timeout=90)[0]


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_with_one_line_a_checkpoint_and_exit_130_then_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [
        *BASE,
        CPU,
        "logger=wandb",
        "trainer.progress_bar=true",
        "trainer.max_steps=100000",
        "trainer.checkpoint_on_sigterm=true",
        f"hydra.run.dir={run}",
    ]
    text = _ctrl_c(_run_until_rows(args, run / "metrics" / "rank0.jsonl", 10))
    lines = INTERRUPT.findall(text)
    assert len(lines) == 1 and lines[0][0] == "0", text  # one line, from rank 0
    step = int(lines[0][1])
    assert lines[0][2] == str(step)
    assert "KeyboardInterrupt" not in text and "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text
    for rank in (0, 1):  # every rank's log file says it, and its W&B run ended with 130
        assert f"interrupted at step {step}" in (run / f"train_rank{rank}.log").read_text()
    assert sorted(r.exit_code for r in find_runs(run)) == [130, 130]
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["step"] == step

    # The same command resumes; its bar starts at the resumed step, not at 0.
    again = _run_until_rows(args, run / "metrics" / "rank0.jsonl", len(train_rows(run / "metrics" / "rank0.jsonl")) + 3)
    text = _ctrl_c(again)
    assert f"resumed from {run / 'checkpoints' / 'last.pt'} at step {step}" in text
    first_bar = next(line for line in text.splitlines() if line.startswith("train:"))
    assert re.search(rf"\b{step}/100000\b", first_bar), first_bar
    assert int(INTERRUPT.findall(text)[0][1]) > step


@pytest.mark.slow
def test_ctrl_c_on_a_single_process_exits_130(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*BASE, CPU, "trainer.max_steps=100000", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(
        [sys.executable, TRAIN, *args], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = run / "metrics" / "rank0.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(train_rows(metrics)) >= 3) and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    text = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "interrupted at step" in text


@pytest.mark.slow
def test_ctrl_c_while_a_rank_starts_up_is_one_line_and_exit_130(tmp_path: Path) -> None:
    # Half a second in, the rank is importing torch: the Ctrl-C is taken once the imports are done.
    args = [*BASE, CPU, "trainer.max_steps=100000", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(
        [sys.executable, TRAIN, *args], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        text = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()  # a Ctrl-C lost in torch's import would leave it training
    assert proc.returncode == 130, text
    assert text.strip().splitlines() == [
        "interrupted by Ctrl-C (SIGINT) while starting up or shutting down, outside training (exit code 130)"
    ], text
