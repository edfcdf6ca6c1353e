"""One W&B run per rank for the life of a job, under the real torchrun (slow): a job stopped by a crash,
then run again (resume) with an elastic restart inside, leaves one run id per rank whose offline dirs
hold each step once; plus the metric definitions, the flat config and rank 0's per-rank table.

Two launches serve every test: A crashes at step 15 (checkpoint at 10, no restarts); B, the same
command with the fault moved to step 17 and --max-restarts=1, resumes from 10, crashes at 17, and its
restart resumes from 10 again and finishes at 20. Three attempts, so three offline dirs per rank.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tests.cli import CPU, TORCHRUN, TRAIN, jsonl, output, run_torchrun
from tests.test_reliability import BASE
from trainer.logger.wandb import run_id
from trainer.logger.wandb_files import OfflineRun, find_runs

pytestmark = pytest.mark.slow

ARGS = [
    *BASE,
    CPU,
    "logger=wandb",
    "run_name=job",  # the W&B group; a launch without it would be named after its start time
    "trainer.max_steps=20",
    "trainer.checkpoint_every_n_steps=10",
    "trainer.eval_every_n_steps=10",
    "trainer.fault.rank=1",
]


def _launch(run_dir: Path, at_step: int, restarts: int) -> str:
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}", TRAIN, *ARGS]
    cmd += [f"trainer.fault.at_step={at_step}", f"hydra.run.dir={run_dir}"]
    proc = run_torchrun(cmd, cwd=run_dir.parent, timeout_s=300)
    text = output(proc)
    assert (proc.returncode == 0) == (restarts > 0), text
    return text


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[OfflineRun], str]:
    """The run dir after both launches, the runs A left, and B's output."""
    run_dir = tmp_path_factory.mktemp("wandb_runs") / "run"
    text = _launch(run_dir, at_step=15, restarts=0)
    assert "injected fault" in text
    first = find_runs(run_dir, tail_ok=True)
    text = _launch(run_dir, at_step=17, restarts=1)
    assert text.count(f"resumed from {run_dir / 'checkpoints' / 'last.pt'} at step 10") == 2, text
    return run_dir, first, text


def _by_id(runs: list[OfflineRun]) -> dict[str, list[OfflineRun]]:
    ids: dict[str, list[OfflineRun]] = {}
    for run in runs:
        ids.setdefault(run.run_id, []).append(run)
    return ids


def test_each_rank_keeps_one_run_id_across_crash_resume_and_restart(job) -> None:
    run_dir, first, _ = job
    expected = {run_id(run_dir, rank): f"rank-{rank}" for rank in (0, 1)}
    assert {run.run_id: run.name for run in first} == expected and len(first) == 2  # A: one dir per rank
    runs = find_runs(run_dir, tail_ok=True)
    by_id = _by_id(runs)
    assert sorted(by_id) == sorted(expected)
    for rid, attempts in by_id.items():
        assert len({run.path for run in attempts}) == 3, [run.path.name for run in attempts]  # A, B, B's restart
        assert {run.name for run in attempts} == {expected[rid]} and {run.group for run in attempts} == {"job"}
        assert sorted(run.exit_code or 0 for run in attempts).count(0) == 1  # only the last attempt succeeded


def test_each_step_is_in_a_run_once_with_the_values_of_the_jsonl(job) -> None:
    run_dir, _, _ = job
    for rank in (0, 1):
        runs = [run for run in find_runs(run_dir, tail_ok=True) if run.run_id == run_id(run_dir, rank)]
        rows = [row for run in runs for row in run.history]
        counts = Counter(row["step"] for row in rows)
        assert sorted(counts) == list(range(2, 21, 2)) and set(counts.values()) == {1}, counts
        assert sorted(row["step"] for row in rows if "eval/loss" in row) == [10, 20]
        logged = {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}
        # A restarted attempt recomputes the steps after its checkpoint bit for bit: whichever
        # attempt's row a step kept, the JSONL's last row for that step holds the same loss.
        jsonl_rows = jsonl(run_dir / "metrics" / f"rank{rank}.jsonl")
        mine = {row["step"]: row["train/loss"] for row in jsonl_rows if "train/loss" in row}
        assert logged == mine


def _last(run_dir: Path, rank: int) -> OfflineRun:
    (run,) = [r for r in find_runs(run_dir) if r.run_id == run_id(run_dir, rank) and r.exit_code == 0]
    return run


def test_metric_definitions_flat_config_and_final_summary(job) -> None:
    run_dir, _, _ = job
    for rank in (0, 1):
        run = _last(run_dir, rank)
        assert run.config["run.rank"] == rank and run.config["run.world_size"] == 2
        assert run.config["sync.bucket_cap_mb"] == 25 and run.config["trainer.max_steps"] == 20
        assert not any(isinstance(value, dict) and value for value in run.config.values())  # flat
        assert run.metrics["train/loss"]["summary"] == ["last", "min"]
        assert run.metrics["eval/accuracy"]["summary"] == ["last", "max"]
        assert run.metrics["time/*"] == {"step_metric": "step", "summary": ["mean"], "hidden": False, "step_sync": True}
        assert set(run.summary["train/loss"]) == {"min", "last"} and set(run.summary["time/step_s"]) == {"mean"}
        assert run.summary["steps"] == 20 and run.summary["rank"]["rank"] == rank
        summary = json.loads((run_dir / "summary.json").read_text())
        assert run.summary["final/train/loss"] == summary["train/loss"]  # the job's number, beside the aggregates
        assert run.summary["final/eval/accuracy"] == summary["eval/accuracy"]


def test_rank_0_run_carries_the_per_rank_table(job) -> None:
    run_dir, _, _ = job
    run = _last(run_dir, 0)
    table = run.summary["ranks"]
    assert table["_type"] == "table-file" and table["nrows"] == 2
    content = json.loads((run.path / "files" / table["path"]).read_text())
    assert content["columns"][:2] == ["rank", "host"] and "samples_per_s" in content["columns"]
    assert [row[0] for row in content["data"]] == [0, 1]
    assert "ranks" not in _last(run_dir, 1).summary
