"""trainer.checkpoint=false under the real train.py and torchrun: no checkpoint is written (not at the end,
not on SIGTERM), a torchrun restart starts over and says so, the tools that read a run's checkpoint say
in one line that it wrote none, contradicting keys are refused in one line (exit 2), and the sweeps'
experiments carry it. Then a finished run re-run: one line saying so and how to train more, no report
of the steps it did not train, nothing rewritten."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli import CPU, TORCHRUN, TRAIN, jsonl, output, python_train_forked, run_torchrun, torchrun, train_rows
from tests.compose import CONF_DIR, compose_config
from trainer.tools import export, sample

QUICK = [
    CPU,
    "logger=none",
    "trainer.progress_bar=false",
    "data.num_samples=256",
    "data.num_val_samples=32",
    "trainer.log_every_n_steps=1",
]
OFF = [*QUICK, "trainer.checkpoint=false"]
# Every experiment that only measures: a sweep (or its base). gpt_tiny is sampled from in README and
# docs/gpt.md (python -m trainer.tools.sample): it keeps its checkpoint.
SWEEPS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml") if p.stem != "gpt_tiny")


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def restarted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """4 steps with trainer.checkpoint=false, rank 1 crashing at the start of step 3 under
    --max-restarts=1: torchrun restarts both ranks, which find no checkpoint and train from step 0."""
    root = tmp_path_factory.mktemp("no_checkpoint")
    args = [*OFF, "trainer.max_steps=4", "trainer.fault.rank=1", "trainer.fault.at_step=3"]
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", TRAIN, *args]
    proc = run_torchrun([*cmd, f"hydra.run.dir={root / 'run'}"], cwd=root, timeout_s=300)
    text = output(proc)
    assert proc.returncode == 0, text
    return root / "run", text


def test_a_run_without_checkpoints_writes_none_and_a_restart_starts_over(restarted: tuple[Path, str]) -> None:
    run_dir, text = restarted
    assert "injected fault" in text  # the first attempt did crash at step 3
    written = files_under(run_dir)
    assert not (run_dir / "checkpoints").exists() and not [f for f in written if f.endswith(".pt")], written
    assert "restart 1 of this job finds no checkpoint (trainer.checkpoint=false keeps none): " in text, text
    assert "training starts over at step 0" in text and "resumed from" not in text
    # Each rank's JSONL holds the steps once: the failed attempt's rows (1, 2) were dropped at the restart.
    for rank in (0, 1):
        assert [r["step"] for r in train_rows(run_dir / "metrics" / f"rank{rank}.jsonl")] == [1, 2, 3, 4]
        assert not [r for r in jsonl(run_dir / "metrics" / f"rank{rank}.jsonl") if "checkpoint/blocked_s" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and not any(k.startswith("checkpoint") for k in summary["ranks"][0])
    (line,) = [line for line in text.splitlines() if line.startswith("  run dir  ")]
    assert "checkpoints/" not in line, line  # the report does not point at a dir that is not there


def test_export_and_sample_say_in_one_line_that_the_run_wrote_none(
    restarted: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, _ = restarted
    said = f"error: {run_dir} holds no checkpoint: it ran with trainer.checkpoint=false"
    assert export.main([str(run_dir), "--out", str(tmp_path / "model.pt")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err
    assert sample.main([str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err
    assert not (tmp_path / "model.pt").exists()


def test_sigterm_writes_no_checkpoint_and_says_the_same_command_starts_over(tmp_path: Path) -> None:
    args = [*OFF, "trainer.max_steps=50", "trainer.fault.kind=sigterm", "trainer.fault.rank=0"]
    proc = torchrun([*args, "trainer.fault.at_step=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    text = output(proc)
    assert proc.returncode != 0, text
    expected = "no checkpoint (trainer.checkpoint=false); nothing to resume from: the same command starts over"
    assert f"terminated by signal (exit code 143) at step 2; {expected}" in text, text
    assert not (tmp_path / "run" / "checkpoints").exists(), files_under(tmp_path / "run")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["trainer.checkpoint=maybe"],
            "trainer.checkpoint=maybe is invalid: accepted: true or false (false: no checkpoint at all, not at the "
            "end either; a restart starts over)",
        ),
        (
            ["experiment=strategy_sweep", "trainer.checkpoint_on_sigterm=true"],
            "trainer.checkpoint_on_sigterm=true is invalid: it asks for checkpoints, but trainer.checkpoint=false "
            "writes none: add trainer.checkpoint=true",
        ),
        (
            ["trainer.checkpoint=false", "trainer.checkpoint_every_n_steps=10"],
            "trainer.checkpoint_every_n_steps=10 is invalid: it asks for checkpoints, but trainer.checkpoint=false "
            "writes none: add trainer.checkpoint=true",
        ),
    ],
    ids=["word-for-a-bool", "sigterm-save-of-a-sweep", "periodic-saves"],
)
def test_a_bad_value_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    proc = python_train_forked([*args, CPU], cwd=tmp_path, timeout_s=120)
    assert proc.returncode == 2, output(proc)
    assert proc.stderr.strip() == f"configuration error: {message}" and proc.stdout == "", output(proc)
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.parametrize("experiment", SWEEPS)
def test_the_sweeps_experiments_write_no_checkpoint(experiment: str) -> None:
    assert compose_config([f"experiment={experiment}"]).trainer.checkpoint is False


def test_the_experiment_the_docs_sample_from_keeps_its_checkpoint() -> None:
    assert compose_config(["experiment=gpt_tiny"]).trainer.checkpoint is True
    assert "experiment=gpt_tiny" in (CONF_DIR.parent / "README.md").read_text()


def _results(run_dir: Path) -> list[str]:
    """What a run leaves of its training: summary.json, checkpoints/, metrics/ (not its logs, nor Hydra's
    .hydra/, which every launch writes again)."""
    return [f for f in files_under(run_dir) if not f.endswith(".log") and not f.startswith(".hydra")]


def _finished_twice(tmp_path: Path) -> dict[str, Any]:
    run_dir = tmp_path / "run"
    # W&B offline too: the re-run must not start (empty) W&B runs either; _results holds wandb/'s files
    quick = [o if o != "logger=none" else "logger=wandb" for o in QUICK]
    args = [*quick, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"]
    first = torchrun(args, cwd=tmp_path)
    assert first.returncode == 0, output(first)
    kept = {f: (run_dir / f).read_bytes() for f in _results(run_dir)}
    again = torchrun(args, cwd=tmp_path)
    assert again.returncode == 0, output(again)
    return {"run_dir": run_dir, "first": output(first), "again": output(again), "kept": kept}


def test_rerunning_a_finished_run_says_so_in_one_line_and_measures_nothing(tmp_path: Path) -> None:
    run = _finished_twice(tmp_path)
    assert "throughput" in run["first"] and "done: 2 steps" in run["first"]
    text = run["again"]
    lines = [line for line in text.splitlines() if "this run had already finished" in line]
    assert lines == [
        "[rank0] this run had already finished (step 2 of trainer.max_steps=2): nothing trained or measured, its "
        "summary.json stands; to train more, raise trainer.max_steps (it continues from step 2); to start over, "
        "add trainer.resume=never or choose another run_name"
    ], text
    assert "done:" not in text and "throughput" not in text and "n/a" not in text, text
    assert "resumed from" not in text and "W&B run" not in text, text  # the one line says where the run stands
    # Nothing of the finished run was rewritten: its summary, checkpoints and metrics are as it left them.
    run_dir = run["run_dir"]
    now = {f: (run_dir / f).read_bytes() for f in _results(run_dir)}
    assert now.keys() == run["kept"].keys() and all(now[f] == run["kept"][f] for f in now)
