"""A run dir, or a sweep dir's jobs: the tools take either wherever they take a run dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def job_dirs(path: Path, marker: str) -> list[Path]:
    """[path] if it holds `marker` (a file or dir every run of this kind has, e.g. "profiler");
    else the sweep's numbered job dirs that hold it, in job order; else []."""
    if (path / marker).exists():
        return [path]
    if not path.is_dir():
        return []
    jobs = [d for d in path.iterdir() if d.is_dir() and d.name.isdigit() and (d / marker).exists()]
    return sorted(jobs, key=lambda d: int(d.name))


def wrote_no_checkpoint(path: Path) -> str | None:
    """One line, where the run at path (or every job of a sweep at path) ran with trainer.checkpoint=false
    and so wrote no checkpoint (read from its .hydra/config.yaml, as global rank 0 wrote it); else None."""
    runs = job_dirs(path, ".hydra")
    if not runs or any(_trainer(run).get("checkpoint", True) is not False for run in runs):
        return None
    which = f"its {len(runs)} jobs" if runs != [path] else "it"
    return (
        f"{path} holds no checkpoint: {which} ran with trainer.checkpoint=false (the sweeps' experiments set it); "
        "train again with trainer.checkpoint=true to keep the model"
    )


def _trainer(run: Path) -> dict[str, Any]:
    """The run's trainer keys as composed ({} where its config is missing or not a mapping)."""
    path = run / ".hydra" / "config.yaml"
    config = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    trainer = config.get("trainer") if isinstance(config, dict) else None
    return trainer if isinstance(trainer, dict) else {}
