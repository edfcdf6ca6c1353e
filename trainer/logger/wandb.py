"""One W&B run per rank, named rank-{r}, all ranks of a job in one group, for the life of the job.

The run's id is derived from the run dir and the rank (run_id below), so an elastic restart or a
re-run that resumes (trainer.resume=auto) continues the same run instead of adding one: online,
W&B appends to it; offline, every attempt writes its own offline-run-*-<id> directory and
`wandb sync` uploads them one after another into that one run. Steps the run already holds are
not logged again, so its history has each step once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Literal

from trainer.windows import JOINED, ROW

log = logging.getLogger(__name__)

# W&B's own files outside a run (wandb-core's debug logs under the cache dir, artifact staging under
# the data dir) default to ~/.cache/wandb and ~/.local/share/wandb; they go into the run dir's wandb/
# unless the user chose these places before the process started.
OWN_DIRS = {"WANDB_CACHE_DIR": "cache", "WANDB_DATA_DIR": "data"}
USER_SET = frozenset(name for name in OWN_DIRS if name in os.environ)

Mode = Literal["offline", "online", "disabled"]  # the schema's choices for logger.mode
# Every metric is plotted against `step`, the optimizer step, not W&B's own row counter, and some
# are aggregated in the run's summary (the runs table, a sweep's parallel coordinates): None keeps
# W&B's default, the last value. No catch-all "*": wandb-core picks among matching globs in no fixed
# order, so "time/*" would lose its mean to "*" now and then. Exact names win over globs.
METRICS: dict[str, str | None] = {
    "train/loss": "min,last",
    "eval/loss": "min,last",
    "train/accuracy": "max,last",
    "eval/accuracy": "max,last",
    "time/*": "mean",
    "epoch": None,
    **{f"{prefix}/*": None for prefix in ("train", "eval", "throughput", "memory", "comm", "sync")},
}
FINAL = "final/"  # the job's end-of-run numbers, kept apart from the metrics' own aggregates
TABLE_KEY = "ranks"  # rank 0's summary: one row per rank, from summary.json's "ranks"
SCALAR = (int, float, str)  # what a table cell holds; a rank's list of outputs is left out


def run_id(run_dir: str | Path, rank: int) -> str:
    """W&B id of this rank's run: a readable prefix, a hash of the absolute run dir, the rank.

    Deterministic, so every attempt of a job (elastic restart, resume) names the same run. Only
    the run dir tells jobs apart (it holds the multirun job number); not the run name, which is a
    new start time on every launch unless set. The prefix, the run dir's name (with its parent's
    for a multirun job's number), only helps humans. Letters, digits, - and _ only.
    """
    path = Path(run_dir).resolve()
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"{path.parent.name}-{path.name}" if path.name.isdigit() else path.name
    prefix = re.sub(r"[^A-Za-z0-9_]+", "-", name).strip("-_")[:24] or "run"
    return f"{prefix}-{digest}-rank{rank}"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config as Hydra's dotted keys (`sync.bucket_cap_mb`): what W&B groups and plots by."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def final_keys(summary: dict[str, Any]) -> dict[str, Any]:
    """The job's summary with metric-named keys (`train/loss`) moved under `final/`: those names
    hold the metric's own aggregates (min, max, mean), which the job's numbers must not replace."""
    return {(f"{FINAL}{key}" if "/" in key else key): value for key, value in summary.items()}


def ranks_table_data(ranks: list[dict[str, Any]]) -> tuple[list[Any], list[list[Any]]]:
    """Columns and rows of the per-rank table: scalar fields only, rank and host first."""
    columns: list[Any] = []  # names (str); wandb.Table's annotation wants list[str | int]
    for record in ranks:
        columns += [k for k, v in record.items() if k not in columns and (v is None or isinstance(v, SCALAR))]
    columns.sort(key=lambda c: (c not in ("rank", "host"), c != "rank", c))
    return columns, [[record.get(c) for c in columns] for record in ranks]


def last_offline_step(run_dir: str | Path, run_id: str) -> int | None:
    """The largest `step` in this id's earlier offline runs under run_dir/wandb, or None.

    Read with tail_ok: a killed attempt's file may end mid-record and has no exit record. Rows
    the killed process never flushed (wandb-core writes every ~15 s and at finish) are not in
    it, so a restarted run logs those steps again, once.
    """
    from trainer.logger.wandb_files import read_run

    steps: list[Any] = []
    for path in sorted(Path(run_dir).glob(f"wandb/offline-run-*/run-{run_id}.wandb")):
        try:
            history = read_run(path, tail_ok=True).history
        except ValueError as err:  # a damaged file: keep going, its steps may then appear twice
            log.warning("cannot read earlier W&B run %s: %s", path, err)
            continue
        steps += [row.get("step", row.get("_step")) for row in history]
    return max((s for s in steps if isinstance(s, int)), default=None)


class WandbLogger:
    """Starts (or continues) this rank's run on construction; offline runs land in
    <run dir>/wandb/offline-run-*-<id>."""

    def __init__(
        self,
        mode: Mode,
        project: str,
        entity: str | None,
        *,
        dir: str,
        name: str,
        group: str,
        run_config: dict[str, Any],
        rank: int,
    ) -> None:
        import wandb  # here, so that logger=none never imports W&B

        self._wandb = wandb
        self._rank = rank
        self.run_id = run_id(dir, rank)
        # Before init: this attempt's own offline dir must not count.
        earlier = last_offline_step(dir, self.run_id) if mode == "offline" else None
        for variable, sub in OWN_DIRS.items():
            if variable not in USER_SET:
                os.environ[variable] = str(Path(dir) / "wandb" / sub)
        # wandb 0.31 sends its own usage telemetry based on the global settings, not init()'s, so
        # offline must be set here too, or an "offline" run still reaches for the network at exit.
        wandb.setup(settings=wandb.Settings(mode=mode))
        # mode is always passed explicitly: without it and without an API key wandb.init fails.
        self._run = wandb.init(
            mode=mode,
            project=project,
            entity=entity,
            dir=dir,
            id=self.run_id,
            resume="allow",  # the same run for every attempt of the job
            name=name,
            group=group,
            config=flatten(run_config),
            # Each rank already has its own log file; W&B's stdout capture would only duplicate it.
            settings=wandb.Settings(console="off", silent=True),
        )
        if mode == "online" and self._run.resumed:
            earlier = self._run.starting_step - 1  # W&B's next step, which our steps equal
        self.logged_through = -1 if earlier is None else earlier  # rows up to here are in the run already
        if earlier is not None:
            log.info("W&B run %s continues after step %d", self.run_id, earlier)
        self._run.define_metric("step")
        for metric, summary in METRICS.items():
            self._run.define_metric(metric, step_metric="step", summary=summary)
        self.location: str | None = self._run.dir.removesuffix("/files") if mode == "offline" else self._run.url
        self._closed = False
        self._kinds: tuple[int, list[str]] = (-1, [])  # the step being logged, the kinds of row logged at it

    def log(self, row: dict[str, Any]) -> None:
        step = row["step"]
        if step <= self.logged_through:  # an earlier attempt of this run logged it
            return
        # W&B keeps one history row per step, merging what is logged at it: its `row` names every
        # kind the step logged (train+eval), not only the last.
        if self._kinds[0] != step:
            self._kinds = (step, [])
        if ROW in row:
            self._kinds[1].append(row[ROW])
            row = {**row, ROW: JOINED.join(self._kinds[1])}
        self._run.log(row, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self._run.summary.update(final_keys({k: v for k, v in summary.items() if k != TABLE_KEY}))
        ranks = summary.get(TABLE_KEY)
        if self._rank == 0 and ranks:  # global rank 0: the job's table, once
            columns, data = ranks_table_data(ranks)
            self._run.summary[TABLE_KEY] = self._wandb.Table(columns=columns, data=data)

    def log_timeline(self, image: Path, trace: Path, step: int) -> None:
        """trainer.profile=true (rank 0): the timeline picture in the step's row, the merged trace as a file."""
        self._run.log({"profiler/timeline": self._wandb.Image(str(image))}, step=step)
        # Saved from inside the run's files dir: wandb.save of a file outside it symlinks it and warns so.
        inside = Path(self._run.dir) / trace.name
        shutil.copyfile(trace, inside)
        self._run.save(str(inside), base_path=self._run.dir, policy="now")

    def close(self, exit_code: int = 0) -> None:
        # Offline runs reach the disk only here: this must run on every exit path, SIGTERM included.
        if not self._closed:
            self._closed = True
            self._run.finish(exit_code=exit_code)
