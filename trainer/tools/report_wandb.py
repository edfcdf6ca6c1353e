"""The sweep report as a W&B run of its own (report.py --wandb): the table and the figure.

One run named "report", in the sweep's project, grouped under the sweep's name, so it sits beside
the jobs' rank-N runs in the W&B UI. Kept apart from report.py because only this part needs wandb,
imported here and only when --wandb is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.tools.report_rows import Job, JobRow
from trainer.tools.report_table import csv_records

MODES = ("offline", "online", "disabled")
DEFAULT_PROJECT = "ddplab"  # conf/logger/wandb.yaml's default, for sweeps run with logger=none


def project_of(jobs: Sequence[Job]) -> tuple[str, str | None]:
    """The W&B project and entity the sweep's jobs logged to: the first job whose config names them."""
    for job in jobs:
        logger = job.config.get("logger") or {}
        if isinstance(logger, dict) and logger.get("project"):
            return str(logger["project"]), logger.get("entity") or None
    return DEFAULT_PROJECT, None


def table_data(rows: Sequence[JobRow]) -> tuple[list[str | int], list[list[Any]]]:
    """report.csv's columns and values (plain numbers, None where missing), one row per job."""
    records = csv_records(rows)
    columns: list[str | int] = list(records[0])  # wandb.Table's type for column names
    return columns, [list(rec.values()) for rec in records]


def log_report(
    rows: Sequence[JobRow], jobs: Sequence[Job], *, sweep: str, image: Path, out: Path, mode: str, title: str
) -> str:
    """Log the table and the figure as one run; returns where it went (the offline run's dir, or its URL)."""
    import wandb  # only for --wandb

    project, entity = project_of(jobs)
    # As in the W&B logger: the mode goes to setup too, or an offline run still sends telemetry at exit.
    wandb.setup(settings=wandb.Settings(mode=mode))  # type: ignore[arg-type]  # checked against MODES
    run = wandb.init(
        mode=mode,  # type: ignore[arg-type]
        project=project,
        entity=entity,
        dir=str(out),
        name="report",
        group=sweep,
        job_type="report",
        config={"sweep": sweep, "title": title, "num_jobs": len(rows)},
        settings=wandb.Settings(console="off", silent=True),
    )
    columns, data = table_data(rows)
    try:
        # bucket_cap_mb mixes numbers and settings such as "auto", as in report.csv.
        table = wandb.Table(columns=columns, data=data, allow_mixed_types=True)
        run.log({"report": table, "report_plot": wandb.Image(str(image))})
        location = run.dir.removesuffix("/files") if mode == "offline" else (run.url or "(disabled)")
    except BaseException:
        run.finish(exit_code=1)
        raise
    run.finish()  # an offline run reaches the disk only here
    return location
