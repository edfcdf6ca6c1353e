"""The launcher the README tells people to use (`make train`, python -m trainer.tools.launch): torchrun
with the command line checked once before any worker starts, and a failed worker as one line.

How long a refusal takes is measured side by side in `benchmarks/overhead.py command`, not asserted here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import CPU, TRAIN, env, launch, output, train_rows
from tests.compose import REPO
from tests.test_reliability import BASE

pytestmark = pytest.mark.slow

TYPO_LINE = "configuration error: 'trainer.max_step' is not a config key. Did you mean trainer.max_steps?"


def test_make_train_refuses_a_typo_in_one_line_with_exit_2_before_any_worker() -> None:
    # What a newcomer types, from the repo root as the README says; a sub-make would print its directory.
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    before = sorted((REPO / "outputs").glob("*")) if (REPO / "outputs").exists() else []
    proc = subprocess.run(
        ["make", "train", "ARGS=trainer.max_step=10"], cwd=REPO, env=make_env, capture_output=True, text=True
    )
    assert proc.returncode == 2, output(proc)
    ours, makes = proc.stderr.splitlines()[0], proc.stderr.splitlines()[1:]
    assert ours.startswith(TYPO_LINE) and proc.stdout == "", output(proc)
    assert len(makes) == 1 and makes[0].startswith("make: ***") and makes[0].endswith("Error 2"), output(proc)
    after = sorted((REPO / "outputs").glob("*")) if (REPO / "outputs").exists() else []
    assert after == before  # no run dir: no worker started, Hydra's app never ran


def test_a_bad_input_found_inside_the_app_is_one_line_and_the_rank_exit_code(tmp_path: Path) -> None:
    # The command line is fine; the data root is not: only the workers can find that out.
    proc = launch(["data=mnist", f"data.root={tmp_path / 'none'}", "logger=none", CPU], cwd=tmp_path)
    text = output(proc)
    assert proc.returncode == 2, text
    assert [line for line in text.splitlines() if "configuration error:" in line] == [
        next(line for line in text.splitlines() if line.startswith("configuration error: data.root="))
    ], text
    assert text.splitlines()[-1].startswith("launch: rank 0 exited with code 2: bad input"), text
    for torchrun_noise in ("ChildFailedError", "Traceback", "Sending process", "failed (exitcode"):
        assert torchrun_noise not in text, text


def test_a_crash_in_training_exits_1_naming_the_rank(tmp_path: Path) -> None:
    args = ["logger=none", CPU, "trainer.max_steps=20", "trainer.fault.rank=1", "trainer.fault.at_step=3"]
    proc = launch(args, cwd=tmp_path)
    text = output(proc)
    assert proc.returncode == 1, text
    assert "training failed: StepFailed: step 3 on rank 1" in text, text
    last = text.splitlines()[-1]
    assert last.startswith("launch: rank ") and "exited with code 1: a failure in training" in last, text
    assert "ChildFailedError" not in text and "Root Cause" not in text, text


def test_a_worker_killed_by_a_signal_makes_the_launcher_exit_128_plus_the_signal(tmp_path: Path) -> None:
    # trainer.fault's kill_in_save: rank 0 SIGKILLs itself in step 2's checkpoint save (no handler can run),
    # as the OOM killer or `kill -9` would. torchrun reports its exit code as -9; a shell says 137.
    kill = ["trainer.fault.rank=0", "trainer.fault.at_step=2", "trainer.fault.kind=kill_in_save"]
    args = [*BASE, CPU, "trainer.max_steps=6", "trainer.checkpoint_every_n_steps=2", *kill]
    proc = launch([*args, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    text = output(proc)
    assert proc.returncode == 128 + signal.SIGKILL, text
    assert "kill_in_save on rank 0 at step 2" in text, text  # the fault fired: the kill was the one asked for
    assert text.splitlines()[-1] == (
        "launch: rank 0 was killed by SIGKILL (exit code 137 = 128 + 9): no handler of its own ran, so its logs "
        "end where it was killed"
    ), text
    # Rank 1, in the save's barrier, either is stopped by torchrun (143) or first loses its peer there and
    # reports that failure with its traceback: either way rank 0 failed first, and the launcher says so.
    for torchrun_noise in ("ChildFailedError", "Root Cause", "Sending process", "failed (exitcode"):
        assert torchrun_noise not in text, text


def test_a_global_batch_the_ranks_cannot_share_is_refused_before_any_worker(tmp_path: Path) -> None:
    # 64 samples do not split over 3 ranks: the launcher knows the world size from its own arguments.
    proc = launch(["trainer.global_batch_size=64", "logger=none", CPU], cwd=tmp_path, nproc=3)
    text = output(proc)
    assert proc.returncode == 2, text
    assert text.strip().splitlines() == [
        "configuration error: trainer.global_batch_size=64 is invalid on 3 rank(s) x "
        "trainer.grad_accum_steps=1: accepted: a multiple of 3"
    ], text
    assert not (tmp_path / "outputs").exists()  # no worker started: Hydra's app never ran


def _launch_until_rows(args: list[str], run: Path, rows: int) -> subprocess.Popen[str]:
    """The launcher in its own process group, as a shell runs a foreground job, once rank 0 logged `rows` rows."""
    cmd = [sys.executable, "-m", "trainer.tools.launch", "--standalone", "--nproc_per_node=2", TRAIN, *args]
    proc = subprocess.Popen(
        cmd,
        cwd=run.parent,
        env={**env(), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics, deadline = run / "metrics" / "rank0.jsonl", time.monotonic() + 120
    while not (metrics.exists() and len(train_rows(metrics)) >= rows) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.1)
    return proc


def _assert_stopped_quietly(text: str, line: str) -> None:
    """The lab's lines only: no traceback (torchrun's SignalException), no rank reporting a failure."""
    for noise in ("Traceback", "SignalException", "training failed", "Connection closed", "death signal"):
        assert noise not in text, text
    assert [ours for ours in text.splitlines() if ours.startswith("launch:")] == [line], text
    assert text.splitlines()[-1] == line, text


STOP_ARGS = [*BASE, CPU, "trainer.max_steps=100000", "trainer.checkpoint_every_n_steps=2"]


def test_ctrl_c_through_the_launcher_is_one_line_and_exit_130_keeping_what_was_written(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _launch_until_rows([*STOP_ARGS, f"hydra.run.dir={run}"], run, rows=3)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the signal to the whole foreground group
    text = proc.communicate(timeout=90)[0]
    assert proc.returncode == 130, text
    line = (
        "launch: interrupted by Ctrl-C (SIGINT): the ranks stopped after their current step; "
        "what they wrote is kept (each rank's line says whether that includes a checkpoint)"
    )
    _assert_stopped_quietly(text, line)
    assert "[rank0] interrupted at step " in text, text
    # What the line promises: every rank's log and metrics, and the checkpoints written before the signal.
    for rank in (0, 1):
        assert "interrupted at step" in (run / f"train_rank{rank}.log").read_text()
        assert train_rows(run / "metrics" / f"rank{rank}.jsonl")
    assert (run / "checkpoints" / "last.pt").is_file()


def test_sigterm_to_the_launcher_is_one_line_and_exit_143(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _launch_until_rows([*STOP_ARGS, f"hydra.run.dir={run}"], run, rows=3)
    proc.send_signal(signal.SIGTERM)  # the launcher alone, as `kill` or a scheduler sends it: torchrun passes it on
    text = proc.communicate(timeout=90)[0]
    assert proc.returncode == 143, text
    line = (
        "launch: stopped by SIGTERM: the ranks stopped after their current step; "
        "what they wrote is kept (each rank's line says whether that includes a checkpoint)"
    )
    _assert_stopped_quietly(text, line)
    for rank in (0, 1):  # each rank says where it stopped (a launcher may have stopped only some)
        assert f"[rank{rank}] terminated by signal (exit code 143) at step " in text, text


def test_ctrl_c_while_the_launcher_imports_torch_is_one_line_and_exit_130(tmp_path: Path) -> None:
    # Half a second in, the launcher is importing torch (a second or more): no worker, no traceback.
    cmd = [sys.executable, "-m", "trainer.tools.launch", "--standalone", "--nproc_per_node=2", TRAIN, CPU]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env={**env(), "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)  # the launcher alone: no worker has started
        text = proc.communicate(timeout=60)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):  # a Ctrl-C lost in torch's import: the job started
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, text
    assert text.strip().splitlines() == ["launch: interrupted by Ctrl-C (SIGINT) before any worker started"], text
    assert not (tmp_path / "outputs").exists()
