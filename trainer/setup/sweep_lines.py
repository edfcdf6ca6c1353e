"""What a sweep prints of its own: a first line where every job runs on one process, a result line
per job, and a last line (how many jobs ran, their dir, and the command that reports them).

A Hydra callback (conf/config.yaml's hydra.callbacks), so every route prints the same: multirun
inside torchrun (each rank runs the sweep; global rank 0 prints), the torchrun launcher plugin and
submitit (each job's global rank 0 prints its line, a submitit task into its .submitit/ log; the
launching process prints the last).
A job's console shows only warnings and errors (conf/hydra/job_logging): its result line stands
under Hydra's `#N : <overrides>` line, and its whole report is in its run dir's train_rank0.log.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from trainer.windows import SUMMARY_WINDOWS, grouped

# Hydra's default launcher: the jobs run one after another inside the process that `python train.py -m` started.
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
ONE_PROCESS_LINE = (
    "sweep: each job runs on one process (world size 1); for N ranks per job: "
    "python -m trainer.tools.launch --nproc_per_node=N train.py -m ..., "
    "or add hydra/launcher=torchrun hydra.launcher.nproc_per_node=N"
)
# A job's result line: summary.json's keys, in this order, where the job has them.
RESULT_KEYS = (
    ("train/loss", ".4f"),
    ("train/accuracy", ".3f"),
    ("eval/loss", ".4f"),
    ("eval/accuracy", ".3f"),
    ("eval/perplexity", ".2f"),
)


def sweep_line(sweep_dir: Path) -> str:
    """'sweep: 4 jobs in multirun/x; report: python -m trainer.tools.report multirun/x' (plus jobs left unfinished)."""
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    unfinished = [p.name for p in jobs if not (p / "summary.json").is_file()]
    missing = f" ({len(unfinished)} without a summary.json: {', '.join(unfinished)})" if unfinished else ""
    return f"sweep: {len(jobs)} jobs in {sweep_dir}{missing}; report: python -m trainer.tools.report {sweep_dir}"


def job_line(num: int, summary: dict[str, Any], run_dir: str) -> str:
    """'#0 done: 20 steps, train/loss 1.8994, ... (last row), ..., 18954 samples/s (whole-run mean); full
    report: <run dir>/train_rank0.log'."""
    facts = [f"{summary['steps']} steps"] if "steps" in summary else []
    # Each number followed by its window (trainer/windows.py), as the job's own report prints them.
    present = [(key, spec) for key, spec in RESULT_KEYS if summary.get(key) is not None]
    numbers = [(SUMMARY_WINDOWS[key], f"{key} {summary[key]:{spec}}") for key, spec in present]
    if "throughput/global_samples_per_s" in summary:
        key = "throughput/global_samples_per_s"
        numbers.append((SUMMARY_WINDOWS[key], f"{summary[key]:.0f} samples/s"))
    if numbers:
        facts.append(grouped(numbers, sep=", "))
    done = f"done: {', '.join(facts)}" if facts else "done"  # a summary without numbers: {} (none was written)
    return f"#{num} {done}; full report: {Path(run_dir) / 'train_rank0.log'}"


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


class SweepLines(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Under torchrun (RANK set) every job already has its ranks; another launcher was chosen on purpose.
        if "RANK" not in os.environ and config.hydra.launcher.get("_target_") == BASIC_LAUNCHER:
            print(ONE_PROCESS_LINE, flush=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:  # a single run prints its whole report itself
            return
        summary = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
        if _is_rank0() and isinstance(summary, dict):  # a failed job has said why, on stderr
            print(job_line(int(config.hydra.job.num), summary, str(config.hydra.runtime.output_dir)), flush=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if _is_rank0() and sweep_dir.is_dir():
            print(sweep_line(sweep_dir), flush=True)
