"""The W&B logger: offline with no network use at all (even with WANDB_MODE unset), one run per rank
for every attempt of a job, metric definitions, a flat config and rank 0's per-rank table. Real wandb,
in child processes; the torchrun versions of these are in test_wandb_runs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compose import REPO
from tests.network_audit import run_audited
from trainer.logger.wandb import final_keys, flatten, ranks_table_data, run_id
from trainer.logger.wandb_files import find_runs

# Under the network audit (tests/network_audit.py): open, log and close an offline run.
LOGGER = """
from trainer.logger.wandb import WandbLogger
logger = WandbLogger("offline", "p", None, dir=sys.argv[1], name="rank-0", group="g", run_config={"a": 1}, rank=0)
logger.log({"step": 1, "train/loss": 1.0})
logger.close()
logger.close()  # closing twice is harmless
"""


def test_offline_logger_never_touches_the_network(tmp_path: Path) -> None:
    out = run_audited(LOGGER, [str(tmp_path)], timeout_s=120)
    assert out.returncode == 0, out.stderr
    assert "NETWORK []" in out.stdout, out.stdout
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_run_id_is_deterministic_valid_and_tells_runs_and_ranks_apart(tmp_path: Path) -> None:
    ids = {run_id(tmp_path / d, r) for d in ("a", "b", "sweep/0", "sweep/1") for r in (0, 1)}
    assert len(ids) == 8  # the run dir (a multirun job's number included) and the rank make the id
    assert run_id(tmp_path / "a", 1) == run_id(str(tmp_path / "a"), 1) == run_id(tmp_path / "x" / ".." / "a", 1)
    assert run_id(tmp_path / "sweep" / "3", 0).startswith("sweep-3-")
    long = run_id(tmp_path / "my sweep: lr=0.1, bs=#32" / "run?" / "12", 12)
    assert long.endswith("-rank12") and len(long) <= 48, long
    assert all(c.isalnum() or c in "-_" for c in long) and long.startswith("run-12-")
    assert run_id(tmp_path / "???", 0).startswith("run-")


def test_flat_config_final_keys_and_ranks_table() -> None:
    assert flatten({"sync": {"bucket_cap_mb": 5, "hooks": {}}, "run": {"versions": {"torch": "2"}}, "x": [1]}) == {
        "sync.bucket_cap_mb": 5,
        "sync.hooks": {},
        "run.versions.torch": "2",
        "x": [1],
    }
    assert final_keys({"steps": 3, "train/loss": 0.5, "sync": {"a": 1}}) == {
        "steps": 3,
        "final/train/loss": 0.5,
        "sync": {"a": 1},
    }
    columns, rows = ranks_table_data(
        [
            {"samples_per_s": 2.0, "rank": 0, "host": "h0", "outputs": ["x"], "median_time/step_s": 0.1},
            {"samples_per_s": 3.0, "rank": 1, "host": "h1", "outputs": [], "median_time/step_s": None},
        ]
    )
    assert columns == ["rank", "host", "median_time/step_s", "samples_per_s"]
    assert rows == [[0, "h0", 0.1, 2.0], [1, "h1", None, 3.0]]


# One rank's run over two attempts of a job: the first logs steps 1..4 and "crashes" before its
# summary, the second (a restart from a checkpoint at step 2) is given 3..6 and finishes.
ATTEMPTS = """
import json, sys
from trainer.logger.wandb import WandbLogger
root, rank, first, last, summary = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
logger = WandbLogger("offline", "p", None, dir=root, name=f"rank-{rank}", group="job", rank=rank,
                     run_config={"sync": {"bucket_cap_mb": 5}, "run": {"rank": rank}})
print("CONTINUES", logger.logged_through)
for step in range(first, last + 1):
    loss = [0.9, 0.3, 0.6, 0.5, 0.4, 0.7][step - 1]  # the last is not the lowest
    logger.log({"step": step, "train/loss": loss, "train/accuracy": 1 - loss, "time/step_s": 0.1 * step})
    if step % 2 == 0:
        logger.log({"step": step, "eval/loss": loss, "eval/accuracy": 1 - loss})
if summary == "yes":
    ranks = [{"rank": r, "host": "h", "samples_per_s": 10.0 + r, "outputs": ["o"]} for r in (0, 1)]
    logger.log_summary({"steps": last, "train/loss": 0.55, "eval/accuracy": 0.3, "ranks": ranks, "rank": ranks[rank]})
logger.close(0 if summary == "yes" else 1)
"""


def _attempt(root: Path, rank: int, first: int, last: int, summary: bool) -> int:
    out = subprocess.run(
        [sys.executable, "-c", ATTEMPTS, str(root), str(rank), str(first), str(last), "yes" if summary else "no"],
        env={**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split("CONTINUES")[1].split()[0])


@pytest.fixture(scope="module")
def attempts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("attempts")
    assert _attempt(root, 0, 1, 4, summary=False) == -1  # a fresh run: nothing to skip
    assert _attempt(root, 0, 3, 6, summary=True) == 4  # the restart: steps up to 4 are in the run
    return root


def test_every_attempt_continues_the_same_run_and_logs_each_step_once(attempts: Path) -> None:
    runs = find_runs(attempts)
    assert len(runs) == 2 and {run.run_id for run in runs} == {run_id(attempts, 0)}
    assert sorted(run.exit_code for run in runs) == [0, 1]  # two offline dirs, one run
    steps = sorted(row["step"] for run in runs for row in run.history)
    assert steps == [1, 2, 3, 4, 5, 6]  # 3 and 4 logged by the first attempt only
    assert all(row["_step"] == row["step"] for run in runs for row in run.history)


def test_metric_definitions_flat_config_final_summary_and_table(attempts: Path) -> None:
    (run,) = [run for run in find_runs(attempts) if run.exit_code == 0]
    assert run.config == {"sync.bucket_cap_mb": 5, "run.rank": 0}
    definition = {"step_metric": "step", "summary": ["last", "min"], "hidden": False, "step_sync": True}
    assert run.metrics["train/loss"] == definition
    assert run.metrics["eval/accuracy"]["summary"] == ["last", "max"]
    assert run.metrics["time/*"]["summary"] == ["mean"] and run.metrics["memory/*"]["step_metric"] == "step"
    # The metric's own aggregates, over this attempt's rows (3..6 were its to log: 5 and 6)...
    assert run.summary["train/loss"] == {"min": 0.4, "last": 0.7}
    assert run.summary["eval/accuracy"] == {"max": pytest.approx(0.3), "last": pytest.approx(0.3)}
    assert run.summary["time/step_s"] == {"mean": pytest.approx(0.55)}
    assert run.summary["final/train/loss"] == 0.55 and run.summary["final/eval/accuracy"] == 0.3  # ...the job's
    assert run.summary["steps"] == 6 and run.summary["rank"]["rank"] == 0
    table = run.summary["ranks"]
    assert table["_type"] == "table-file" and (table["ncols"], table["nrows"]) == (3, 2)
    content = json.loads((run.path / "files" / table["path"]).read_text())
    assert content["columns"] == ["rank", "host", "samples_per_s"]
    assert content["data"] == [[0, "h", 10.0], [1, "h", 11.0]]
