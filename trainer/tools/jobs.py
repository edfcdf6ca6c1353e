"""A run dir, or a sweep dir's jobs: the tools take either wherever they take a run dir."""

from __future__ import annotations

from pathlib import Path


def job_dirs(path: Path, marker: str) -> list[Path]:
    """[path] if it holds `marker` (a file or dir every run of this kind has, e.g. "profiler");
    else the sweep's numbered job dirs that hold it, in job order; else []."""
    if (path / marker).exists():
        return [path]
    if not path.is_dir():
        return []
    jobs = [d for d in path.iterdir() if d.is_dir() and d.name.isdigit() and (d / marker).exists()]
    return sorted(jobs, key=lambda d: int(d.name))
