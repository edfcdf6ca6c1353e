"""Reliability under the real torchrun (slow): crash -> elastic restart -> bit-identical, with each
step's rows once in every rank's JSONL after the restart and a re-run, a hanging rank
failing the job within the timeout, a rank's SIGTERM losing no logged row, and SIGTERM -> checkpoint ->
resume -> the same final model as an uninterrupted run. The in-process tests are in test_reliability.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli import CPU, TORCHRUN, TRAIN, env, jsonl, output, run_torchrun, torchrun, train_rows
from tests.test_failures import assert_rank_flushed
from tests.test_jsonl_resume import steps_and_kinds
from tests.test_reliability import BASE, same
from trainer.logger.wandb_files import find_runs

SLOW_BASE = [*BASE, "trainer.max_steps=30", "trainer.checkpoint_every_n_steps=10", "trainer.eval_every_n_steps=10"]


@pytest.fixture(scope="module")
def crash(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted run; the same run with rank 1 crashing at step 15 under --max-restarts=1, which
    torchrun restarts and which resumes from step 10 and finishes; then the same command once more
    (the finished run resumed at its last step, which trains and writes nothing). Both tests below read them."""
    root = tmp_path_factory.mktemp("crash")
    straight = torchrun([*SLOW_BASE, CPU, f"hydra.run.dir={root / 'straight'}"], cwd=root)
    assert straight.returncode == 0, output(straight)
    args = [*SLOW_BASE, CPU, f"hydra.run.dir={root / 'crashed'}"]
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", TRAIN, *args]
    fault = ["trainer.fault.rank=1", "trainer.fault.at_step=15"]
    crashed = run_torchrun([*cmd, *fault], cwd=root, timeout_s=300)
    assert crashed.returncode == 0, output(crashed)
    finished = torch.load(root / "crashed" / "checkpoints" / "last.pt", weights_only=True)  # before the re-run
    again = torchrun(args, cwd=root)
    assert again.returncode == 0, output(again)
    return {"root": root, "crashed": output(crashed), "again": output(again), "finished": finished}


@pytest.mark.slow
def test_crash_then_elastic_restart_ends_bit_identical(crash: dict[str, Any]) -> None:
    text = crash["crashed"]
    assert "injected fault" in text and "resumed from" in text and "at step 10" in text
    a = torch.load(crash["root"] / "straight" / "checkpoints" / "last.pt", weights_only=True)
    b = crash["finished"]
    assert a["step"] == b["step"] == 30
    assert same(a["model"], b["model"]) and same(a["optimizer"]["state"][0], b["optimizer"]["state"][0])


@pytest.mark.slow
def test_crash_restart_and_rerun_leave_each_step_once_in_every_ranks_jsonl(crash: dict[str, Any]) -> None:
    """30 steps, checkpoints and evaluations every 10, rank 1 crashing at step 15 (rows to step 14
    written): the restarted job resumes at step 10 and finishes; the same command again finds the
    finished run at 30 and says so. Each rank's metrics/rank{r}.jsonl holds each step's rows once."""
    assert "already finished (step 30 of" in crash["again"]  # the re-run's one line, in place of "resumed from"
    expected = [(s, "train") for s in range(2, 31, 2)] + [(10, "eval"), (20, "eval"), (30, "eval")]
    expected += [(10, "checkpoint"), (20, "checkpoint"), (30, "checkpoint")]  # each save's own row, once too
    for rank in (0, 1):
        found = steps_and_kinds(crash["root"] / "crashed" / "metrics" / f"rank{rank}.jsonl")
        assert Counter(found) == Counter(expected), (rank, found)
        assert found == sorted(found, key=lambda sk: sk[0])  # in step order


@pytest.mark.slow
def test_a_hanging_rank_fails_the_job_within_the_timeout(tmp_path: Path) -> None:
    proc = torchrun(
        [
            *BASE,
            CPU,
            "trainer.max_steps=100",
            "trainer.collective_timeout_s=5",
            "trainer.step_grace_s=3",
            "trainer.fault.kind=hang",
            "trainer.fault.rank=1",
            "trainer.fault.at_step=5",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        timeout_s=120,
    )
    text = output(proc)
    assert proc.returncode != 0, text
    # Rank 0 waits one collective timeout, then fails naming the step; the hung rank gets SIGTERM
    # and stops within the step grace (trainer.step_grace_s: 3 s) instead of waiting for torchrun's
    # SIGKILL (30 s). Timed between the two ranks' own log lines, so a loaded machine's slow start-up
    # does not count.
    assert "training failed: StepFailed: step 5 on rank 0" in text and "Timed out" in text
    assert "[rank1] terminated by signal" in text
    failed = _logged_at(tmp_path / "run" / "train_rank0.log", "training failed")
    stopped = _logged_at(tmp_path / "run" / "train_rank1.log", "terminated by signal")
    assert 0 <= (stopped - failed).total_seconds() < 3 + 10, (failed, stopped)


def _logged_at(log_file: Path, message: str) -> datetime:
    """When a rank's log file recorded `message` (its lines start with [YYYY-mm-dd HH:MM:SS,mmm])."""
    line = next(line for line in log_file.read_text().splitlines() if message in line)
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")


@pytest.mark.slow
def test_a_rank_receiving_sigterm_stops_the_job_and_nothing_logged_is_lost(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = torchrun(
        [
            *BASE,
            CPU,
            "logger=wandb",
            "trainer.max_steps=100",
            "trainer.fault.kind=sigterm",
            "trainer.fault.rank=0",
            "trainer.fault.at_step=7",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode != 0, output(proc)
    for rank in (0, 1):
        (run,) = [run for run in find_runs(run_dir) if run.name == f"rank-{rank}"]
        logged = [row["_step"] for row in run.history if "train/loss" in row]
        assert logged == [row["step"] for row in train_rows(run_dir / "metrics" / f"rank{rank}.jsonl")]
        assert logged[:3] == [2, 4, 6] and run.exit_code in (1, 143)
    (rank0,) = [run for run in find_runs(run_dir) if run.name == "rank-0"]
    assert rank0.exit_code == 143  # it stopped at the end of step 7, as told


@pytest.mark.slow
def test_sigterm_checkpoint_then_resume_continues_step_count_and_schedule(tmp_path: Path) -> None:
    args = [
        *BASE,
        CPU,
        "trainer.max_steps=400",
        "trainer.checkpoint_on_sigterm=true",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    launcher = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN, *args],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics" / "rank0.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(train_rows(metrics)) >= 10) and time.monotonic() < deadline:
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)  # as Slurm preempting the job: every rank is told
    text = launcher.communicate(timeout=60)[0]
    assert launcher.returncode != 0, text
    assert "checkpoint written at step" in text
    stopped = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert 20 <= stopped < 400
    resumed = torchrun(args, cwd=tmp_path)  # the same command again: resume=auto
    assert resumed.returncode == 0, output(resumed)
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'last.pt'} at step {stopped}" in resumed.stdout
    straight = torchrun([*args[:-1], f"hydra.run.dir={tmp_path / 'straight'}"], cwd=tmp_path)
    assert straight.returncode == 0, output(straight)
    a = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(tmp_path / "straight" / "checkpoints" / "last.pt", weights_only=True)
    assert same(a["model"], b["model"])
    straight_lr = {r["step"]: r["train/lr"] for r in train_rows(tmp_path / "straight" / "metrics" / "rank0.jsonl")}
    after = [r for r in jsonl(metrics) if "train/loss" in r and r["step"] > stopped]
    assert after and all(r["train/lr"] == straight_lr[r["step"]] for r in after)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 400


@pytest.mark.slow
def test_sigterm_during_async_sharded_saves_leaves_last_where_the_log_says(tmp_path: Path) -> None:
    """A save every 2 steps, written in the background (trainer.checkpoint_async): SIGTERM arrives
    with one in flight or about to be. The line the job prints, the `last` link, the step a resume
    starts from and the checkpoints on disk all agree, and nothing half-written is left. The same
    launch shows that a SIGTERM'd job loses nothing it logged: each rank's W&B run is finished with
    every row of its JSONL."""
    run = tmp_path / "run"
    args = [*BASE, CPU, "logger=wandb", "trainer.max_steps=400", "trainer.checkpoint_on_sigterm=true"]
    args += ["trainer.checkpoint_format=sharded", "trainer.checkpoint_async=true", "trainer.checkpoint_every_n_steps=2"]
    args += [f"hydra.run.dir={run}"]
    launcher = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc_per_node=2", TRAIN, *args],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run / "metrics" / "rank0.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(train_rows(metrics)) >= 10) and time.monotonic() < deadline:
        time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)  # torchrun passes it on to every worker
    text = launcher.communicate(timeout=60)[0]
    assert launcher.returncode != 0, text
    # Each rank finishes its iteration, then stops (143). A rank that is one collective ahead sees
    # the other one leave and fails that collective instead (1). Either way, nothing logged is lost.
    for rank in (0, 1):
        assert_rank_flushed(run, rank, {1, 143})
    assert any("terminated by signal" in (run / f"train_rank{rank}.log").read_text() for rank in (0, 1))
    said = re.findall(r"checkpoint written at step (\d+)", text)
    assert said, text
    stopped = int(said[-1])
    ckpt = run / "checkpoints"
    assert os.readlink(ckpt / "last") == f"step-{stopped}", text  # what the line said is what resume finds
    assert not list(ckpt.glob(".*")), sorted(p.name for p in ckpt.iterdir())  # no save left half-written
    resumed = torchrun([*args[:-1], "trainer.max_steps=" + str(stopped + 2), f"hydra.run.dir={run}"], cwd=tmp_path)
    assert resumed.returncode == 0, output(resumed)
    assert f"at step {stopped}" in resumed.stdout, output(resumed)
