"""report --wandb: the report's table and figure as one offline W&B run, beside the sweep's jobs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.compose import REPO
from tests.network_audit import run_audited
from tests.report_helpers import BUCKETED, DDP, comm_keys, eval_row, run_cli, train_row, write_job
from trainer.logger.wandb_files import find_runs

# The CLI under the network audit (tests/network_audit.py), as `python -m trainer.tools.report`.
REPORT = """
import runpy
sys.argv = ["report", *sys.argv[1:]]
try:
    runpy.run_module("trainer.tools.report", run_name="__main__")
except SystemExit as exc:
    assert not exc.code, exc.code
"""


def sweep(root: Path) -> Path:
    """Three jobs of a bucket sweep, one unfinished (a row all the same), in project "buckets"."""
    for job, (target, bucket, step_s) in enumerate([(DDP, 25, 0.010), (BUCKETED, "auto", 0.012), (DDP, 50, 0.02)]):
        ranks = [
            [
                *(train_row(s, step_s * (1 + rank), 0.001, 3200.0, 2.0 - s / 10, comm_keys(4e6)) for s in (2, 4, 6)),
                eval_row(6, 0.5 + job / 10),
            ]
            for rank in range(2)
        ]
        path = write_job(root / str(job), ranks, target, [f"sync.bucket_cap_mb={bucket}"], bucket, complete=job < 2)
        config = yaml.safe_load((path / ".hydra" / "config.yaml").read_text())
        config["logger"] = {"_target_": "trainer.logger.wandb.WandbLogger", "project": "buckets", "entity": None}
        (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def test_wandb_logs_the_report_as_one_offline_run_without_network(tmp_path: Path) -> None:
    root = sweep(tmp_path / "bucket-sweep")
    proc = run_audited(REPORT, [str(root), "--wandb"], timeout_s=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NETWORK []" in proc.stdout, proc.stdout
    (run,) = find_runs(root)
    assert f"W&B run 'report' (group bucket-sweep, offline): {run.path}" in proc.stdout
    assert run.path.parent == root / "wandb" and run.path.name.startswith("offline-run-")
    assert (run.name, run.group, run.project, run.exit_code) == ("report", "bucket-sweep", "buckets", 0)
    table = run.summary["report"]
    assert table["_type"] == "table-file" and table["nrows"] == 3
    logged = json.loads((run.path / "files" / table["path"]).read_text())
    with (root / "report.csv").open(newline="") as f:
        written = list(csv.DictReader(f))
    assert logged["columns"] == list(written[0])
    assert len(logged["data"]) == len(written) == 3
    for values, record in zip(logged["data"], written, strict=True):  # the same numbers as report.csv
        assert ["" if v is None else str(v) for v in values] == list(record.values())
    plot = run.summary["report_plot"]
    assert plot["_type"] == "image-file" and (run.path / "files" / plot["path"]).is_file()


def test_without_wandb_nothing_is_logged_and_the_default_project_is_ddplab(tmp_path: Path) -> None:
    root = sweep(tmp_path / "s")
    proc = run_cli(str(root))
    assert proc.returncode == 0, proc.stderr
    assert not (root / "wandb").exists() and "W&B" not in proc.stdout
    imports = "import sys, trainer.tools.report; print('wandb' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", imports], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "False", loaded.stdout + loaded.stderr  # wandb only for --wandb

    from trainer.tools.report import find_jobs
    from trainer.tools.report_wandb import project_of

    assert project_of(find_jobs(root)) == ("buckets", None)
    for job in find_jobs(root):
        job.config.pop("logger")
        assert project_of([job]) == ("ddplab", None)
